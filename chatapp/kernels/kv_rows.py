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
or a contracted FMA would move values across rounding boundaries. Only the min/max pass takes
fastmath's no-NaN flags, so that it vectorises: min and max are exact in any order.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .decode_step import apply_rope
from .half import store_f32
from .llvm import as_f32
from .quant_split import dequant_rows


@njit(fastmath={"nnan", "ninf", "nsz"}, nogil=True, cache=True)
def _group_range(x, a, b):  # pragma: no cover - jitted
    lo, hi = np.float32(np.inf), np.float32(-np.inf)
    for j in range(a, b):
        v = x[j]
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


@njit(nogil=True, cache=True)
def _levels(x, out, bias, scale, n_bins):  # pragma: no cover - jitted
    """out[j] = clamp(rint((x[j] - bias) / scale), 0, n_bins) as bytes. x and out come in as
    slices (distinct arrays to LLVM), so the loop vectorises; indexing into the whole row and
    the whole output at offsets kept it scalar (3x slower)."""
    zero = np.float32(0.0)
    for j in range(x.shape[0]):
        q = np.float32(np.rint((x[j] - bias) / scale))
        out[j] = np.uint8(min(max(q, zero), n_bins))


@njit(nogil=True, cache=True)
def _nibbles(q, out):  # pragma: no cover - jitted
    for j in range(out.shape[0]):
        out[j] = q[2 * j] | (q[2 * j + 1] << 4)


@njit(nogil=True, cache=True)
def _quantize_row(x, D, bits, group, packed, p0, scales, biases, s0, q4):  # pragma: no cover - jitted
    """One row x [D] float32 into packed[p0:p0 + D * bits / 8] and the groups' scales and
    biases from s0 (float32, or uint16 float16 bits rounded to nearest even as MLX's cast);
    q4 [group] is scratch for 4-bit levels."""
    n_bins = np.float32((1 << bits) - 1)
    eps = np.float32(1e-7)
    for g in range(D // group):
        a = g * group
        w_min, w_max = _group_range(x, a, a + group)
        mask = abs(w_min) > abs(w_max)
        scale = max((w_max - w_min) / n_bins, eps)
        if not mask:
            scale = -scale
        edge = w_min if mask else w_max
        q0 = np.float32(np.rint(edge / scale))
        bias = np.float32(0.0)
        if q0 != 0:
            scale = edge / q0
            bias = edge
        store_f32(scales, s0 + g, scale)
        store_f32(biases, s0 + g, bias)
        out = p0 + a * bits // 8
        if bits == 8:
            _levels(x[a:a + group], packed[out:out + group], bias, scale, n_bins)
        else:
            _levels(x[a:a + group], q4, bias, scale, n_bins)
            _nibbles(q4, packed[out:out + group // 2])


@njit(nogil=True, cache=True)
def quantize_rows(x, n, D, bits, group, packed, scales, biases):  # pragma: no cover - jitted
    """n rows of D float32 values x [n * D] quantised as ``mx.quantize(rows, group, bits)``:
    packed [n * D * bits / 8] bytes (4 bits: value 2j in the low nibble of byte j), scales and
    biases [n * D / group] (float32, or uint16 float16 bits)."""
    q4 = np.empty(group, np.uint8)
    for r in range(n):
        _quantize_row(x[r * D:(r + 1) * D], D, bits, group, packed, r * D * bits // 8, scales, biases,
                      r * (D // group), q4)


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
    x = np.empty(D, np.float32)
    rounded = np.empty(D, src.dtype)
    q4 = np.empty(group, np.uint8)
    P, ng = D * bits // 8, D // group
    for h in range(H):
        for r in range(n):
            b0 = h * src_stride + (start + r) * D
            _load(src[b0:b0 + D], x)
            if turn:
                apply_rope(x, cos, sin, traditional)
                _round_to(x, rounded)
            _quantize_row(x, D, bits, group, packed, h * p_stride + (row + r) * P, scales, biases,
                          h * s_stride + (row + r) * ng, q4)


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
def move_keys(packed, scales, biases, H, p_stride, s_stride, keep, deltas, first, D, bits, group, cos, sin,
              traditional):  # pragma: no cover - jitted
    """The scored caches' eviction over a quantised middle of keys (flat per-head buffers, MLX's
    affine layout): kept row keep[j] moves to row j; rows before ``first`` (the first evicted
    one) keep their packed form, later ones are dequantised (rounded to the scales' dtype, as
    ``mx.dequantize`` returns them), turned by their own shift ``deltas[j]`` (cos/sin rows
    [-deltas[j]] of the tables [max shift + 1, D/2]), rounded again and quantised as
    ``mx.quantize`` does: what cache/scored.py's MLX route does with ``shift_each``."""
    P, ng = D * bits // 8, D // group
    x = np.empty(D, np.float32)
    rounded = np.empty(D, scales.dtype)
    q4 = np.empty(group, np.uint8)
    for h in range(H):
        pb, sb = h * p_stride, h * s_stride
        for j in range(keep.shape[0]):
            r = keep[j]
            if r < first:
                if r != j:
                    _copy(packed[pb + j * P:pb + (j + 1) * P], packed[pb + r * P:pb + (r + 1) * P], P)
                    _copy(scales[sb + j * ng:sb + (j + 1) * ng], scales[sb + r * ng:sb + (r + 1) * ng], ng)
                    _copy(biases[sb + j * ng:sb + (j + 1) * ng], biases[sb + r * ng:sb + (r + 1) * ng], ng)
                continue
            dequant_rows(packed, scales, biases, pb, sb, r, 1, bits, group, D, x)
            _round_to(x, rounded)
            d = -deltas[j]
            apply_rope(x, cos[d], sin[d], traditional)
            _round_to(x, rounded)
            _quantize_row(x, D, bits, group, packed, pb + j * P, scales, biases, sb + j * ng, q4)


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
def load_rows(buf, start, n, out):  # pragma: no cover - jitted
    """out[:n] = buf[start:start + n] as float32 (float32, or float16 bits)."""
    _load(buf[start:start + n], out[:n])
