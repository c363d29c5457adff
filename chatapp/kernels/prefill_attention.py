"""Causal attention of a prefill chunk over the cache and itself, blocked like a GEMM.

The first prefill kernel (prefill_step's phase 1 until this module) ran the decode's
matrix-vector attention once per query: every (head, token) read all cached keys and values
again, one dot product of D elements (a horizontal sum) per key. With SmolLM2 at 4,096 cached
tokens that made the prefill's attention ~0.8 s of a 1.04 s 128-token chunk (22 GFLOP/s a
core), behind llama.cpp's whole chunk.

Here one claim is a KV head and a block of QBLOCK chunk tokens: its G query heads x QBLOCK
tokens form M = G x QBLOCK query lanes, the queries transposed ([D, M], lanes contiguous), and
the keys go by in blocks of KBLOCK rows (flash attention's online softmax):

    S^T [n, m] = K_block [n, :] . Q^T [:, m]        (scores, queries in lanes)
    running max / sum per lane, P^T = exp(S^T - max) in place, O^T *= correction
    O^T [e, m] += sum_n V_block [n, e] P^T [n, m]

Both products are one micro-kernel (``microkernels.outer4x32``): 4 broadcast scalars of A times two
16-lane vectors of B per reduction step, 8 accumulators in registers (6 loads per 8 FMAs, no
horizontal sums), and every per-lane step of the softmax runs across contiguous lanes in 16-lane
vector loops (softmax_lanes.py). Each thread converts a KV head's rows once for all of its
claims on that head into float32 scratch (the cache holds float32 or float16 bits; a quantised
middle is dequantised; with integer scores the keys become bytes, chunk_scores_int.py), then
every block is read by all M queries from L1/L2.

Where the time goes (SmolLM2, 544 tokens after 4,096 cached, one thread on the 2-core Xeon,
numerics fast, ms a layer): P V 22, softmax 8-12, scores 8, the rest (preparing rows, queries)
a few. ``vdpbf16ps`` on bfloat16 pairs was tried for P V and measured slower on this Xeon (53
GMAC/s against the FMA's 72: half its rate per instruction), and a skip of blocks whose
probabilities all lie below e^-14 of the lane's max never triggered on real text. Since then
P V runs on ``outer8x32`` (16 accumulators: with 8, the FMA's latency showed; a 64-row block of
96 lanes 5.3 -> 4.5 us) and, over an 8-bit middle's rows with numerics fast, on integers: 16-bit
weights against the stored bytes, two rows a ``vpdpwssd`` (pv_prefill_int.py; such a block 3.4
us with its weights' rounding). A 544-token chunk after 4,100 cached rows, 3,100 of them in an
8-bit middle, one thread, one layer: 40-43 -> 37-39 (outer8x32) -> 32-35 ms (and the integers).

The sums run in another order than the per-query kernel (and the softmax's max moves per
block), so results equal it to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .attention import fast_exp, head_rows
from .chunk_scores_int import ROWS as K_ROWS
from .chunk_scores_int import quantise_key_rows, quantise_query_lane, scores8x32, zero_query_lane
from .decode_step import apply_rope, head_norm, phase_barrier, phase_claim, phase_done
from .half import store_f32
from .llvm import as_f32
from .microkernels import A_ROWS, outer4x32, outer8x32
from .pv_prefill_int import MAX_ROWS, middle_pv, value_pairs
from .quant_split import dequant_rows
from .softmax_lanes import lanes_exp, lanes_max, lanes_scale

LANES = 32  # query lanes per micro-kernel call: two 16-float vectors
QBLOCK = 32  # chunk tokens per claim: M = G x QBLOCK lanes, a multiple of LANES
KBLOCK = 64  # key rows per block: S^T [64, M] and the K/V blocks stay in L2 (7B: M = 32, D = 128)
_NEG = np.float32(-1e30)  # a masked score: fast_exp clamps it to ~0, never a NaN
assert KBLOCK <= MAX_ROWS  # a block's integer P V sums stay within int32 (pv_prefill_int.py)
assert KBLOCK % K_ROWS == 0 and K_ROWS % A_ROWS == 0  # the integer scores' rows stay inside a block


@njit(fastmath=True, nogil=True, cache=True)
def _fill_block(kc, vc, n_cached, kr, v_new, v_col, n0, nb, D, kb, vb, quant, q_base, n_quant, q_bits, q_group,
                rot, cos_u, sin_u, traditional, mid_values):  # pragma: no cover - jitted
    """kb/vb[0:nb] = rows n0 .. n0 + nb - 1 of the sequence [quantised middle | cache rows | chunk
    rows] as float32, rows nb .. up to the next multiple of K_ROWS zeroed (the micro-kernels read
    key rows in fours, the integer scores in K_ROWS). The middle's rows (n_quant of them, MLX's
    affine layout in ``quant``, this head's from element ``q_base[i]`` of each buffer) are
    dequantised here and their keys turned by
    cos_u/sin_u where ``rot`` (back by the middle's rotation delta: what ``content()`` gives);
    softmax is order-free, so they need not sit between the sinks and the window as in sequence.
    ``mid_values`` False: the middle's values are left out of vb (P V reads them as integers)."""
    kq, ks, kbias, vq, vs, vbias = quant
    mq = max(0, min(n0 + nb, n_quant) - n0)  # the block's rows in the middle: its first ones
    if mq:
        dequant_rows(kq, ks, kbias, q_base[0], q_base[1], n0, mq, q_bits, q_group, D, kb)
        if mid_values:
            dequant_rows(vq, vs, vbias, q_base[3], q_base[4], n0, mq, q_bits, q_group, D, vb)
        if rot:
            for i in range(mq):
                apply_rope(kb[i * D:(i + 1) * D], cos_u, sin_u, traditional)
    for i in range(mq, nb):
        n = n0 + i
        if n < n_cached:
            r = n - n_quant
            for e in range(D):
                kb[i * D + e] = as_f32(kc[r, e])
            for e in range(D):
                vb[i * D + e] = as_f32(vc[r, e])
        else:
            j = n - n_cached
            for e in range(D):
                kb[i * D + e] = kr[j, e]
            for e in range(D):
                vb[i * D + e] = v_new[j, v_col + e]
    nb8 = (nb + K_ROWS - 1) // K_ROWS * K_ROWS
    for i in range(nb * D, nb8 * D):
        kb[i] = 0.0
        vb[i] = 0.0


@njit(fastmath=True, nogil=True, cache=True)
def _softmax_block(st, nb, M, n_cached, n0, t0, lane_t, run_max, run_sum, ot, D, window):  # pragma: no cover
    """Mask scores of chunk keys after their query (and with ``window`` > 0, of keys more than
    ``window - 1`` positions before it), fold the block into the running max and sum of each
    lane (rescaling O^T when the max moves) and leave P^T = exp(S^T - max) in st. A lane whose
    keys so far were all masked holds a max of _NEG; its first unmasked key's correction,
    fast_exp(_NEG - max), is ~0 and clears what the masked ones added."""
    if window > 0 and n0 + window <= n_cached + lane_t[M - 1]:  # some key here lies before some window
        for i in range(nb):
            for m in range(M):
                if n0 + i + window <= n_cached + lane_t[m]:
                    st[i * M + m] = _NEG
    if n0 + nb > n_cached + t0 + 1:  # some chunk key here lies after some query: mask those
        for i in range(nb):
            j = n0 + i - n_cached
            if j > t0:
                for m in range(M):
                    if j > lane_t[m]:
                        st[i * M + m] = _NEG
    new_max = np.empty(M, np.float32)
    for m in range(M):
        new_max[m] = run_max[m]
    lanes_max(st, nb, M, new_max)  # (vector loops: softmax_lanes.py)
    corr = np.empty(M, np.float32)
    moved = False
    for m in range(M):
        corr[m] = fast_exp(run_max[m] - new_max[m])
        moved = moved or corr[m] != 1.0
        run_max[m] = new_max[m]
        run_sum[m] *= corr[m]
    if moved:  # (past the first blocks the max seldom moves: skip D x M multiplications by 1)
        lanes_scale(ot, D, M, corr)
    lanes_exp(st, nb, M, new_max, run_sum)


@njit(fastmath=True, nogil=True, cache=True)
def chunk_attention(ctl, phase, q, k_raw, v_new, cos, sin, traditional, n_heads, n_kv_heads, k_cache, k_stride,
                    v_cache, v_stride, n_cached, scale, k_out, v_out, attn, quant, q_stride, n_quant, q_bits, q_group,
                    cos_u, sin_u, qk_norm, eps, q_from=0, int_scores=False, window=0, int_pv=False):  # pragma: no cover
    """attn[t, h] = softmax over the n_cached cached rows and the chunk's rows 0..t of
    scale * rope(q[t, h]) . rope(k), times V: claims of (KV head, QBLOCK tokens) in ``phase``,
    ending at its barrier. q [T, heads * D], k_raw / v_new [T, kv_heads * D] float32 (keys
    before RoPE); k_cache / v_cache flat cache buffers (head_rows), float32 or float16 bits.
    The claim of each KV head's last token block ropes all T keys and hands them, with the
    values, to k_out / v_out (the cache's dtype) for the caller to append; k_out / v_out with no
    rows: into the cache buffers themselves, after their rows (n_cached - n_quant), which no
    claim reads (the chunk's keys come from k_raw / v_new), so the caller only counts them.
    ``q_from``: only the rows t >= q_from of attn are wanted (q's rows before it need not be
    computed; the token blocks wholly before it are skipped), every key and value still handed on.

    A quantised middle (window-quant, quantized, scored-quant; n_quant of the n_cached rows, 0:
    none): the cache buffers hold the other n_cached - n_quant rows (sinks and recent window, where
    the chunk's rows go next), ``quant`` the middle as stored (decode_step.token_step's six
    buffers, heads ``q_stride`` apart), read in place block by block (_fill_block), its keys
    turned back by cos_u/sin_u [D/2] (the angles of minus its rotation delta). qk_norm [2 * D]:
    the queries' and keys' per-head RMSNorm weights with ``eps``, applied before RoPE (Qwen3), or
    [0]: none. ``window`` > 0 (a sliding-window layer): query t sees the keys of its last
    ``window`` positions only (the cache rows are the last ones before the chunk, cache/sliding.py),
    the key blocks wholly before a claim's first window skipped. ``int_scores``: S^T on integers
    (chunk_scores_int: each block's key rows as bytes, the query lanes as int8), numerics fast's
    choice where the CPU has vpdpbusd; else on floats. ``int_pv``: P V over an 8-bit middle's rows on
    integers (pv_prefill_int.py; the window's and the chunk's rows on floats)."""
    T = q.shape[0]
    D = cos.shape[1] * 2
    G = n_heads // n_kv_heads
    M = G * QBLOCK
    n_blocks = (T + QBLOCK - 1) // QBLOCK
    b0 = min(q_from, T - 1) // QBLOCK  # the first token block with a wanted row
    n_units = n_kv_heads * (n_blocks - b0)
    qt = np.empty(D * M, np.float32)
    ot = np.empty(D * M, np.float32)
    st = np.empty(KBLOCK * M, np.float32)
    # this thread's K/V rows of one KV head as its claims read them, prepared once for all of its
    # claims on that head (the threads claim in order, so a thread's claims run mostly on one
    # head at a time): float32 keys and values, or for integer scores the keys' bytes with their
    # scales and biases (and one block of float32 keys to quantise from). Converting and
    # quantising every block again in each of a head's 17 claims (544 tokens) had been a quarter
    # of the chunk's attention at 4,096 cached rows.
    n_rows = (n_cached + T + KBLOCK - 1) // KBLOCK * KBLOCK
    ni = 1 if int_scores else 0
    kb = np.empty((KBLOCK if int_scores else n_rows) * D, np.float32)
    vb = np.empty(n_rows * D, np.float32)
    k8 = np.empty(ni * n_rows * D, np.uint8)
    ksc = np.empty(ni * n_rows, np.float32)
    kbi = np.empty(ni * n_rows, np.float32)
    prep_kh = -1  # the head whose rows 0 .. prep_rows - 1 are prepared
    prep_rows = 0
    kr = np.empty((T, D), np.float32)
    qr = np.empty(D, np.float32)
    lane_t = np.empty(M, np.int64)
    qx = np.empty(ni * D * M, np.int8)
    lsc = np.empty(ni * M, np.float32)
    lsu = np.empty(ni * M, np.float32)
    run_max = np.empty(M, np.float32)
    run_sum = np.empty(M, np.float32)
    n_full = n_cached - n_quant  # the cache buffers' rows
    D8 = D // 8 * 8  # P V's columns in calls of 8 (then of 4)
    # the middle's values as int16 row pairs with their scales, and one block's integer weights
    n_int = n_quant if int_pv and q_bits == 8 and D % q_group == 0 else 0
    ng = D // q_group
    vp = np.empty((n_int + 1) // 2 * D, np.int32)
    vsc = np.empty(n_int * ng, np.float32)
    vbi = np.empty(n_int * ng, np.float32)
    wp = np.empty((1 if n_int else 0) * KBLOCK // 2 * M, np.int32)
    lsp = np.empty(M, np.float32)
    lbp = np.empty(M, np.float32)
    q_base = np.empty(6, np.int64)
    rot = False
    for e in range(sin_u.shape[0]):
        rot = rot or sin_u[e] != 0.0
    while True:
        u = phase_claim(ctl, phase, n_units)
        if u < 0:
            break
        kh, blk = u // (n_blocks - b0), b0 + u % (n_blocks - b0)
        t0 = blk * QBLOCK
        t_end = min(T, t0 + QBLOCK)
        for j in range(t_end):
            for e in range(D):  # (a loop, not a row assignment: see views.py)
                kr[j, e] = k_raw[j, kh * D + e]
            if qk_norm.shape[0]:
                head_norm(kr[j], qk_norm, D, eps)
            apply_rope(kr[j], cos[j], sin[j], traditional)
        if blk == n_blocks - 1 and k_out.shape[0] == 0:
            kw = head_rows(k_cache, kh, k_stride, n_full + T, D)
            vw = head_rows(v_cache, kh, v_stride, n_full + T, D)
            for j in range(T):
                kd, vd = kw[n_full + j], vw[n_full + j]
                for e in range(D):
                    store_f32(kd, e, kr[j, e])
                for e in range(D):
                    store_f32(vd, e, v_new[j, kh * D + e])
        elif blk == n_blocks - 1:
            for j in range(T):
                kd, vd = k_out[j], v_out[j]
                for e in range(D):
                    store_f32(kd, kh * D + e, kr[j, e])
                for e in range(D):
                    store_f32(vd, kh * D + e, v_new[j, kh * D + e])
        # Q^T: lane g * QBLOCK + i holds head kh * G + g at token t0 + i (zeros past the chunk
        # and before q_from, which see every key: no lane's row is ever all masked)
        for g in range(G):
            h = kh * G + g
            for i in range(QBLOCK):
                m = g * QBLOCK + i
                t = t0 + i
                lane_t[m] = t
                if q_from <= t < T:
                    for e in range(D):  # (a loop, not ``qr[:] = ...``: see views.py)
                        qr[e] = q[t, h * D + e]
                    if qk_norm.shape[0]:
                        head_norm(qr, qk_norm, 0, eps)
                    apply_rope(qr, cos[t], sin[t], traditional)
                    if int_scores:
                        quantise_query_lane(qr, D, scale, m, M, qx, lsc, lsu)
                    else:
                        for e in range(D):
                            qt[e * M + m] = qr[e] * scale
                elif int_scores:
                    zero_query_lane(D, m, M, qx, lsc, lsu)
                else:
                    for e in range(D):
                        qt[e * M + m] = 0.0
        ot[:] = 0.0
        run_max[:] = _NEG
        run_sum[:] = 0.0
        n_keys = n_cached + t_end
        if kh != prep_kh:
            prep_kh, prep_rows = kh, 0
        if n_keys > prep_rows:  # the rows past those prepared (a partial last block again, whole)
            kc = head_rows(k_cache, kh, k_stride, n_full, D)
            vc = head_rows(v_cache, kh, v_stride, n_full, D)
            for i in range(6):
                q_base[i] = kh * q_stride[i]
            for n0 in range(prep_rows // KBLOCK * KBLOCK, n_keys, KBLOCK):
                nb = min(KBLOCK, n_keys - n0)
                k_at = 0 if int_scores else n0 * D
                _fill_block(kc, vc, n_cached, kr, v_new, kh * D, n0, nb, D, kb[k_at:], vb[n0 * D:], quant, q_base,
                            n_quant, q_bits, q_group, rot, cos_u, sin_u, traditional, n_int == 0)
                mi = max(0, min(nb, n_int - n0))
                if mi:
                    value_pairs(quant[3], quant[4], quant[5], q_base[3], q_base[4], n0, mi, D, ng, n_int - 1, vp,
                                vsc, vbi)
                if int_scores:
                    quantise_key_rows(kb, (nb + K_ROWS - 1) // K_ROWS * K_ROWS, D, k8[n0 * D:], ksc[n0:], kbi[n0:])
            prep_rows = n_keys
        k_lo = n_cached + t0 - window + 1 if window > 0 else 0  # the claim's first query's first key
        for n0 in range(max(0, k_lo) // KBLOCK * KBLOCK, n_keys, KBLOCK):
            nb = min(KBLOCK, n_keys - n0)
            nb4 = (nb + A_ROWS - 1) // A_ROWS * A_ROWS
            nb8 = (nb + K_ROWS - 1) // K_ROWS * K_ROWS
            if int_scores:  # (the rows past nb up to K_ROWS are zeros, their scores never read)
                for mc in range(0, M, LANES):
                    for i in range(n0, n0 + nb8, K_ROWS):
                        scores8x32(k8, i * D, i, ksc, kbi, qx, 4 * mc, 4 * M, D // 4, lsc, lsu, mc, st,
                                   (i - n0) * M + mc, M)
            else:
                for mc in range(0, M, LANES):
                    for i in range(n0, n0 + nb4, A_ROWS):
                        outer4x32(kb, i * D, D, 1, qt, mc, M, st, (i - n0) * M + mc, M, D, 0)
            _softmax_block(st, nb, M, n_cached, n0, t0, lane_t, run_max, run_sum, ot, D, window)
            mi = max(0, min(nb, n_int - n0))  # the block's middle rows: on integers
            if mi:
                middle_pv(st, mi, M, ot, D, q_group, vp, n0, vsc, vbi, wp, lsp, lbp)
            if nb > mi:
                for mc in range(0, M, LANES):
                    for e in range(0, D8, 8):
                        outer8x32(vb, (n0 + mi) * D + e, 1, D, st, mi * M + mc, M, ot, e * M + mc, M, nb - mi, 1)
                    for e in range(D8, D, A_ROWS):
                        outer4x32(vb, (n0 + mi) * D + e, 1, D, st, mi * M + mc, M, ot, e * M + mc, M, nb - mi, 1)
        for g in range(G):
            h = kh * G + g
            for i in range(max(0, q_from - t0), t_end - t0):
                m = g * QBLOCK + i
                inv = np.float32(1.0) / run_sum[m]
                for e in range(D):
                    attn[t0 + i, h * D + e] = ot[e * M + m] * inv
        phase_done(ctl, phase)
    phase_barrier(ctl, phase, n_units)
