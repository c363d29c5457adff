"""A prefill chunk of a Llama-style model (T tokens, every layer) in one native call.

Through MLX, a short prefill of SmolLM2-135M is glue, not arithmetic: per layer 7 products that
each dequantise their whole weight to float32 in memory (400 MB written for 30 layers) before a
numpy gemm, plus ~20 MLX ops and numpy conversions in between: a 31-token first turn took
~400 ms where its 6 GFLOP need a fraction of that. ``prefill_step`` does what decode_step does
for one token, for T of them: every pool thread runs the same call (``WorkPool.broadcast``) and
claims chunks of each phase from atomic counters, with a barrier at each phase's end:

    0. q, k, v rows     (a tile of ROW_TILE rows dequantised into cache-resident memory,
                         then multiplied with every token: the weight is read once per chunk)
    1. causal attention (prefill_attention.py), one (KV head, token block) per claim, over the
       cache's rows read in place plus the chunk's own rows (RoPE of the keys it reads included)
    2. x += o_proj(attn)
    3. act = silu(gate(m)) * up(m)      (GELU's tanh approximation for Gemma)
    4. x += down(act)
    5, 6. a sandwich-normed layer's (Gemma 3) adds: 2 and 4 write o and down's rows to scratch,
       and x += rms_norm(row) * w follows each, a claim per token

The products are float32 throughout (the exact route's numbers, summed in another order than
the BLAS): the tile holds each row de-interleaved (even elements, then odd, as the 4-bit
nibbles lie), and the activations are permuted the same way once per phase, so each dot product
runs over contiguous memory. The new K/V rows are not written into the cache here: they go to
``k_out``/``v_out`` in the cache's dtype (float32, or float16 bits), which the caller appends
through the cache's own ``update_and_fetch``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .affine import bias_at
from .decode_step import (
    FAST_ATTN,
    FAST_DOWN_WIDE,
    LINE,
    act_mul,
    phase_barrier,
    phase_claim,
    phase_done,
    rms_inv,
)
from .half import kv_buffer
from .int8panel import (
    PANEL8,
    PANEL_ROWS,
    PREFILL_ACT_BLOCK,
    pack_panel,
    panel_rows,
    panel_token_rows,
    panel_unit,
    quantise_panel_tokens,
)
from .llvm import as_f32
from .prefill_attention import chunk_attention
from .qk_int import INT_SCORES
from .views import rows_of

# a bit of the prefill's ``fast`` beside decode_step's FAST_* (which decode_step does not read):
# down_proj on 16-bit activations, two int8 planes (int8panel), on request (set_fast(prefill_down=
# "wide")): ~1/256 of int8's rounding at ~0.55x the int8 kernel's speed and ~2.3x the float tile's.
# It was the default until the biases' share came from the quantised activations (stop 31): on int8
# down_proj had cost SmolLM2 +0.56-0.62% perplexity, now +0.11% after a 1,024-token chunk (BENCHMARKS.md)
PREFILL_DOWN_WIDE = FAST_DOWN_WIDE
ROW_TILE = PANEL_ROWS  # rows per claim: 16 x 1536 float32 = 96 KiB dequantised, inside L2
# 8-bit rows take the int8 panel from this many tokens of a product on; fewer run on the float tile.
# Packing an 8-bit panel costs as much as dequantising the tile, and the float tile's products
# are cheap for a few tokens: in-kernel time, quiet Xeon, 2 threads, panel against float tile:
# Gemma 3 270M Q4_K_M (its rows mostly 8-bit) 2 tokens 29.7 / 19.3 ms, 8: 32.2 / 27.0, 24: 46.3 /
# 46.9; SmolLM2 Q4_K_M 8: 35.1 / 26.7, 16: 43.8 / 40.3, 24: 50.5 / 50.8, 32: 59.1 / 65.9. (4-bit
# panels cost half to pack and win from 8 tokens on: SmolLM2 Q4_0 8 tokens 21.4 / 24.6 ms.)
PANEL8_MIN_TOKENS = 24


@njit(fastmath=True, nogil=True, cache=True)
def _dequant_tile(w, bits, group_size, r0, n, tile):  # pragma: no cover - jitted
    """tile[i] = row r0 + i of w as float32, de-interleaved: elements 0, 2, 4, ... then 1, 3, ..."""
    packed, scales, biases = w
    half_k = tile.shape[1] // 2
    hg = group_size // 2
    for i in range(n):
        r = r0 + i
        lo = tile[i, :half_k]
        hi = tile[i, half_k:]
        for g in range(scales.shape[1]):
            s = as_f32(scales[r, g])
            m = bias_at(scales, biases, bits, r, g)
            base = g * hg
            if bits == 4:
                for j in range(hg):
                    b = packed[r, base + j]
                    lo[base + j] = np.float32(b & 15) * s + m
                    hi[base + j] = np.float32(b >> 4) * s + m
            else:
                for j in range(hg):
                    lo[base + j] = np.float32(packed[r, 2 * (base + j)]) * s + m
                    hi[base + j] = np.float32(packed[r, 2 * (base + j) + 1]) * s + m


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _put(dst, t, c, v, add):  # pragma: no cover - jitted
    if add:
        dst[t, c] += v
    else:
        dst[t, c] = v


@njit(fastmath=True, nogil=True, cache=True)
def _tile_times(tile, n, xp, dst, col0, add):  # pragma: no cover - jitted
    """dst[t, col0 + i] (= or +=) tile[i] . xp[t] for i < n and every token t (xp permuted as
    the tile is). Blocks of 4 rows x 2 tokens: 8 independent accumulators, 6 loads per 8 FMAs
    (4 rows x 1 token reached 26 GFLOP/s on one core here, this 78, numpy's sgemm 80)."""
    T = xp.shape[0]
    K = xp.shape[1]
    t = 0
    while t < T:
        pair = t + 1 < T
        x0 = xp[t]
        x1 = xp[t + 1] if pair else xp[t]
        i = 0
        while i + 4 <= n:
            w0, w1, w2, w3 = tile[i], tile[i + 1], tile[i + 2], tile[i + 3]
            a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0.0)
            for k in range(K):
                u = x0[k]
                v = x1[k]
                a00 += w0[k] * u
                a01 += w1[k] * u
                a02 += w2[k] * u
                a03 += w3[k] * u
                a10 += w0[k] * v
                a11 += w1[k] * v
                a12 += w2[k] * v
                a13 += w3[k] * v
            c = col0 + i
            _put(dst, t, c, a00, add)
            _put(dst, t, c + 1, a01, add)
            _put(dst, t, c + 2, a02, add)
            _put(dst, t, c + 3, a03, add)
            if pair:
                _put(dst, t + 1, c, a10, add)
                _put(dst, t + 1, c + 1, a11, add)
                _put(dst, t + 1, c + 2, a12, add)
                _put(dst, t + 1, c + 3, a13, add)
            i += 4
        while i < n:
            w0 = tile[i]
            a0 = a1 = np.float32(0.0)
            for k in range(K):
                a0 += w0[k] * x0[k]
                a1 += w0[k] * x1[k]
            _put(dst, t, col0 + i, a0, add)
            if pair:
                _put(dst, t + 1, col0 + i, a1, add)
            i += 1
        t += 2


