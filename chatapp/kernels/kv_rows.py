"""Cache maintenance on host rows: MLX's affine quantisation and RoPE re-positioning.

A window-quant cache quantises ``evict_chunk`` rows leaving its recent window, and an evicting
cache turns its kept keys back by the rows it dropped (cache/kv.py). Through MLX each of those
rewrote whole buffers: a 256-row flush of SmolLM2's 30 layers at 3,000 tokens held took ~95 ms
(the left shift of the window alone 62, since a slice update whose source is the same buffer
copies it), a visible stall in the stream. backend/kv_native.py does the same work on the
buffers' host views in place; these are its row kernels.

``quantize_rows`` follows MLX's CPU ``quantize`` (mlx/backend/cpu/quantized.cpp) operation for
operation in IEEE float32, so the packed bytes, scales and biases equal ``mx.quantize``'s: per
group, min and max, the scale (max - min) / (2^bits - 1) (at least 1e-7) signed toward the
larger magnitude edge, which is then made exact (q0 = rint(edge / scale); scale = edge / q0,
bias = edge) and each value rint((w - bias) / scale), clamped. No fastmath here: a reciprocal
or a contracted FMA would move values across rounding boundaries. The min/max, the levels and
the keys' turn run on 16-lane vectors (requant_lanes.py), the groups' scales side by side across
groups: the same operations on each value, so the same bits as the scalar kernels they replaced
(tests/kv_rows_reference.py, which the tests compare them with).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .decode_step import apply_rope
from .half import store_f32
from .llvm import as_f32
from .pool import chunk_done, claim, pool
from .requant_lanes import levels16, range16, turn_halves16
from .simd import dequant16


@njit(nogil=True, cache=True, error_model="numpy")
def _group_scales(lo, hi, n, n_bins, sc, bi):  # pragma: no cover - jitted
    """Each group's scale and bias (float32) from its min lo[g] and max hi[g], g < n, as MLX's
    ``quantize``. One group's scalars are a chain of three divisions and a rint; written as a
    loop over groups with no fastmath, LLVM runs 16 groups' chains side by side (selects for the
    branches), each lane's operations those of the scalar code; edge / q0 is computed for every
    group and kept only where q0 != 0 (numpy's error model: a division by zero gives inf, not a
    Python exception). A min or max of -0.0 for 0.0 changes nothing here: the span hi - lo is
    the same, and an edge of zero leaves q0 = 0 (no bias, the scale as it was)."""
    eps = np.float32(1e-7)
    zero = np.float32(0.0)
    for g in range(n):
        w_min, w_max = lo[g], hi[g]
        mask = abs(w_min) > abs(w_max)
        scale = max((w_max - w_min) / n_bins, eps)
        if not mask:
            scale = -scale
        edge = w_min if mask else w_max
        q0 = np.float32(np.rint(edge / scale))
        exact = edge / q0
        sc[g] = exact if q0 != zero else scale
        bi[g] = edge if q0 != zero else zero


@njit(nogil=True, cache=True)
def _group_scratch(n):  # pragma: no cover - jitted
    """_quantize_block's per-group scratch (mins, maxes, scales, biases) for n groups."""
    return np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)


