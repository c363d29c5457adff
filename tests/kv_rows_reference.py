"""The scalar row kernels kernels/kv_rows.py had before issue 34's vector rewrite (commit
9416cac): MLX's affine quantisation one value at a time, ``flush_rows`` and ``move_keys`` row
by row, and the held keys as backend/kv_native.keys built them; kept as the reference the
vector kernels must equal bit for bit (tests/test_kv_native.py). Slow (~300 ns a row of 64);
nothing in the app calls them."""

from __future__ import annotations

import numpy as np
from numba import njit

from chatapp.kernels.decode_step import apply_rope
from chatapp.kernels.half import store_f32
from chatapp.kernels.kv_rows import _copy, _round_to
from chatapp.kernels.llvm import as_f32
from chatapp.kernels.quant_split import dequant_rows


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
    zero = np.float32(0.0)
    for j in range(x.shape[0]):
        q = np.float32(np.rint((x[j] - bias) / scale))
        out[j] = np.uint8(min(max(q, zero), n_bins))


@njit(nogil=True, cache=True)
def _nibbles(q, out):  # pragma: no cover - jitted
    for j in range(out.shape[0]):
        out[j] = q[2 * j] | (q[2 * j + 1] << 4)


@njit(nogil=True, cache=True)
def quantize_row(x, D, bits, group, packed, p0, scales, biases, s0, q4):  # pragma: no cover - jitted
    """One row x [D] float32 as ``mx.quantize`` does, one value at a time."""
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
def move_keys(packed, scales, biases, H, p_stride, s_stride, keep, deltas, first, D, bits, group, cos, sin,
              traditional):  # pragma: no cover - jitted
    """kv_rows.move_keys as it was, row by row in place (cos/sin: tables [max shift + 1, D/2])."""
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
            quantize_row(x, D, bits, group, packed, pb + j * P, scales, biases, sb + j * ng, q4)


@njit(nogil=True, cache=True)
def flush_rows(src, H, src_stride, start, n, D, turn, cos, sin, traditional, packed, p_stride, scales,
               biases, s_stride, row, bits, group):  # pragma: no cover - jitted
    """kv_rows.flush_rows as it was: each row loaded, turned, rounded and quantised on its own."""
    x = np.empty(D, np.float32)
    rounded = np.empty(D, src.dtype)
    q4 = np.empty(group, np.uint8)
    P, ng = D * bits // 8, D // group
    for h in range(H):
        for r in range(n):
            b0 = h * src_stride + (start + r) * D
            for e in range(D):
                x[e] = as_f32(src[b0 + e])
            if turn:
                apply_rope(x, cos, sin, traditional)
                _round_to(x, rounded)
            quantize_row(x, D, bits, group, packed, h * p_stride + (row + r) * P, scales, biases,
                         h * s_stride + (row + r) * ng, q4)


@njit(nogil=True, cache=True)
def held_keys(buf, base, n_full, sinks, D, packed, scales, biases, pb, sb, n_mid, bits, group,
              out):  # pragma: no cover - jitted
    """One head's held keys (sinks | dequantised middle | recent) as backend/kv_native.keys built
    them before: element by element from the full buffer, the middle through dequant_rows."""
    for e in range(sinks * D):
        out[e] = as_f32(buf[base + e])
    if n_mid:
        dequant_rows(packed, scales, biases, pb, sb, 0, n_mid, bits, group, D, out[sinks * D:(sinks + n_mid) * D])
    o = (sinks + n_mid) * D
    for e in range((n_full - sinks) * D):
        out[o + e] = as_f32(buf[base + sinks * D + e])