@njit(fastmath=True, nogil=True, cache=True)
def _tile_product(w, bits, group_size, r0, n, xp, dst, col0, add, tile, fast, xq, pan, unit):  # pragma: no cover
    """dst[t, col0 + i] (= or +=) row r0 + i of w times token t, i < n <= ROW_TILE: on float32
    (the tile dequantised, then _tile_times), or when ``fast`` and the rows 4-bit (or 8-bit where
    int8panel.PANEL8, for PANEL8_MIN_TOKENS tokens or more) on int8 activations (int8panel: the
    rows packed into ``pan``, then every token of xq: panel_rows)."""
    if fast and (bits == 4 or bits == 8 and PANEL8 and xp.shape[0] >= PANEL8_MIN_TOKENS):
        packed, scales, biases = w
        steps = xp.shape[1] // 8
        width = PANEL_ROWS * bits // 4  # a step's dwords: the 8-bit panel is twice the 4-bit one
        panel = pan[0][:steps * width].reshape(steps, width)
        pack_panel(packed, scales, biases, bits, r0, n, panel, pan[1], pan[2])
        T = xp.shape[0]
        out = np.empty(panel_token_rows(T) * PANEL_ROWS, np.float32)
        panel_rows((panel, pan[1], pan[2]), xq, T, group_size, unit, out)
        for t in range(T):
            for i in range(n):
                _put(dst, t, col0 + i, out[t * PANEL_ROWS + i], add)
    else:
        _dequant_tile(w, bits, group_size, r0, n, tile)
        _tile_times(tile, n, xp, dst, col0, add)


