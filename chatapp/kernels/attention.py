"""Single-query (decode) attention over a KV cache, for MLX's CPU backend.

MLX's CPU attention is not fused: for one query over N cached keys it runs two batched
matmuls on the bundled reference BLAS and a scalar ``exp`` (~12 ns per score here). With
Llama-2-7B's 32 heads of 128 and 4,096 cached tokens that is tens of milliseconds per layer,
more than the layer's weights. These kernels read the cache buffers in place (numpy views of
MLX's arrays, strided by the buffer's spare capacity) and stream K and V once:

- ``attend_full``: keys/values in float32.
- ``attend_parts``: a history split into full-precision parts and one quantised part (the
  window-quant cache: sinks | quantised middle | recent window), with MLX's packed 8- or 4-bit
  K/V read directly - no dequantised copy of the history - and one softmax over all parts.

The softmax uses ``fast_exp`` (Cephes' single-precision polynomial, ~1 ulp), which the
vectoriser turns into SIMD code; numba's ``np.exp`` would call the scalar libm routine.
Query heads share KV heads in groups (GQA): query head h reads KV head h // (H / KVH).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .llvm import as_f32, byte_to_f32, exp2_int, hi_nibble, lo_nibble, prefetch
from .microkernels import max16
from .pool import chunk_done, claim
from .views import rows_of

_LOG2E = np.float32(1.4426950408889634)
_C1 = np.float32(0.693359375)
_C2 = np.float32(-2.12194440e-4)
# how far ahead the single-query kernels ask for K/V rows: one thread streaming a head's rows
# from DRAM keeps too few misses in flight by the hardware prefetchers alone (the row kernels'
# finding, rows4.py)
PREFETCH_BYTES = 2048


@njit(fastmath=True, inline="always", cache=True)
def fast_exp(x):  # pragma: no cover - jitted
    """exp(x) for float32 x <= 88 (Cephes expf); inputs below -87 give ~0, not denormals."""
    x = max(x, np.float32(-87.0))
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _C1 - n * _C2
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * exp2_int(n)


@njit(fastmath=True, cache=True, nogil=True)
def scores_full(q, k, scale, s):  # pragma: no cover - jitted
    """s[n] = scale * q . k[n] for q [D], k [N, D] (float32, or float16 bits as uint16)."""
    D = q.shape[0]
    ahead = PREFETCH_BYTES // k.itemsize
    line = 64 // k.itemsize
    for n in range(k.shape[0]):
        for j in range(0, D, line):
            prefetch(k, n * D + ahead + j)
        d = np.float32(0.0)
        for j in range(D):
            d += q[j] * as_f32(k[n, j])
        s[n] = d * scale


@njit(fastmath=True, cache=True, nogil=True)
def _scores_quant(q, qsum, packed, scales, biases, bits, group_size, scale, s):  # pragma: no cover - jitted
    """s[n] = scale * q . dequant(k[n]) for MLX-quantised keys (packed bytes [N, D*bits/8]).

    q is in natural order for 8 bits; for 4 bits it is [even elements | odd elements] (see
    qmatmul.split_even_odd). qsum[g] is the sum of q over group g (in natural order)."""
    ng = scales.shape[1]
    nb = packed.shape[1]
    for n in range(packed.shape[0]):
        acc = np.float32(0.0)
        for g in range(ng):
            d = np.float32(0.0)
            if bits == 8:
                base = g * group_size
                for j in range(group_size):
                    d += byte_to_f32(packed[n, base + j]) * q[base + j]
            else:
                half = group_size // 2
                base = g * half
                for j in range(half):
                    b = packed[n, base + j]
                    d += lo_nibble(b) * q[base + j] + hi_nibble(b) * q[nb + base + j]
            acc += as_f32(scales[n, g]) * d + as_f32(biases[n, g]) * qsum[g]
        s[n] = acc * scale


@njit(fastmath=True, cache=True, nogil=True)
def softmax_max_inplace(s):  # pragma: no cover - jitted
    """s <- exp(s - max(s)); returns (max, sum): the caller divides once at the end, and a split
    attention merges its parts by their maxima (the decode's split units use
    softmax_lanes.softmax_row, the same contract on 16-lane vectors)."""
    n16 = s.shape[0] // 16 * 16
    m = max16(s, n16) if n16 else s[0]
    for n in range(n16, s.shape[0]):
        m = max(m, s[n])
    tot = np.float32(0.0)
    for n in range(s.shape[0]):
        e = fast_exp(s[n] - m)
        s[n] = e
        tot += e
    return m, tot


@njit(fastmath=True, cache=True, nogil=True)
def softmax_inplace(s):  # pragma: no cover - jitted
    """s <- exp(s - max(s)); returns the sum (the caller divides once at the end)."""
    return softmax_max_inplace(s)[1]


@njit(fastmath=True, cache=True, nogil=True)
def accumulate_full(p, v, o):  # pragma: no cover - jitted
    """o += sum_n p[n] * v[n] for v [N, D] (float32, or float16 bits as uint16)."""
    D = o.shape[0]
    ahead = PREFETCH_BYTES // v.itemsize
    line = 64 // v.itemsize
    for n in range(v.shape[0]):
        for j in range(0, D, line):
            prefetch(v, n * D + ahead + j)
        w = p[n]
        for j in range(D):
            o[j] += w * as_f32(v[n, j])


@njit(fastmath=True, cache=True, nogil=True)
def _accumulate_quant(p, packed, scales, biases, bits, group_size, o):  # pragma: no cover - jitted
    """o += sum_n p[n] * dequant(v[n]) for MLX-quantised values; o in natural order, except
    for 4 bits: [even elements | odd elements] (the caller interleaves them back)."""
    ng = scales.shape[1]
    nb = packed.shape[1]
    for n in range(packed.shape[0]):
        w = p[n]
        for g in range(ng):
            c = w * as_f32(scales[n, g])
            bb = w * as_f32(biases[n, g])
            if bits == 8:
                base = g * group_size
                for j in range(group_size):
                    o[base + j] += c * byte_to_f32(packed[n, base + j]) + bb
            else:
                half = group_size // 2
                base = g * half
                for j in range(half):
                    b = packed[n, base + j]
                    o[base + j] += c * lo_nibble(b) + bb
                    o[nb + base + j] += c * hi_nibble(b) + bb


@njit(fastmath=True, cache=True, nogil=True, inline="always")
def head_rows(flat, head, head_stride, n, width):  # pragma: no cover - jitted
    """Head ``head``'s [n, width] block of a flat buffer (see ``heads_view``), C-contiguous."""
    start = head * head_stride
    return rows_of(flat, start, n, width)