@njit(nogil=True, cache=True)
def _quantize_block(x, xo, n, D, bits, group, packed, p0, scales, biases, s0, lo, hi, sc,
                    bi):  # pragma: no cover - jitted
    """Rows x[xo:xo + n * D] float32, quantised as ``mx.quantize(rows, group, bits)`` into
    packed[p0:p0 + n * D * bits / 8] and n * D / group scales and biases from s0 (float32, or
    uint16 float16 bits rounded to nearest even as MLX's cast). lo, hi, sc, bi: float32 scratch
    of at least n * D / group. Each group's min/max and levels run on 16-lane vectors
    (requant_lanes.py), the scales between them across groups (_group_scales)."""
    G = n * (D // group)
    n_bins = np.float32((1 << bits) - 1)
    for g in range(G):
        lo[g], hi[g] = range16(x, xo + g * group, group)
    _group_scales(lo, hi, G, n_bins, sc, bi)
    for g in range(G):
        store_f32(scales, s0 + g, sc[g])
        store_f32(biases, s0 + g, bi[g])
        levels16(x, xo + g * group, group, packed, p0 + g * group * bits // 8, bi[g], sc[g], n_bins, bits)


@njit(nogil=True, cache=True)
def quantize_rows(x, n, D, bits, group, packed, scales, biases):  # pragma: no cover - jitted
    """n rows of D float32 values x [n * D] quantised as ``mx.quantize(rows, group, bits)``:
    packed [n * D * bits / 8] bytes (4 bits: value 2j in the low nibble of byte j), scales and
    biases [n * D / group] (float32, or uint16 float16 bits)."""
    G = n * (D // group)
    lo, hi, sc, bi = _group_scratch(G)
    _quantize_block(x, 0, n, D, bits, group, packed, 0, scales, biases, 0, lo, hi, sc, bi)


@njit(nogil=True, cache=True)
def _load(src, x):  # pragma: no cover - jitted
    """x[:] = src as float32 (src a slice: float32, or uint16 float16 bits)."""
    for e in range(x.shape[0]):
        x[e] = as_f32(src[e])


@njit(nogil=True, cache=True)
def _store(x, dst):  # pragma: no cover - jitted
    for e in range(x.shape[0]):
        store_f32(dst, e, x[e])


@njit(nogil=True, cache=True)
def _round_to(x, buf):  # pragma: no cover - jitted
    """x rounded to buf's dtype and back (buf: scratch of x's length, float32 or float16 bits), as
    an MLX array of that dtype would hold the values."""
    _store(x, buf)
    _load(buf, x)


@njit(nogil=True, cache=True)
def flush_rows(src, H, src_stride, start, n, D, turn, cos, sin, traditional, packed, p_stride, scales,
               biases, s_stride, row, bits, group):  # pragma: no cover - jitted
    """Quantise rows start .. start + n - 1 of each of H heads of ``src`` (a flat [H, capacity, D]
    buffer, float32 or float16 bits, heads src_stride apart) into rows row .. row + n - 1 of the
    flat quantised buffers (packed bytes heads p_stride apart; scales and biases s_stride). With
    ``turn`` each row is first rotated by cos/sin and rounded to the buffer's dtype, as the MLX
    route's Repositioner.shift leaves it before ``mx.quantize``."""
    x = np.empty(n * D, np.float32)
    rounded = np.empty(n * D, src.dtype)
    P, ng = D * bits // 8, D // group
    lo, hi, sc, bi = _group_scratch(n * ng)
    for h in range(H):
        b0 = h * src_stride + start * D
        _load(src[b0:b0 + n * D], x)
        if turn:
            for r in range(n):
                apply_rope(x[r * D:(r + 1) * D], cos, sin, traditional)
            _round_to(x, rounded)
        _quantize_block(x, 0, n, D, bits, group, packed, h * p_stride + row * P, scales, biases,
                        h * s_stride + row * ng, lo, hi, sc, bi)


@njit(nogil=True, cache=True)
def _turn_halves(x1, x2, cos, sin):  # pragma: no cover - jitted
    """(x1, x2) <- (x1 cos - x2 sin, x1 sin + x2 cos) in place (float32 or float16 bits): the
    halves come in as slices, so the loop vectorises."""
    for i in range(x1.shape[0]):
        a, b = as_f32(x1[i]), as_f32(x2[i])
        store_f32(x1, i, a * cos[i] - b * sin[i])
        store_f32(x2, i, a * sin[i] + b * cos[i])


@njit(nogil=True, cache=True)
def rotate_rows(buf, H, stride, start, end, D, cos, sin, traditional):  # pragma: no cover - jitted
    """Rotate rows start .. end - 1 of each head of a flat [H, capacity, D] buffer (float32 or
    float16 bits) in place by cos/sin, in float32."""
    x = np.empty(D, np.float32)
    half = D // 2
    for h in range(H):
        for r in range(start, end):
            base = h * stride + r * D
            if traditional:
                _load(buf[base:base + D], x)
                apply_rope(x, cos, sin, traditional)
                _store(x, buf[base:base + D])
            else:
                _turn_halves(buf[base:base + half], buf[base + half:base + D], cos, sin)


@njit(nogil=True, cache=True)
def _copy(dst, src, m):  # pragma: no cover - jitted
    for i in range(m):
        dst[i] = src[i]


@njit(nogil=True, cache=True)
def shift_rows(buf, H, stride, start, n, length, W):  # pragma: no cover - jitted
    """Rows start + n .. length - 1 of each head of a flat [H, capacity, W] buffer moved back to
    ``start``, n rows at a time. Each piece's source and destination are disjoint slices, so the
    copy vectorises; indexing the one buffer at two offsets stayed scalar (1 GB/s measured, 70x
    slower), and a slice assignment copies through a temporary."""
    count = (length - start - n) * W
    piece = n * W
    for h in range(H):
        dst = h * stride + start * W
        for off in range(0, count, piece):
            m = min(piece, count - off)
            a = dst + off
            _copy(buf[a:a + m], buf[a + piece:a + piece + m], m)


@njit(nogil=True, cache=True)
def compact_rows(buf, H, stride, W, keep):  # pragma: no cover - jitted
    """Row keep[j] of each head of a flat [H, capacity, W] buffer moved to row j, for ascending
    ``keep`` (so keep[j] >= j: a row is read before anything is written over it)."""
    for h in range(H):
        base = h * stride
        for j in range(keep.shape[0]):
            r = keep[j]
            if r != j:
                _copy(buf[base + j * W:base + (j + 1) * W], buf[base + r * W:base + (r + 1) * W], W)


@njit(nogil=True, cache=True)
def _turn_rows(x, y, n, D, rows, deltas, cos, sin, traditional):  # pragma: no cover - jitted
    """y[i] = row i of x [n * D] turned by rows -deltas[rows + i] of the cos/sin tables (flat,
    D/2 a row), in float32 with apply_rope's operations (a cos - b sin, a sin + b cos; no FMA).
    Into a second buffer, so that no value is read after its pair partner was written."""
    half = D // 2
    for i in range(n):
        d = -deltas[rows + i]
        o = i * D
        if traditional:
            c, s = cos[d * half:(d + 1) * half], sin[d * half:(d + 1) * half]
            for k in range(half):
                a, b = x[o + 2 * k], x[o + 2 * k + 1]
                y[o + 2 * k] = a * c[k] - b * s[k]
                y[o + 2 * k + 1] = a * s[k] + b * c[k]
        else:
            turn_halves16(x, o, y, o, cos, sin, d * half, half)


@njit(nogil=True, cache=True, inline="always")
def _dequant_row(packed, scales, biases, pb, sb, r, bits, group, D, x, xo):  # pragma: no cover - jitted
    """x[xo:xo + D] = row r of one head's quantised buffers as float32: quant_split.dequant_rows'
    operations (simd.dequant16: one FMA per value), inlined here, where a call per row of 64
    values cost as much as the values."""
    P, ng = D * bits // 8, D // group
    for g in range(ng):
        s = as_f32(scales[sb + r * ng + g])
        b = as_f32(biases[sb + r * ng + g])
        for c in range(g * group, (g + 1) * group, 16):
            dequant16(packed, pb + r * P + c * bits // 8, x, xo + c, s, b, bits)


@njit(nogil=True, cache=True)
def _requantise_keys(ctl, chunk, packed, scales, biases, H, p_stride, s_stride, keep, deltas, j0, D, bits,
                     group, cos, sin, traditional, out_p, out_s, out_b):  # pragma: no cover - jitted
    """The pool's kernel for move_keys: chunk c is rows j0 + b chunk .. of head c // (chunks a
    head), b = c % (chunks a head). Each kept row keep[j] is dequantised from the buffers,
    rounded to the scales' dtype, turned by its own delta, rounded again and quantised into
    row j - j0 of that head's part of out_p / out_s / out_b: nothing is written in place, so
    a chunk never overwrites a row another chunk has still to read.

    The steps run over the chunk's rows as a whole (each a loop over chunk x D values that
    vectorises) rather than row by row through small calls: the same operations in the same
    order on each value, so the same bits."""
    n_move = keep.shape[0] - j0
    per_head = (n_move + chunk - 1) // chunk
    n_chunks = H * per_head
    P, ng = D * bits // 8, D // group
    x = np.empty(chunk * D, np.float32)
    y = np.empty(chunk * D, np.float32)
    rounded = np.empty(chunk * D, scales.dtype)
    lo, hi, sc, bi = _group_scratch(chunk * ng)
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        h, a = c // per_head, j0 + (c % per_head) * chunk
        n = min(chunk, keep.shape[0] - a)
        pb, sb = h * p_stride, h * s_stride
        for i in range(n):
            _dequant_row(packed, scales, biases, pb, sb, keep[a + i], bits, group, D, x, i * D)
        m = n * D
        _round_to(x[:m], rounded[:m])
        _turn_rows(x, y, n, D, a, deltas, cos, sin, traditional)
        _round_to(y[:m], rounded[:m])
        o = h * n_move + a - j0
        _quantize_block(y, 0, n, D, bits, group, out_p, o * P, out_s, out_b, o * ng, lo, hi, sc, bi)
        chunk_done(ctl)


@njit(nogil=True, cache=True)
def _keep_packed(packed, scales, biases, H, p_stride, s_stride, keep, j0, P, ng):  # pragma: no cover - jitted
    """Kept rows keep[j] < ``first`` (j < j0) moved to row j as stored, in every head."""
    for h in range(H):
        pb, sb = h * p_stride, h * s_stride
        for j in range(j0):
            r = keep[j]
            if r != j:
                _copy(packed[pb + j * P:pb + (j + 1) * P], packed[pb + r * P:pb + (r + 1) * P], P)
                _copy(scales[sb + j * ng:sb + (j + 1) * ng], scales[sb + r * ng:sb + (r + 1) * ng], ng)
                _copy(biases[sb + j * ng:sb + (j + 1) * ng], biases[sb + r * ng:sb + (r + 1) * ng], ng)


@njit(nogil=True, cache=True)
def _write_back(packed, scales, biases, H, p_stride, s_stride, j0, n_move, P, ng, out_p, out_s,
                out_b):  # pragma: no cover - jitted
    """Each head's re-quantised rows (out_*) written at rows j0 .. j0 + n_move - 1."""
    for h in range(H):
        _copy(packed[h * p_stride + j0 * P:h * p_stride + (j0 + n_move) * P],
              out_p[h * n_move * P:(h + 1) * n_move * P], n_move * P)
        a, b = h * s_stride + j0 * ng, h * n_move * ng
        _copy(scales[a:a + n_move * ng], out_s[b:b + n_move * ng], n_move * ng)
        _copy(biases[a:a + n_move * ng], out_b[b:b + n_move * ng], n_move * ng)


# rows a chunk of move_keys re-quantises: ~30 chunks a head for SmolLM2's 4k-row middle, enough to
# balance two threads, and small scratch (3 x chunk x D floats) that stays in L2
MOVE_CHUNK = 128


def move_keys(packed, scales, biases, H, p_stride, s_stride, keep, deltas, first, D, bits, group, cos, sin,
              traditional, threads=None):
    """The scored caches' eviction over a quantised middle of keys (flat per-head buffers, MLX's
    affine layout): kept row keep[j] moves to row j; rows before ``first`` (the first evicted
    one) keep their packed form, later ones are dequantised (rounded to the scales' dtype, as
    ``mx.dequantize`` returns them), turned by their own shift ``deltas[j]`` (cos/sin rows
    [-deltas[j]] of the tables [max shift + 1, D/2]), rounded again and quantised as
    ``mx.quantize`` does: what cache/scored.py's MLX route does with ``shift_each``.

    Written row by row as one scalar loop this took 79-90 ms of a SmolLM2 eviction (30 layers,
    3 x ~3,000 rows each, ~300 ns a row of 64). The re-quantised rows now go chunk by chunk
    over the kernel pool's threads (``threads``: a WorkPool; None, the process's) into scratch,
    then are copied into place once every chunk is done."""
    keep = np.ascontiguousarray(keep, np.int64)
    deltas = np.ascontiguousarray(deltas, np.int64)
    cos = np.ascontiguousarray(cos, np.float32).reshape(-1)
    sin = np.ascontiguousarray(sin, np.float32).reshape(-1)
    j0 = int(np.searchsorted(keep, first))  # keep is ascending: rows j < j0 stay packed
    P, ng = D * bits // 8, D // group
    _keep_packed(packed, scales, biases, H, p_stride, s_stride, keep, j0, P, ng)
    n_move = keep.shape[0] - j0
    if n_move <= 0:
        return
    out_p = np.empty(H * n_move * P, np.uint8)
    out_s = np.empty(H * n_move * ng, scales.dtype)
    out_b = np.empty(H * n_move * ng, biases.dtype)
    work = threads if threads is not None else pool()
    chunk = min(MOVE_CHUNK, n_move)
    work.run(_requantise_keys, H * ((n_move + chunk - 1) // chunk), chunk, packed, scales, biases, H,
             p_stride, s_stride, keep, deltas, j0, D, bits, group, cos, sin, traditional, out_p, out_s, out_b)
    _write_back(packed, scales, biases, H, p_stride, s_stride, j0, n_move, P, ng, out_p, out_s, out_b)


@njit(nogil=True, cache=True)
def move_rows(buf, H, stride, D, keep, deltas, cos, sin, traditional):  # pragma: no cover - jitted
    """Row keep[j] of each head of a flat [H, capacity, D] key buffer (float32 or float16 bits)
    moved to row j and turned by its own shift deltas[j] (cos/sin rows [-deltas[j]]), in float32:
    the scored cache's eviction from full-precision keys (ascending ``keep``, as compact_rows)."""
    x = np.empty(D, np.float32)
    for h in range(H):
        base = h * stride
        for j in range(keep.shape[0]):
            r, d = keep[j], -deltas[j]
            if r == j and d == 0:
                continue
            _load(buf[base + r * D:base + (r + 1) * D], x)
            if d:
                apply_rope(x, cos[d], sin[d], traditional)
            _store(x, buf[base + j * D:base + (j + 1) * D])


@njit(nogil=True, cache=True)
def held_keys(buf, base, n_full, sinks, D, packed, scales, biases, pb, sb, n_mid, bits, group,
              out):  # pragma: no cover - jitted
    """One head's held keys in sequence order into out [(n_full + n_mid) * D] float32: the
    sinks (rows 0 .. sinks - 1 of the full buffer ``buf`` from ``base``, float32 or float16
    bits), the quantised middle (n_mid rows from pb / sb, dequantised as quant_split.dequant_rows
    does), then the full buffer's other rows (the recent window). Written straight into place:
    through a dequantised copy of the middle and numpy's copies this was ~60 ms of a SmolLM2
    eviction's votes (30 layers, ~4,300 rows a head)."""
    _load(buf[base:base + sinks * D], out[:sinks * D])
    for i in range(n_mid):
        _dequant_row(packed, scales, biases, pb, sb, i, bits, group, D, out, (sinks + i) * D)
    rest = (n_full - sinks) * D
    o = (sinks + n_mid) * D
    _load(buf[base + sinks * D:base + sinks * D + rest], out[o:o + rest])