@njit(fastmath=True, nogil=True, cache=True)
def _quantised(xp, fast, block, unit, planes):  # pragma: no cover - jitted
    """The int8 (``planes`` 1) or 16-bit (2) activations of xp [T, K] for the panel kernel
    (quantise_panel_tokens), tokens padded with zeros to panel_token_rows(T); tiny arrays when
    not ``fast`` (nothing reads them)."""
    T, K = xp.shape
    Tp = panel_token_rows(T) if fast else 1
    Kq = K if fast else unit
    xq = (np.zeros((Kq // 8, Tp, 4 * planes), np.int8), np.zeros((Kq // 8, Tp, 4 * planes), np.int8),
          np.zeros((Kq // unit, Tp), np.float32), np.zeros((Kq // unit, Tp), np.float32))
    if fast:
        quantise_panel_tokens(xp, block, unit, xq[0], xq[1], xq[2], xq[3])
    return xq


@njit(nogil=True, cache=True)
def _panel(K, group_size, fast):  # pragma: no cover - jitted
    """A claim's panel (pack_panel) for rows of K elements: the dwords flat, as many as an 8-bit
    panel's (a 4-bit one uses the first half), then scales and biases; tiny arrays when not ``fast``."""
    Kp = K if fast else group_size
    return (np.empty(Kp // 8 * 2 * PANEL_ROWS, np.uint32), np.empty((Kp // group_size, PANEL_ROWS), np.float32),
            np.empty((Kp // group_size, PANEL_ROWS), np.float32))


@njit(fastmath=True, nogil=True, cache=True)
def _permuted(src, norm_w, eps, xp):  # pragma: no cover - jitted
    """xp[t] = (rms_norm(src[t]) * norm_w, or src[t] when norm_w is empty), de-interleaved."""
    T, K = src.shape
    half = K // 2
    for t in range(T):
        inv = np.float32(1.0)
        if norm_w.shape[0]:
            ss = np.float32(0.0)
            for j in range(K):
                ss += src[t, j] * src[t, j]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(K) + eps)
        for j in range(half):
            a, b = src[t, 2 * j] * inv, src[t, 2 * j + 1] * inv
            if norm_w.shape[0]:
                a *= norm_w[2 * j]
                b *= norm_w[2 * j + 1]
            xp[t, j] = a
            xp[t, half + j] = b


@njit(fastmath=True, nogil=True, cache=True)
def _product_phase(ctl, phase, w, bits, group_size, xp, dst, add, tile, fast, xq, unit):  # pragma: no cover
    """dst (= or +=) xp @ w^T, tiles of ROW_TILE rows claimed one at a time; ends at the barrier."""
    N = w[0].shape[0]
    n_chunks = (N + ROW_TILE - 1) // ROW_TILE
    pan = _panel(xp.shape[1], group_size, fast)
    while True:
        c = phase_claim(ctl, phase, n_chunks)
        if c < 0:
            break
        r0 = c * ROW_TILE
        n = min(ROW_TILE, N - r0)
        _tile_product(w, bits, group_size, r0, n, xp, dst, r0, add, tile, fast, xq, pan, unit)
        phase_done(ctl, phase)
    phase_barrier(ctl, phase, n_chunks)


@njit(fastmath=True, nogil=True, cache=True)
def _add_normed_rows(ctl, phase, x, ob, w, off, eps):  # pragma: no cover - jitted
    """x[t] += rms_norm(ob[t]) * w[off:off + dim], a token per claim; ends at the barrier."""
    T, dim = x.shape
    while True:
        t = phase_claim(ctl, phase, T)
        if t < 0:
            break
        inv = rms_inv(ob[t], eps)
        for j in range(dim):
            x[t, j] += ob[t, j] * inv * w[off + j]
        phase_done(ctl, phase)
    phase_barrier(ctl, phase, T)


@njit(fastmath=True, nogil=True, cache=True)
def prefill_layer(ctl, x, attn_norm, mlp_norm, eps, wq, wk, wv, wo, wg, wu, wd, bits, group_size,
                  cos, sin, traditional, n_heads, n_kv_heads, k_cache, k_stride, v_cache, v_stride, n_cached,
                  scale, q, k_raw, v_new, k_out, v_out, attn, act, xbuf, q_keep, quant, q_stride, n_quant, q_bits,
                  q_group, cos_u, sin_u, qkv_bias, qk_norm, window, post_norm, gelu, ob, fast=0, act_block=0,
                  last_only=False):  # pragma: no cover
    """One layer for the chunk; ``x`` [T, dim] (float32) is updated in place (with ``last_only``
    its last row alone: the K and V of every token, then queries, attention, o_proj and the MLP
    for the last token only, as a chunk's last layer needs: its other rows reach nothing).

    w* = (packed uint8 [N, K*bits/8], scales, biases) as in decode_step; cos/sin [T, D/2] for
    the chunk's positions; k_cache/v_cache flat views of the cache's [kv_heads, capacity, D]
    buffers, n_cached rows held, float32 or float16 bits as uint16 (decode_step.layer_step).
    Outputs: k_out (roped) and v_out [T, kv_heads * D] for the caller to append, in the cache's
    dtype (float32, or float16 bits as uint16); q [T, heads * D], k_raw and v_new
    [T, kv_heads * D] (keys before RoPE, values: float32, what the chunk's own attention reads),
    attn [T, heads * D], act [T, hidden] are shared scratch (act holds silu(gate) x up
    de-interleaved, the order down_proj's products read); xbuf (float32, T * max(dim, heads * D)
    elements) this thread's own, which holds the q/k/v, o_proj and gate/up inputs permuted in turn
    (see ``prefill_scratch``). fast: decode_step's FAST_* bits (the decode's activation block
    above them is not read here): those products' 4-bit rows (and 8-bit ones, int8panel.PANEL8)
    run on int8 activations (int8panel), ``act_block`` natural elements per int8 scale (0:
    PREFILL_ACT_BLOCK); with PREFILL_DOWN_WIDE (above; and not FAST_DOWN) down_proj's on 16-bit
    ones (two int8 planes, the same blocks). q_keep [n, heads * D] (n may be 0) receives the
    chunk's last n queries before RoPE (a scored cache's votes; with ``last_only`` those rows'
    queries are computed too, and their o_proj and MLP). A quantised middle (n_quant of the
    n_cached rows, read in place; the cache buffers hold the others): quant, q_stride, q_bits,
    q_group, cos_u and sin_u as chunk_attention takes them. qkv_bias [nq + nk + nv] (or [0]): the
    q, k and v projections' biases, added to every token's row. ``window``, ``post_norm`` and
    ``gelu`` as decode_step.layer_step takes them (a sliding-window layer's queries see their
    last ``window`` positions; sandwich norms; GELU), with ob [T, dim] shared scratch for the
    sandwich norms' inputs."""
    T, dim = x.shape
    n_keep = q_keep.shape[0]
    # the first row whose output past K and V is wanted
    t1 = (T - max(1, n_keep) if n_keep < T else 0) if last_only else 0
    f_qkv, f_o, f_gu, f_down = (fast & 1) != 0, (fast & 2) != 0, (fast & 4) != 0, (fast & 8) != 0
    # down_proj on 16-bit activations (two int8 planes) unless FAST_DOWN puts it on int8
    down_planes = 2 if (fast & PREFILL_DOWN_WIDE) != 0 and not f_down else 1
    f_down = f_down or down_planes == 2
    act_blk = act_block if act_block else PREFILL_ACT_BLOCK
    unit = panel_unit(act_blk, group_size)
    D = cos.shape[1] * 2
    hidden = wg[0].shape[0]
    ka = n_heads * D
    # exact-width, C-contiguous buffers per input width (rows the vectoriser can stream), both in
    # xbuf: each is written at the start of its phase, after this thread's last read of the
    # other (the barrier before), so one buffer serves the two (down_proj reads act itself)
    xp_d = rows_of(xbuf, 0, T, dim)
    half_h = hidden // 2
    tile_d, tile_a = np.empty((ROW_TILE, dim), np.float32), np.empty((ROW_TILE, ka), np.float32)
    tile_h = np.empty((ROW_TILE, hidden), np.float32)
    no_norm = np.empty(0, np.float32)
    # values, not literals: numba compiles a callee once per literal argument (three _tile_product
    # and two _product_phase specialisations cost a first start ~6 s), and none of them is
    # faster for knowing these
    no_add, add, col_zero, one_plane = np.bool_(False), np.bool_(True), np.int64(0), np.int64(1)
    phase_o, phase_down = np.int64(2), np.int64(4)

    # 0. q, k, v: one phase over the row tiles of the three weights
    _permuted(x, attn_norm, eps, xp_d)
    xq = _quantised(xp_d, f_qkv, act_blk, unit, one_plane)
    xp_q, xq_q = xp_d, xq  # the queries' rows: t1 onwards
    if last_only:
        xp_q = xp_d[t1:]
        xq_q = _quantised(xp_q, f_qkv, act_blk, unit, one_plane)
    pan_d = _panel(dim, group_size, f_qkv or f_gu)
    nq, nk, nv = wq[0].shape[0], wk[0].shape[0], wv[0].shape[0]
    cq, ck = (nq + ROW_TILE - 1) // ROW_TILE, (nk + ROW_TILE - 1) // ROW_TILE
    n0 = cq + ck + (nv + ROW_TILE - 1) // ROW_TILE
    while True:
        c = phase_claim(ctl, 0, n0)
        if c < 0:
            break
        xin, xqi = xp_d, xq
        if c < cq:
            w, wb, dst, r0, b0 = wq, bits[0], q[t1:], c * ROW_TILE, 0
            xin, xqi = xp_q, xq_q
        elif c < cq + ck:
            w, wb, dst, r0, b0 = wk, bits[1], k_raw, (c - cq) * ROW_TILE, nq
        else:
            w, wb, dst, r0, b0 = wv, bits[2], v_new, (c - cq - ck) * ROW_TILE, nq + nk
        n = min(ROW_TILE, w[0].shape[0] - r0)
        _tile_product(w, wb, group_size, r0, n, xin, dst, r0, no_add, tile_d, f_qkv, xqi, pan_d, unit)
        if qkv_bias.shape[0]:
            for t in range(dst.shape[0]):
                for i in range(r0, r0 + n):
                    dst[t, i] += qkv_bias[b0 + i]
        if c < cq:  # the claimer copies its columns of the kept rows (a thread that arrives late
            # must not: q may hold a later layer's queries by then)
            for r in range(n_keep):
                for e in range(r0, r0 + n):
                    q_keep[r, e] = q[T - n_keep + r, e]
        phase_done(ctl, 0)
    phase_barrier(ctl, 0, n0)

    # 1. causal attention: query t sees the n_cached cached rows and the chunk's rows 0..t
    # (prefill_attention: claims of a KV head's query heads x a token block, keys in blocks)
    int_scores = (fast & FAST_ATTN) != 0 and INT_SCORES
    chunk_attention(ctl, 1, q, k_raw, v_new, cos, sin, traditional, n_heads, n_kv_heads, k_cache, k_stride,
                    v_cache, v_stride, n_cached, scale, k_out, v_out, attn, quant, q_stride, n_quant, q_bits, q_group,
                    cos_u, sin_u, qk_norm, eps, t1, int_scores, window, int_scores)

    # from here on the rows t1 .. T - 1 alone (all of them but in a chunk's last layer)
    Tn = T - t1
    xr, attn_r, act_r = x[t1:], attn[t1:], act[t1:]
    xp_d = rows_of(xbuf, 0, Tn, dim)
    xp_a = rows_of(xbuf, 0, Tn, ka)

    # 3. x += o_proj(attn) (sandwich norms: into ob, then x += norm(ob))
    post = post_norm.shape[0] > 0
    ob_r = ob[t1:]
    # (values, not conditional expressions in the call: numba's bytecode rewrite refuses those
    # in a call of this many arguments)
    o_dst, o_add = xr, add
    if post:
        o_dst, o_add = ob_r, no_add
    _permuted(attn_r, no_norm, eps, xp_a)
    _product_phase(ctl, phase_o, wo, bits[3], group_size, xp_a, o_dst, o_add,
                   tile_a, f_o, _quantised(xp_a, f_o, act_blk, unit, one_plane), unit)
    if post:
        _add_normed_rows(ctl, 5, xr, ob_r, post_norm, 0, eps)

    # 4. act = silu(gate(m)) * up(m), gate and up tiles of the same rows in one claim
    _permuted(xr, mlp_norm, eps, xp_d)
    xq = _quantised(xp_d, f_gu, act_blk, unit, one_plane)
    gu = np.empty((Tn, ROW_TILE), np.float32)
    uu = np.empty((Tn, ROW_TILE), np.float32)
    n4 = (hidden + ROW_TILE - 1) // ROW_TILE
    while True:
        c = phase_claim(ctl, 3, n4)
        if c < 0:
            break
        r0 = c * ROW_TILE
        n = min(ROW_TILE, hidden - r0)
        _tile_product(wg, bits[4], group_size, r0, n, xp_d, gu, col_zero, no_add, tile_d, f_gu, xq, pan_d, unit)
        _tile_product(wu, bits[5], group_size, r0, n, xp_d, uu, col_zero, no_add, tile_d, f_gu, xq, pan_d, unit)
        for t in range(Tn):
            for i in range(n):
                c = r0 + i  # written de-interleaved, as _permuted would leave it for down_proj
                act_r[t, (c >> 1) + (c & 1) * half_h] = act_mul(gu[t, i], uu[t, i], gelu)
        phase_done(ctl, 3)
    phase_barrier(ctl, 3, n4)

    # 5. x += down(act), act already permuted (no norm: _permuted would only move its elements)
    _product_phase(ctl, phase_down, wd, bits[6], group_size, act_r, o_dst, o_add,
                   tile_h, f_down, _quantised(act_r, f_down, act_blk, unit, np.int64(down_planes)), unit)
    if post:
        _add_normed_rows(ctl, 6, xr, ob_r, post_norm, x.shape[1], eps)


@njit(nogil=True, cache=True)
def prefill_scratch(T, dim, attn_width):  # pragma: no cover - jitted
    """Elements of a thread's xbuf: the wider of a layer's permuted inputs [T, dim] and
    [T, heads * D], which it holds one at a time (a 7B model at 256 tokens: 4 MiB, where a
    buffer for each input, [T, hidden] included, took 19 MiB a thread)."""
    return T * max(dim, attn_width)


# phases 0-6 above: a layer passes 5 barriers (7 with sandwich norms), as decode_step's does
LAYER_CTL = 2 * LINE * 7


@njit(fastmath=True, nogil=True, cache=True)
def prefill_step(ctl, x, attn_norms, mlp_norms, eps, wq, wk, wv, wo, wg, wu, wd, bits, group_size,
                 cos, sin, traditional, n_heads, n_kv_heads, kv_addr, kv_size, kv_stride, n_cached,
                 scale, q, k_raw, v_raw, k_out, v_out, attn, act, fast, q_keep, q_addr, q_size, q_stride, n_quant,
                 q_bits, q_group, cos_u, sin_u, scales_like, qkv_bias, qk_norm, window, post_norm, gelu, ob,
                 act_block=0, all_rows=False):  # pragma: no cover
    """Every layer for the chunk ``x`` [T, dim] in one call (``prefill_layer`` per layer, ``ctl``
    holding LAYER_CTL counters per layer); only x's last row is the chunk's output, the one the
    head reads (the last layer computes past K and V for that row alone: on the 8-layer 7B
    geometry its exact float products of every row had been half a 256-token chunk's time),
    unless ``all_rows`` (bench quality scores every position; callers pass it always, so one
    signature is compiled);
    weights, norms and cache addresses as token_step takes them, the cache buffers' element type
    that of k_out. k_out/v_out [L, T, kv_heads * D] (float32, or float16 bits as uint16) receive
    each layer's new roped K and V; v_raw
    [T, kv_heads * D] float32 scratch for the values; fast [L]
    as token_step's (``cpu.numerics = fast``: those products on int8 activations, int8panel.py,
    ``act_block`` elements per int8 scale, 0: PREFILL_ACT_BLOCK), plus PREFILL_DOWN_WIDE
    (FusedDecoder.prefill_mask). Each calling thread makes its own permuted-input buffer once for
    all layers (prefill_layer's xbuf). q_keep [L, n, heads * D] float32: each layer's last n
    queries before RoPE (n = 0: none; ``rope_rows`` turns them). Each layer's quantised middle
    (n_quant of the n_cached rows; 0: none) as token_step takes it, with cos_u/sin_u [L, D/2]
    the angles that turn its keys back by its rotation delta (chunk_attention); qkv_bias
    [L, nq + nk + nv] (or [L, 0]) each layer's q, k and v biases; qk_norm [L, 2 * D] (or [L, 0]) its
    per-head q and k norms' weights (Qwen3: applied before RoPE; q_keep is kept before them).
    Per layer: n_cached and n_quant [L], cos/sin [L, T, D/2] (each layer's positions and RoPE
    base), window [L], post_norm [L, 2 * dim] (or [L, 0]); ``gelu`` and ob [T, dim] as
    prefill_layer takes them."""
    xbuf = np.empty(prefill_scratch(x.shape[0], x.shape[1], q.shape[1]), np.float32)
    byte = np.empty(0, np.uint8)
    for layer in range(bits.shape[0]):
        k_cache = kv_buffer(kv_addr[layer, 0], kv_size[layer], k_out)
        v_cache = kv_buffer(kv_addr[layer, 1], kv_size[layer], k_out)
        qa, qs = q_addr[layer], q_size[layer]
        quant = (kv_buffer(qa[0], qs[0], byte), kv_buffer(qa[1], qs[1], scales_like),
                 kv_buffer(qa[2], qs[2], scales_like), kv_buffer(qa[3], qs[3], byte),
                 kv_buffer(qa[4], qs[4], scales_like), kv_buffer(qa[5], qs[5], scales_like))
        last = layer == bits.shape[0] - 1 and not all_rows
        prefill_layer(ctl[layer * LAYER_CTL:(layer + 1) * LAYER_CTL], x, attn_norms[layer], mlp_norms[layer], eps,
                      wq[layer], wk[layer], wv[layer], wo[layer], wg[layer], wu[layer], wd[layer], bits[layer],
                      group_size, cos[layer], sin[layer], traditional, n_heads, n_kv_heads, k_cache,
                      kv_stride[layer], v_cache, kv_stride[layer], n_cached[layer], scale, q, k_raw, v_raw,
                      k_out[layer], v_out[layer], attn, act, xbuf, q_keep[layer], quant, q_stride[layer],
                      n_quant[layer], q_bits, q_group, cos_u[layer], sin_u[layer], qkv_bias[layer], qk_norm[layer],
                      window[layer], post_norm[layer], gelu, ob, fast[layer], act_block, last)


def rope_table(start: int, n: int, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n, D/2] for positions start .. start + n - 1 (as decode_step.rope_angles)."""
    theta = np.arange(start, start + n, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rope_rows(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool) -> np.ndarray:
    """x [..., n, heads, D] rotated by cos/sin [n, D/2] (decode_step.apply_rope's rule, vectorised)."""
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    else:
        half = cos.shape[1]
        a, b = x[..., :half], x[..., half:]
        out[..., :half], out[..., half:] = a * c - b * s, a * s + b * c
    return out