@njit(fastmath=True, cache=True, nogil=True)
def attend_full(ctl, chunk, q, kvh, k, k_stride, v, v_stride, n, scale, out):  # pragma: no cover - jitted
    """out[h] = softmax(scale * q[h] K^T) V for q [H, D] over n tokens of flat K/V buffers
    holding kvh heads. Chunked over query heads (``chunk`` adjacent heads each) for ``pool.run``."""
    H, D = q.shape
    G = H // kvh
    n_chunks = (H + chunk - 1) // chunk
    s = np.empty(n, np.float32)
    o = np.empty(D, np.float32)
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for h in range(c * chunk, min(H, (c + 1) * chunk)):
            kh = h // G
            scores_full(q[h], head_rows(k, kh, k_stride, n, D), scale, s)
            tot = softmax_inplace(s)
            o[:] = 0.0
            accumulate_full(s, head_rows(v, kh, v_stride, n, D), o)
            for j in range(D):
                out[h, j] = o[j] / tot
        chunk_done(ctl)


@njit(fastmath=True, cache=True, nogil=True)
def attend_parts(ctl, chunk, q, qq, qqsum, kvh, full, full_strides, n_head, n_tail,
                 quant, quant_strides, n_quant, bits, group_size, scale, out):  # pragma: no cover - jitted
    """Attention over [head (full) | quantised | tail (full)] parts with one softmax.

    q [H, D] float32 queries for the full parts; qq [H, D] the queries for the quantised part
    (moved by the cache's rotation delta; evens then odds for 4 bits), qqsum [H, D/gs] its group
    sums. ``full`` = (k_head, v_head, k_tail, v_tail) flat float32 buffers with their head strides
    in ``full_strides``; ``quant`` = (k_packed, k_scales, k_biases, v_packed, v_scales, v_biases)
    flat buffers (packed as uint8) with strides in ``quant_strides``. Each part may be empty.
    Chunked over query heads like ``attend_full``.
    """
    H, D = q.shape
    G = H // kvh
    k_head, v_head, k_tail, v_tail = full
    kq, ks, kb, vq, vs, vb = quant
    P = D * bits // 8
    ng = D // group_size
    n = n_head + n_quant + n_tail
    n_chunks = (H + chunk - 1) // chunk
    s = np.empty(n, np.float32)
    o = np.empty(D, np.float32)
    tmp = np.empty(D, np.float32)
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for h in range(c * chunk, min(H, (c + 1) * chunk)):
            kh = h // G
            if n_head:
                scores_full(q[h], head_rows(k_head, kh, full_strides[0], n_head, D), scale, s[:n_head])
            if n_quant:
                _scores_quant(qq[h], qqsum[h], head_rows(kq, kh, quant_strides[0], n_quant, P),
                              head_rows(ks, kh, quant_strides[1], n_quant, ng),
                              head_rows(kb, kh, quant_strides[2], n_quant, ng),
                              bits, group_size, scale, s[n_head:n_head + n_quant])
            if n_tail:
                scores_full(q[h], head_rows(k_tail, kh, full_strides[2], n_tail, D), scale, s[n_head + n_quant:])
            tot = softmax_inplace(s)
            o[:] = 0.0
            if n_quant:
                _accumulate_quant(s[n_head:n_head + n_quant], head_rows(vq, kh, quant_strides[3], n_quant, P),
                                  head_rows(vs, kh, quant_strides[4], n_quant, ng),
                                  head_rows(vb, kh, quant_strides[5], n_quant, ng),
                                  bits, group_size, o)
                if bits == 4:  # the quantised part's output is [evens | odds]: interleave it back
                    half = D // 2
                    for j in range(D):  # (a loop, not ``tmp[:] = o``: see views.py)
                        tmp[j] = o[j]
                    for j in range(half):
                        o[2 * j] = tmp[j]
                        o[2 * j + 1] = tmp[half + j]
            if n_head:
                accumulate_full(s[:n_head], head_rows(v_head, kh, full_strides[1], n_head, D), o)
            if n_tail:
                accumulate_full(s[n_head + n_quant:], head_rows(v_tail, kh, full_strides[3], n_tail, D), o)
            for j in range(D):
                out[h, j] = o[j] / tot
        chunk_done(ctl)


def heads_view(a: np.ndarray) -> tuple[np.ndarray, int]:
    """A [heads, n, width] array as (flat 1-D view, head stride in elements) without copying.

    Cache buffers hand out [heads, n, width] slices of a [heads, capacity, width] buffer: each
    head's rows are contiguous, the heads ``capacity`` rows apart. numba compiles array
    arguments for their layout, and a strided 3-D view gets generic ("A") indexing that the
    vectoriser cannot use (measured: 16 -> 36 GB/s with contiguous rows). The flat view covers
    exactly the bytes from the first head's first row to the last head's last row. Arrays whose
    rows are not contiguous are copied first.
    """
    heads, n, width = a.shape
    item = a.itemsize
    if a.strides[2] != item or (n > 1 and a.strides[1] != width * item) or a.strides[0] % item or a.strides[0] < 0:
        a = np.ascontiguousarray(a)
    stride = a.strides[0] // item if heads > 1 else n * width
    span = (heads - 1) * stride + n * width
    flat = np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(item,))
    return flat, stride
