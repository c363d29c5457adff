"""One decoder layer of a Llama-style model for one token, in one native call.

A small model's decode step is dominated by dispatch, not arithmetic: SmolLM2-135M has 30 layers
of 7 projections (most under 1024x1024) plus norms, RoPE, attention and the MLP's activation, and
MLX's CPU backend pays each of those ~210 products and ~300 element-wise ops a dispatch (and the
products its slow ``quantized_matmul``): ~100 ms a token against llama.cpp's ~9. ``layer_step``
does the whole layer, on the packed weights, and ``token_step`` runs every layer in one call
that every pool thread runs (``WorkPool.broadcast``), so the helpers start once per token:

    x += o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
    x += down_proj(silu(gate_proj(m)) * up_proj(m))                       m = rms_norm(x)

The work is cut into phases (the fused QKV rows, the query heads, the o_proj rows, the gate/up
rows, the down rows). Inside a phase, threads claim chunks from an atomic counter as the pool's
kernels do, and each phase ends at a barrier (its done counter). A thread that starts late (a
helper whose core was busy) finds the chunks claimed and simply passes the barriers, so the
caller never waits for a thread that has not started. The norms and the even/odd split of a
projection's input are recomputed by each thread into its own buffers (hundreds of elements)
rather than shared, which would need one more barrier each.

Attention reads the cache's rows [0, n) in place plus the new row from ``k_new``/``v_new``: a
KV head's query heads together, over splits of the keys (group_attention.py).
The new K/V rows are written into the cache buffers in place (row n, by address) for the layers
the caller allows (``write_kv``: rows that exist and that no view handed out of the buffers
covers, see cache/buffers.py ``FullBuffer.writable_in_place``); for the others the caller
appends them through the cache's own ``update_and_fetch`` (MLX's copy-on-write then protects
any snapshot that shares the buffer).

Weights are MLX's affine 4- or 8-bit layout (qmatmul.py); all projections of a layer share one
group size. Scales/biases float32 or float16 bits (uint16), as the other kernels read them; an
empty bias array ([N, 0]) means symmetric weights (affine.py: GGUF Q4_0, Q8_0).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from .affine import bias_at
from .group_attention import SLOT, attend_split, merge_splits, n_splits
from .half import kv_buffer, store_f32
from .int8dot import ACT_BLOCK, q4_rows4_i8, q4_rows4_i16, quantise_lanes, quantise_lanes_wide
from .int8head import q8_rows4_i8, quantise_rows8
from .llvm import atomic_add
from .microkernels import A_ROWS
from .qk_int import INT_SCORES
from .quant_split import attend_quant_split
from .rows4 import ROWS, q4_rows4_dot, q8_rows4_dot
from .simd import q4_row_dot, q8_row_dot

# q/k/v, attention, o_proj, gate/up, down; then a sandwich-normed layer's (Gemma 3) two adds
PHASES = 7
# the bits of token_step's ``fast``: which products of a layer run on int8 activations
FAST_QKV, FAST_O, FAST_GATE_UP, FAST_DOWN = 1, 2, 4, 8
# ...and the attention's scores on integers where the CPU has vpdpbusd: in decode against a
# quantised middle (16-bit queries, qk_int.py), in prefill every key block (u8 keys, int8 queries,
# chunk_scores_int.py; FusedDecoder.set_fast(prefill_scores=...))
FAST_ATTN = 32
FAST_ALL = FAST_QKV | FAST_O | FAST_GATE_UP | FAST_DOWN | FAST_ATTN
# down_proj on 16-bit activations (two int8 planes, int8dot.make_rows_i8(planes=2)) where FAST_DOWN
# is not set, on request (FusedDecoder.set_fast(decode_down="wide"); the prefill's is
# prefill_step.PREFILL_DOWN_WIDE, the same bit): its input silu(gate) x up has the widest range, and
# 16 bits round ~1/256 as coarsely. Since the biases' share comes from the quantised activations
# (int8dot._lane_sums), int8 costs SmolLM2 no measurable perplexity there either (BENCHMARKS.md, stop 31)
FAST_DOWN_WIDE = 16
# fast >> FAST_BLOCK_SHIFT: the activation elements per int8 scale (8, 16 or 32; 0: ACT_BLOCK)
FAST_BLOCK_SHIFT = 8
# rows per claimed chunk at least: each claim and each done count moves a cache line between the
# cores (SmolLM2, 2 threads: 16 rows ~11 ms a token in the kernel, 48 rows ~9-10)
ROW_CHUNK = 48
# ...and each projection is cut into about this many chunks per thread: a thread's first rows of a
# chunk wait for memory the prefetch of its last chunk did not ask for (it ran ahead into rows the
# other thread claimed), so on a 7B layer 48-row chunks lost ~8% of decode to those cold starts.
# 8 per thread leaves the barrier at the end of a phase waiting for at most an eighth of a
# thread's share. Llama-2-7B geometry, 8 layers, 2 threads, Xeon: 17.1 -> 18.5 tok/s, alternating
# (docs/cpu.md, "The fused decode step"; BENCHMARKS.md, "Decode chunks sized to the projection").
CHUNKS_PER_THREAD = 8


@njit(nogil=True, cache=True)
def rows_per_chunk(n, chunks):  # pragma: no cover - jitted
    """Rows of each claimed chunk when n rows are cut into about ``chunks`` pieces: a multiple
    of the 4-row kernels' ROWS, never under ROW_CHUNK."""
    chunks = max(chunks, 1)
    c = (n + chunks - 1) // chunks
    return max(ROW_CHUNK, (c + ROWS - 1) // ROWS * ROWS)


# Each phase's claim and done counters sit on their own 64-byte cache lines: a thread spinning
# at a barrier then reads a line the claiming thread does not write to on every claim.
LINE = 8  # int64s per cache line


@intrinsic
def _atomic_load(typingctx, arr, idx):
    """An acquire load of int64 ``arr[idx]``: read anew each time (a plain load in a spin loop
    may be hoisted out of it), without the write an atomic add would make to the line."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(arr, types.intp), codegen


@njit(nogil=True, cache=True, inline="always")
def phase_claim(ctl, phase, n):  # pragma: no cover - jitted
    c = atomic_add(ctl, 2 * LINE * phase, 1)
    return c if c < n else -1


@njit(nogil=True, cache=True, inline="always")
def phase_done(ctl, phase):  # pragma: no cover - jitted
    atomic_add(ctl, 2 * LINE * phase + LINE, 1)


@njit(nogil=True, cache=True)
def phase_barrier(ctl, phase, n):  # pragma: no cover - jitted
    while _atomic_load(ctl, 2 * LINE * phase + LINE) < n:
        pass


@njit(fastmath=True, nogil=True, cache=True)
def _prepare(src, norm_w, eps, group_size, xn, xe, xo, xsum, fast, xq, block, wide, xq8,
             want8):  # pragma: no cover
    """xn = rms_norm(src) * norm_w (norm_w empty: xn = src), its even/odd halves and group sums;
    when ``fast``, also its int8 blocks of ``block`` xq = (even, odd, lane scales, lane sums), on
    16 bits when ``wide`` (quantise_lanes_wide: each of even and odd K long), and when ``want8``
    (an 8-bit weight reads it) xq8 = (int8 in natural order, lane scales, lane sums) for
    int8head's 8-bit rows (quantise_rows8)."""
    K = src.shape[0]
    if norm_w.shape[0]:
        ss = np.float32(0.0)
        for j in range(K):
            ss += src[j] * src[j]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(K) + eps)
        for j in range(K):
            xn[j] = src[j] * inv * norm_w[j]
    else:
        for j in range(K):
            xn[j] = src[j]
    half = K // 2
    for j in range(half):
        xe[j] = xn[2 * j]
        xo[j] = xn[2 * j + 1]
    for g in range(K // group_size):
        acc = np.float32(0.0)
        for j in range(g * group_size, (g + 1) * group_size):
            acc += xn[j]
        xsum[g] = acc
    if fast and wide:
        quantise_lanes_wide(xn[:K], block, xq[0][:K], xq[1][:K], xq[2][:K // 8], xq[3][:K // 8])
    elif fast:
        quantise_lanes(xn, block, xq[0][:half], xq[1][:half], xq[2][:K // 8], xq[3][:K // 8])
    if fast and not wide and want8:
        quantise_rows8(xn[:K], block, xq8[0][:K], xq8[1][:K // 4], xq8[2][:K // 4])


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _row(w, bits, group_size, r, xn, xe, xo, xsum):  # pragma: no cover - jitted
    """Row r of the packed weight w = (bytes, scales, biases) times the prepared input."""
    packed, scales, biases = w
    if bits == 4:
        d = q4_row_dot(packed[r], xe, xo, scales[r], group_size)
    else:
        d = q8_row_dot(packed[r], xn, scales[r], group_size)
    for g in range(scales.shape[1]):
        d += bias_at(scales, biases, bits, r, g) * xsum[g]
    return d


@njit(fastmath=True, nogil=True, cache=True)
def _project(w, bits, group_size, r_start, r_end, xn, xe, xo, xsum, dst, add, fast, xq,
             wide, xq8):  # pragma: no cover - jitted
    """dst[i] (= or +=) row r_start + i of w times the prepared input, rows [r_start, r_end):
    4- and 8-bit rows four at a time, the rest one by one. 4-bit: rows4.py on float32, int8dot.py
    on int8 activations when ``fast`` (16-bit ones when also ``wide``); 8-bit: rows4.q8_rows4_dot
    on float32, int8head.q8_rows4_i8 on int8 activations (xq8) when ``fast`` and not ``wide``.
    xq = (even int8, odd int8, lane scales, lane sums) of the input. The integer kernels include
    the biases; on float32 they are added here. Until stop 45 every 8-bit row ran one by one on
    floats: a Q4_K_M file's layers (Q5_0 widened to bytes, Q6_K, Q8_0) decoded SmolLM2 at 18
    tok/s where its Q4_1 file runs ~100."""
    packed, scales, biases = w
    r = r_start
    tmp = np.empty(ROWS, np.float32)
    integer = fast and (bits == 4 or not wide)  # an 8-bit row has no 16-bit kernel: float32
    while (bits == 4 or bits == 8) and r + ROWS <= r_end:
        if bits == 4 and fast and wide:
            q4_rows4_i16(packed, r, xq, scales, biases, group_size, tmp)
        elif bits == 4 and fast:
            q4_rows4_i8(packed, r, xq, scales, biases, group_size, tmp)
        elif bits == 4:
            q4_rows4_dot(packed, r, xe, xo, scales, group_size, tmp)
        elif integer:
            q8_rows4_i8(packed, r, xq8, scales, biases, group_size, tmp)
        else:
            q8_rows4_dot(packed, r, xn, scales, group_size, tmp)
        for i in range(ROWS):
            d = tmp[i]
            if not integer:
                for g in range(scales.shape[1]):
                    d += bias_at(scales, biases, bits, r + i, g) * xsum[g]
            if add:
                dst[r - r_start + i] += d
            else:
                dst[r - r_start + i] = d
        r += ROWS
    while r < r_end:
        d = _row(w, bits, group_size, r, xn, xe, xo, xsum)
        if add:
            dst[r - r_start] += d
        else:
            dst[r - r_start] = d
        r += 1


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def rms_inv(v, eps):  # pragma: no cover - jitted
    """1 / sqrt(mean(v^2) + eps) of the vector v: what an RMS norm scales it by."""
    ss = np.float32(0.0)
    for e in range(v.shape[0]):
        ss += v[e] * v[e]
    return np.float32(1.0) / np.sqrt(ss / np.float32(v.shape[0]) + eps)


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def head_norm(v, w, off, eps):  # pragma: no cover - jitted
    """v [D] <- v / sqrt(mean(v^2) + eps) * w[off:off + D]: Qwen3's per-head RMSNorm of the
    queries and keys, before RoPE (w: the q norm's weights then the k norm's)."""
    D = v.shape[0]
    r = rms_inv(v, eps)
    for e in range(D):
        v[e] = v[e] * r * w[off + e]


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def apply_rope(v, cos, sin, traditional):  # pragma: no cover - jitted
    """Rotate v [D] in place: pairs (2i, 2i+1) when traditional, else (i, i + D/2)."""
    half = cos.shape[0]
    for i in range(half):
        if traditional:
            a, b = v[2 * i], v[2 * i + 1]
            v[2 * i] = a * cos[i] - b * sin[i]
            v[2 * i + 1] = a * sin[i] + b * cos[i]
        else:
            a, b = v[i], v[i + half]
            v[i] = a * cos[i] - b * sin[i]
            v[i + half] = a * sin[i] + b * cos[i]


GELU_2C = np.float32(2.0 * np.sqrt(2.0 / np.pi))


@njit(fastmath=True, nogil=True, cache=True)
def act_mul(g, u, gelu):  # pragma: no cover - jitted
    """The MLP's gate activation times up: SiLU (Llama), or GELU's tanh approximation (Gemma),
    which MLX's ``nn.gelu_approx`` writes 0.5 g (1 + tanh(c (g + 0.044715 g^3))) and is
    g sigmoid(2c (g + 0.044715 g^3)): one exp, as SiLU's, where numba's tanh had cost a 128-token
    Gemma 3 270M prefill chunk 32 of its 173 ms in the kernel."""
    if gelu:
        z = GELU_2C * g * (np.float32(1.0) + np.float32(0.044715) * g * g)
        return g / (np.float32(1.0) + np.exp(-z)) * u
    return g / (np.float32(1.0) + np.exp(-g)) * u


@njit(fastmath=True, nogil=True, cache=True)
def add_normed(ctl, phase, x, ob, w, off, eps):  # pragma: no cover - jitted
    """x += rms_norm(ob) * w[off:off + dim] by the thread that claims the phase's one unit, then
    the phase's barrier: a sandwich-normed layer's residual adds (Gemma 3's post-attention and
    post-feed-forward norms need the whole projection's row before any of it is added)."""
    if phase_claim(ctl, phase, 1) == 0:
        inv = rms_inv(ob, eps)
        for j in range(x.shape[0]):
            x[j] += ob[j] * inv * w[off + j]
        phase_done(ctl, phase)
    phase_barrier(ctl, phase, 1)


@njit(fastmath=True, nogil=True, cache=True)
def layer_step(ctl, x, attn_norm, mlp_norm, eps, wq, wk, wv, wo, wg, wu, wd, bits, group_size,
               cos, sin, traditional, n_heads, n_kv_heads, k_cache, k_stride, v_cache, v_stride, n_cached,
               scale, q, k_new, v_new, k_out, part, act, fast, write_kv, chunks,
               quant, q_stride, n_quant, q_bits, q_group, cos_q, sin_q, q_out, qkv_bias,
               qk_norm, window, post_norm, gelu, ob):  # pragma: no cover - jitted
    """One layer for one token; ``x`` [dim] (float32) is updated in place.

    w* = (packed uint8 [N, K*bits/8], scales [N, K/gs], biases [N, K/gs]); bits [7] the bits of
    q, k, v, o, gate, up, down. cos/sin [D/2] for the token's position. k_cache/v_cache: flat
    views of the cache's [kv_heads, capacity, D] buffers with their head strides (kernels'
    heads_view), n_cached rows held, float32 or float16 bits (uint16: read through as_f32 and
    written through store_f32, vcvtph2ps/vcvtps2ph where the CPU has F16C, kernels/half.py).
    Outputs: k_out (the new keys, roped) and v_new
    [kv_heads * D]; with ``write_kv`` they are also written into the cache buffers at row
    n_cached (the caller made room and checked that no view handed out covers that row), else
    the caller appends them. q, k_new (before RoPE) [heads * D], part
    [group_attention.part_size floats] (the attention's per-split partials) and act [hidden] are
    shared scratch. ``chunks``: about how many chunks each projection is cut into (CHUNKS_PER_THREAD
    per pool thread).

    A cache with a quantised middle (window-quant, quantized, scored-quant): ``quant`` = (k packed
    bytes, k scales, k biases, v packed bytes, v scales, v biases) flat [kv_heads, capacity, width]
    buffers with their head strides ``q_stride`` [6], ``n_quant`` rows held, ``q_bits``-bit in
    groups of ``q_group`` (quant_split.py); the k_cache rows are then the sinks and the recent
    window, and cos_q/sin_q the angles of the middle's position (the token's plus the cache's
    rotation delta). ``n_quant`` 0: no middle (prealloc, window, scored). q_out [heads * D]
    receives the roped queries (the scored caches' votes, the sparsity figure). qkv_bias
    [nq + nk + nv] float32: the q, k and v projections' biases (Qwen2), or [0]: none. qk_norm
    [2 * D] float32: the per-head RMSNorm weights of the queries then the keys, applied before
    RoPE with ``eps`` (Qwen3), or [0]: none. ``window`` > 0: a sliding-window layer (Gemma 3's
    local ones): the token attends to the last ``window - 1`` rows and itself (the cache holds up
    to its chunk more, cache/sliding.py). post_norm [2 * dim] (or [0]): the sandwich norms'
    weights (Gemma 3: o_proj's output and down_proj's are each normed before they are added;
    ``mlp_norm`` is then the pre-feed-forward norm), with ``ob`` [dim] shared scratch for those
    outputs. ``gelu``: the MLP's activation is GELU's tanh approximation, not SiLU."""
    dim = x.shape[0]
    D = cos.shape[0] * 2
    nq, nk = wq[0].shape[0], wk[0].shape[0]
    nqkv = nq + nk + wv[0].shape[0]
    hidden = wg[0].shape[0]
    G = n_heads // n_kv_heads
    kmax = max(dim, hidden, n_heads * D)
    xn = np.empty(kmax, np.float32)
    xe = np.empty(kmax // 2, np.float32)
    xo = np.empty(kmax // 2, np.float32)
    xsum = np.empty(kmax // group_size, np.float32)
    no_norm = np.empty(0, np.float32)
    gbuf = np.empty(rows_per_chunk(hidden, chunks), np.float32)
    ubuf = np.empty(rows_per_chunk(hidden, chunks), np.float32)
    # K bytes each: room for the two planes of 16-bit activations (FAST_DOWN_WIDE)
    xq = (np.empty(kmax, np.int8), np.empty(kmax, np.int8), np.empty(kmax // 8, np.float32),
          np.empty(kmax // 8, np.float32))
    xq8 = (np.empty(kmax, np.int8), np.empty(kmax // 4, np.float32), np.empty(kmax // 4, np.float32))
    # fast: a bit per product group on int8 activations (FAST_QKV, FAST_O, FAST_GATE_UP, FAST_DOWN)
    f_qkv, f_o, f_gu, f_down = (fast & 1) != 0, (fast & 2) != 0, (fast & 4) != 0, (fast & 8) != 0
    down_wide = (fast & FAST_DOWN_WIDE) != 0 and not f_down
    narrow = np.bool_(False)  # a value, not a literal: one compiled _project and _prepare
    f_down = f_down or down_wide
    blk = fast >> FAST_BLOCK_SHIFT
    if blk == 0:
        blk = ACT_BLOCK

    # 1. q, k, v rows (one phase over their rows together)
    _prepare(x, attn_norm, eps, group_size, xn[:dim], xe[:dim // 2], xo[:dim // 2], xsum[:dim // group_size],
             f_qkv, xq, blk, narrow, xq8, bits[0] == 8 or bits[1] == 8 or bits[2] == 8)
    ch1 = rows_per_chunk(nqkv, chunks)
    n1 = (nqkv + ch1 - 1) // ch1
    while True:
        c = phase_claim(ctl, 0, n1)
        if c < 0:
            break
        a, b = c * ch1, min(nqkv, (c + 1) * ch1)
        # the chunk's rows, cut where q's rows end and k's, then v's, begin
        for lo_, hi_, w, wb, dst, off in ((0, nq, wq, bits[0], q, 0), (nq, nq + nk, wk, bits[1], k_new, nq),
                                          (nq + nk, nqkv, wv, bits[2], v_new, nq + nk)):
            s0, s1 = max(a, lo_), min(b, hi_)
            if s0 < s1:
                _project(w, wb, group_size, s0 - off, s1 - off, xn, xe, xo, xsum, dst[s0 - off:s1 - off],
                         False, f_qkv, xq, narrow, xq8)
                if qkv_bias.shape[0]:
                    for r in range(s0, s1):
                        dst[r - off] += qkv_bias[r]
        phase_done(ctl, 0)
    phase_barrier(ctl, 0, n1)

    # 2. attention: units of (KV head, key split) (group_attention.py), each leaving partials
    # of its G heads in the shared ``part``, merged by every thread after the barrier
    # (a KV head's units: its S splits of the full-precision rows, then its Sq of the quantised middle)
    n_keys = n_cached + 1
    lo = n_keys - window if 0 < window < n_keys else 0  # the window's first row (0: every row)
    S = n_splits(n_kv_heads, n_keys - lo)
    Sq = n_splits(n_kv_heads, n_quant) if n_quant > 0 else 0
    ST = S + Sq
    n_units = n_kv_heads * ST
    per = (n_keys - lo + S - 1) // S
    per_q = (n_quant + Sq - 1) // Sq if Sq else 0
    G4 = (G + A_ROWS - 1) // A_ROWS * A_ROWS
    # rows of s 64-byte aligned: P V reads them as it goes, and a row that starts mid-line cost
    # the quantised units ~2x their P V
    L = (max(per + 1, per_q) + 15) // 16 * 16
    s = np.empty(G4 * L, np.float32)
    o = np.empty(G4 * D, np.float32)
    qg = np.empty(G * D, np.float32)
    kr = np.empty(D, np.float32)
    w = np.empty(G4 * L if n_quant > 0 else 0, np.float32)
    qx = np.empty(2 * G * D if n_quant > 0 and (fast & FAST_ATTN) != 0 and INT_SCORES else 0, np.int8)
    qp = np.empty(2 * G * (D // 32) + A_ROWS, np.float32)
    q_base = np.empty(6, np.int64)
    while True:
        c = phase_claim(ctl, 1, n_units)
        if c < 0:
            break
        # the quantised middle's units first: they are the larger ones (more rows, each dearer),
        # and the threads' last claims should be the small full-precision units
        if c < n_kv_heads * Sq:
            kh, sp = c // Sq, S + c % Sq
        else:
            kh, sp = (c - n_kv_heads * Sq) // S, (c - n_kv_heads * Sq) % S
        u = kh * ST + sp
        if sp >= S:  # a split of the quantised middle, with the queries at its position
            for g in range(G):
                h = kh * G + g
                for e in range(D):
                    qg[g * D + e] = q[h * D + e]
                if qk_norm.shape[0]:
                    head_norm(qg[g * D:(g + 1) * D], qk_norm, 0, eps)
                apply_rope(qg[g * D:(g + 1) * D], cos_q, sin_q, traditional)
            for i in range(6):
                q_base[i] = kh * q_stride[i]
            a = (sp - S) * per_q
            attend_quant_split(qg, G, D, quant, q_base, a, min(n_quant, a + per_q), q_bits, q_group,
                               scale, s, L, o, part, u * G * (D + SLOT), w, qx, qp)
            phase_done(ctl, 1)
            continue
        for e in range(D):  # (a loop: ``kr[:] = ...``'s shape-mismatch error path compiles ~3 s, views.py)
            kr[e] = k_new[kh * D + e]
        if qk_norm.shape[0]:
            head_norm(kr, qk_norm, D, eps)
        apply_rope(kr, cos, sin, traditional)
        for g in range(G):
            h = kh * G + g
            for e in range(D):
                qg[g * D + e] = q[h * D + e]
            if qk_norm.shape[0]:
                head_norm(qg[g * D:(g + 1) * D], qk_norm, 0, eps)
            apply_rope(qg[g * D:(g + 1) * D], cos, sin, traditional)
            if sp == 0:
                for e in range(D):
                    q_out[h * D + e] = qg[g * D + e]
        a = lo + sp * per
        b = min(n_keys, a + per)
        attend_split(qg, G, D, k_cache, kh * k_stride, v_cache, kh * v_stride, a, min(b, n_cached),
                     kr, v_new[kh * D:(kh + 1) * D], b == n_keys, scale, s, L, o, part, u * G * (D + SLOT))
        if sp == S - 1:  # the unit with the new key hands it back (roped) for the cache
            for e in range(D):
                k_out[kh * D + e] = kr[e]
            if write_kv:  # and writes the new row in place (every unit reads rows < n_cached)
                kb, vb = kh * k_stride + n_cached * D, kh * v_stride + n_cached * D
                for j in range(D):
                    store_f32(k_cache, kb + j, kr[j])
                for j in range(D):
                    store_f32(v_cache, vb + j, v_new[kh * D + j])
        phase_done(ctl, 1)
    phase_barrier(ctl, 1, n_units)
    attn = np.empty(n_heads * D, np.float32)
    merge_splits(part, n_heads, n_kv_heads, ST, D, attn)

    # 3. x += o_proj(attn) (sandwich norms: ob = o_proj(attn), then x += norm(ob))
    post = post_norm.shape[0] > 0
    ka = n_heads * D
    _prepare(attn, no_norm, eps, group_size, xn[:ka], xe[:ka // 2], xo[:ka // 2], xsum[:ka // group_size], f_o, xq, blk,
             narrow, xq8, bits[3] == 8)
    ch3 = rows_per_chunk(dim, chunks)
    n3 = (dim + ch3 - 1) // ch3
    while True:
        c = phase_claim(ctl, 2, n3)
        if c < 0:
            break
        a, b = c * ch3, min(dim, (c + 1) * ch3)
        if post:
            _project(wo, bits[3], group_size, a, b, xn, xe, xo, xsum, ob[a:b], False, f_o, xq, narrow, xq8)
        else:
            _project(wo, bits[3], group_size, a, b, xn, xe, xo, xsum, x[a:b], True, f_o, xq, narrow, xq8)
        phase_done(ctl, 2)
    phase_barrier(ctl, 2, n3)
    if post:
        add_normed(ctl, 5, x, ob, post_norm, 0, eps)

    # 4. act = silu(gate(m)) * up(m)
    _prepare(x, mlp_norm, eps, group_size, xn[:dim], xe[:dim // 2], xo[:dim // 2], xsum[:dim // group_size],
             f_gu, xq, blk, narrow, xq8, bits[4] == 8 or bits[5] == 8)
    ch4 = rows_per_chunk(hidden, chunks)
    n4 = (hidden + ch4 - 1) // ch4
    while True:
        c = phase_claim(ctl, 3, n4)
        if c < 0:
            break
        a, b = c * ch4, min(hidden, (c + 1) * ch4)
        _project(wg, bits[4], group_size, a, b, xn, xe, xo, xsum, gbuf[:b - a], False, f_gu, xq, narrow, xq8)
        _project(wu, bits[5], group_size, a, b, xn, xe, xo, xsum, ubuf[:b - a], False, f_gu, xq, narrow, xq8)
        for r in range(a, b):
            act[r] = act_mul(gbuf[r - a], ubuf[r - a], gelu)
        phase_done(ctl, 3)
    phase_barrier(ctl, 3, n4)

    # 5. x += down(act)
    _prepare(act, no_norm, eps, group_size, xn[:hidden], xe[:hidden // 2], xo[:hidden // 2],
             xsum[:hidden // group_size], f_down, xq, blk, down_wide, xq8, bits[6] == 8)
    ch5 = rows_per_chunk(dim, chunks)
    n5 = (dim + ch5 - 1) // ch5
    while True:
        c = phase_claim(ctl, 4, n5)
        if c < 0:
            break
        a, b = c * ch5, min(dim, (c + 1) * ch5)
        if post:
            _project(wd, bits[6], group_size, a, b, xn, xe, xo, xsum, ob[a:b], False, f_down, xq, down_wide, xq8)
        else:
            _project(wd, bits[6], group_size, a, b, xn, xe, xo, xsum, x[a:b], True, f_down, xq, down_wide, xq8)
        phase_done(ctl, 4)
    phase_barrier(ctl, 4, n5)
    if post:
        add_normed(ctl, 6, x, ob, post_norm, dim, eps)


CTL_SIZE = 2 * LINE * PHASES


@njit(fastmath=True, nogil=True, cache=True)
def token_step(ctl, x, attn_norms, mlp_norms, eps, wq, wk, wv, wo, wg, wu, wd, bits, group_size,
               cos, sin, traditional, n_heads, n_kv_heads, kv_addr, kv_size, kv_stride, n_cached,
               scale, q, k_new, v_out, k_out, part, act, fast, write_kv, kv_like,
               chunks, q_addr, q_size, q_stride, n_quant, q_bits, q_group, cos_q, sin_q, scales_like,
               q_out, qkv_bias, qk_norm, window, post_norm, gelu, ob):  # pragma: no cover - jitted
    """Every layer for one token in one call (``layer_step`` per layer, ``ctl`` holding
    CTL_SIZE counters per layer): helpers start once per token, not once per layer.

    w* are typed lists (one (packed, scales, biases) per layer), bits [L, 7], norms [L, dim];
    kv_addr [L, 2] the data addresses of each layer's K and V cache buffers ([kv_heads,
    capacity, D] float32 or float16, kv_size[l] elements, heads kv_stride[l] apart; ``kv_like``,
    an empty float32 or uint16 array, says which: float16 bits are read and written as uint16);
    v_out/k_out [L, kv_heads*D]
    receive each layer's new V and roped K. fast [L] (int64): per layer, the product groups whose
    4-bit rows run against int8 activations (``cpu.numerics = fast``, int8dot.py; bits FAST_*).
    write_kv [L] (int64): per layer, whether the new K/V row goes into the cache buffers in
    place at row n_cached (see layer_step). chunks: as layer_step's. The quantised middle of each
    layer (n_quant rows; 0: none): q_addr/q_size/q_stride [L, 6] its six buffers' addresses,
    element counts and head strides (packed bytes as uint8, scales and biases with
    ``scales_like``'s element type), cos_q/sin_q [L, D/2] its queries' angles; q_out [L, heads * D]
    receives each layer's roped queries (see layer_step); qkv_bias [L, nq + nk + nv] (or [L, 0])
    each layer's q, k and v biases; qk_norm [L, 2 * D] (or [L, 0]) its q and k norms' weights.
    Per layer [L]: n_cached (the rows its cache buffers hold), n_quant, window (0: full
    attention; see layer_step), cos/sin [L, D/2] (its position and RoPE base: a sliding layer
    counts every token, a full layer's policy may compact them); post_norm [L, 2 * dim] (or
    [L, 0]) its sandwich norms, ``gelu`` and ``ob`` [dim] as layer_step takes them."""
    byte = np.empty(0, np.uint8)
    for layer in range(bits.shape[0]):
        k_cache = kv_buffer(kv_addr[layer, 0], kv_size[layer], kv_like)
        v_cache = kv_buffer(kv_addr[layer, 1], kv_size[layer], kv_like)
        qa, qs = q_addr[layer], q_size[layer]
        quant = (kv_buffer(qa[0], qs[0], byte), kv_buffer(qa[1], qs[1], scales_like),
                 kv_buffer(qa[2], qs[2], scales_like), kv_buffer(qa[3], qs[3], byte),
                 kv_buffer(qa[4], qs[4], scales_like), kv_buffer(qa[5], qs[5], scales_like))
        layer_step(ctl[layer * CTL_SIZE:(layer + 1) * CTL_SIZE], x, attn_norms[layer], mlp_norms[layer], eps,
                   wq[layer], wk[layer], wv[layer], wo[layer], wg[layer], wu[layer], wd[layer], bits[layer],
                   group_size, cos[layer], sin[layer], traditional, n_heads, n_kv_heads, k_cache, kv_stride[layer],
                   v_cache, kv_stride[layer],
                   n_cached[layer], scale, q, k_new, v_out[layer], k_out[layer], part, act, fast[layer],
                   write_kv[layer], chunks, quant, q_stride[layer], n_quant[layer], q_bits, q_group, cos_q[layer],
                   sin_q[layer], q_out[layer], qkv_bias[layer], qk_norm[layer], window[layer], post_norm[layer],
                   gelu, ob)


def rope_angles(position: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [D/2] for one position (float32, as MLX's RoPE computes them)."""
    theta = np.float32(position) * inv_freq
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return (x / np.sqrt(np.mean(x * x) + np.float32(eps))).astype(np.float32) * w
