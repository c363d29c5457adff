"""The decode step's attention over a cache's quantised middle: one KV head's query heads over a
split of its quantised rows, leaving partials that ``group_attention.merge_splits`` joins with
the full-precision splits; and ``dequant_rows``, which the prefill's key blocks use too.

A window-quant, quantized or scored-quant cache holds sinks | quantised middle | recent window.
The sinks and the recent window share one contiguous full-precision buffer, which the fused step
reads as it reads prealloc's (group_attention.attend_split); the middle is MLX's packed 8- or
4-bit layout per token (``mx.quantize`` along head_dim: packed bytes, one scale and one bias per
group), read here as stored: no dequantised copy of the history. Softmax is order-free, so the
two parts need not be in sequence order: each unit leaves its max, its sum of exp and its
unnormalised output, and the merge weighs them as it weighs the full splits.

Nothing is dequantised. With affine rows k = s q + b (per group), a score is, per group,
s (query . q) + b sum(query): the raw dot of the query with the row's unsigned integers, then
one scale and one bias per group. Where the CPU has ``vpdpbusd`` and the decode runs on fast
numerics (decode_step.FAST_ATTN) those raw dots run on integers against the query split into two
int8 planes, and each 16 rows' scales and biases are applied in the same kernel (qk_int.py);
elsewhere on floats, 16 keys per microkernels.dots16 call over the bytes or nibbles as stored.
P V likewise: o += sum_r (p_r s_r) q_r + (sum_r p_r b_r), the outer-product kernel reading each
row's integers and its scale as it goes (microkernels.outer_q*), the bias sums added per group.
With two or more query heads per KV head and 8-bit rows in groups of 64 (SmolLM2, Llama 3, Qwen,
Mistral at the default kv_group_size), the integer route runs every head of a pass together: the
scores with the keys in lanes (qk_lanes.py, the same floats as qk_int's) and P V on 16-bit weights
(pv_int.py). A SmolLM2 unit of 1,024 rows (one thread, called from numba, Xeon): 12 -> 8 ns a row
in L2, ~16 -> 11 from a 40 MB set (L3); ~17 from DRAM, half of it waiting for memory.

Until stop 44 each tile of 64 rows was dequantised into float32 scratch (simd.dequant16) and met
by the float kernels, a conversion and an FMA per element more, twice. Measured on Zen 4 (2 vCPUs,
2,048 rows in L2, medians of 15 interleaved rounds, ns a row): SmolLM2's KV head (3 heads of 64)
8-bit 22.5 -> 15.1, 4-bit 25.2 -> 17.9; Llama-2-7B's (1 head of 128, groups of 64) 8-bit
44.7 -> 15.0, 4-bit 54.5 -> 20.7; float16 rows through attend_split: 14.7-15.3.

The middle's keys sit ``delta_q`` positions further on than their compacted positions (cache/kv.py:
an eviction moves the quantised keys by a single delta that is applied to the queries instead of
re-quantising them), so its scores use the queries roped at position + delta_q: the caller ropes
``qg`` with those angles.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .attention import PREFETCH_BYTES
from .group_attention import SLOT, pv_shape
from .llvm import as_f32, prefetch
from .microkernels import (
    A_ROWS,
    dots16_u4,
    dots16_u8,
    outer_q4_1x32,
    outer_q4_1x64,
    outer_q4_2x32,
    outer_q4_2x64,
    outer_q4_4x32,
    outer_q4_4x64,
    outer_q8_1x32,
    outer_q8_1x64,
    outer_q8_2x32,
    outer_q8_2x64,
    outer_q8_4x32,
    outer_q8_4x64,
)
from .pv_int import pv_lanes
from .qk_int import int_layout, qscores16, quantise_queries
from .qk_lanes import heads_at, lanes_layout, qscores_lanes
from .simd import dequant16
from .softmax_lanes import softmax_row


@njit(fastmath=True, nogil=True, cache=True)
def dequant_rows(packed, scales, biases, p_base, s_base, r0, n, bits, group_size, D, out):  # pragma: no cover
    """out[0:n * D] = rows r0 .. r0 + n - 1 of one head's quantised buffers (its bytes from
    packed[p_base], its groups' scales and biases from s_base) in MLX's affine layout (4 bits:
    element 2j in the low nibble of byte j), as float32 in natural order: 16 values per
    simd.dequant16 (group sizes are multiples of 16: 32, 64, 128)."""
    P = D * bits // 8
    ng = D // group_size
    for i in range(n):
        r = r0 + i
        for g in range(ng):
            s = as_f32(scales[s_base + r * ng + g])
            b = as_f32(biases[s_base + r * ng + g])
            for c in range(g * group_size, (g + 1) * group_size, 16):
                dequant16(packed, p_base + r * P + c * bits // 8, out, i * D + c, s, b, bits)


@njit(nogil=True, cache=True, inline="always")
def _value(packed, e, bits):  # pragma: no cover - jitted
    """Quantised value (element) e of a packed buffer, as float32."""
    if bits == 8:
        return np.float32(packed[e])
    b = packed[e >> 1]
    return np.float32(b & 15 if e % 2 == 0 else b >> 4)


@njit(nogil=True, cache=True)
def _dots_q(bits, qg, q_off, packed, e0, D, length, out, o_off):  # pragma: no cover - jitted
    """out[o_off + i] = qg[q_off:q_off + length] . the raw values at packed elements e0 + i * D
    (i < 16): microkernels.dots16 on the bytes or nibbles as stored."""
    if bits == 8:
        dots16_u8(qg, q_off, packed, e0, D, length, np.float32(1.0), out, o_off)
    else:
        dots16_u4(qg, q_off, packed, e0, D, length, np.float32(1.0), out, o_off)


@njit(nogil=True, cache=True)
def _pv_q(bits, rows, width, p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, n, bsum,
          bs_off):  # pragma: no cover - jitted
    """microkernels' outer_q kernel of this shape: o[i, 0:width] += sum_r p[i, r] x row r's group
    scale x its integers at element e0 + r * D (i < rows, p rows L apart, o rows D apart), and
    bsum[bs_off + i] = sum_r p[i, r] x row r's group bias (scales and biases at x0 + r * ng)."""
    if bits == 8:
        if rows == 1:
            if width == 64:
                outer_q8_1x64(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
            else:
                outer_q8_1x32(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
        elif rows == 2:
            if width == 64:
                outer_q8_2x64(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
            else:
                outer_q8_2x32(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
        elif width == 64:
            outer_q8_4x64(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
        else:
            outer_q8_4x32(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
    elif rows == 1:
        if width == 64:
            outer_q4_1x64(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
        else:
            outer_q4_1x32(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
    elif rows == 2:
        if width == 64:
            outer_q4_2x64(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
        else:
            outer_q4_2x32(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
    elif width == 64:
        outer_q4_4x64(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)
    else:
        outer_q4_4x32(p, p_off, L, packed, e0, D, sc, bi, x0, ng, o, o_off, D, n, bsum, bs_off)


def param_size(G: int, D: int) -> int:
    """Floats of attend_quant_split's ``qp`` scratch for G query heads of D dims."""
    return 2 * G * (D // 32) + A_ROWS


@njit(fastmath=True, nogil=True, cache=True)
def _combine(dst, raw, sc, bi, f_raw, f_bias, first):  # pragma: no cover - jitted
    """dst (= or +=) f_raw * sc * raw + f_bias * bi elementwise: one group's share of the scores
    (slices, so that the loop vectorises; sc / bi float32 or float16 bits)."""
    for i in range(dst.shape[0]):
        v = f_raw * as_f32(sc[i]) * raw[i] + f_bias * as_f32(bi[i])
        dst[i] = v if first else dst[i] + v


@njit(fastmath=True, nogil=True, cache=True)
def attend_quant_split(qg, G, D, quant, q_base, a, b, bits, group_size, scale, s, L, o, part, p0, w, xq,
                       qp):  # pragma: no cover - jitted
    """One unit over quantised rows a .. b - 1 of one KV head: the G query heads qg [G * D]
    (roped at the middle's position, unscaled); ``quant`` = (k packed bytes, k scales, k biases,
    v packed bytes, v scales, v biases) flat per-head buffers, the head's rows starting at element
    ``q_base[i]`` of each. Leaves in part, from p0, per head g: max, sum of exp, then the D
    unnormalised outputs. s [G4 * L] (L >= b - a), o [G4 * D] and w [G4 * L] are the caller's
    float32 scratch (G4: G rounded up to the P V kernel's rows, as attend_split's), qp
    [param_size(G, D)] float32. xq [2 * G * D] int8: the scores on integers (qk_int.py, where
    the CPU has vpdpbusd and the layout is one it serves); xq empty: on floats.

    Nothing is dequantised: a key row's score is, per group, its scale times the query's dot with
    the row's unsigned integers plus its bias times the sum of the query's elements in the group;
    P V runs on the values' integers, P times each row's group scale, and adds each group's bias
    times P's sum over the rows."""
    kq, ks, kb, vq, vs, vb = quant
    n = b - a
    ng = D // group_size
    n16 = n // 16 * 16
    P = D * bits // 8
    ek, sk = q_base[0] * 8 // bits, q_base[1]
    # on integers, the G heads together: the scores (qk_lanes.py) and P V (pv_int.py)
    lanes = xq.shape[0] > 0 and lanes_layout(bits, group_size, D, G)
    if xq.shape[0] > 0 and int_layout(bits, group_size, D):
        quantise_queries(qg, G, D, bits, group_size, scale, xq, qp)
        for i in range(0, n16, 16):
            # the keys PREFETCH_BYTES ahead and this block's values, which P V reads next (see
            # group_attention._scores: the hardware prefetchers alone keep too few misses in flight)
            r0 = (a + i) * P
            for j in range(0, 16 * P, 64):
                prefetch(kq, q_base[0] + r0 + PREFETCH_BYTES + j)
                prefetch(vq, q_base[3] + r0 + j)
            if lanes:
                g0 = 0
                while g0 < G:
                    hc = heads_at(G - g0)
                    qscores_lanes(hc, D, xq, g0 * 2 * D, kq, q_base[0] + (a + i) * P, ks, kb, sk + (a + i) * ng, qp,
                                  g0 * 2 * ng, s, g0 * L + i, L)
                    g0 += hc
            else:
                for g in range(G):
                    qscores16(bits, group_size, D, xq, g * 2 * D, kq, q_base[0] + (a + i) * P, P, ks, kb,
                              sk + (a + i) * ng, qp, g * 2 * ng, s, g * L + i)
    else:
        for grp in range(ng):
            e0 = grp * group_size
            # w[g * L + i]: the query's dot with row a + i's integers of this group
            for i in range(0, n16, 16):
                for g in range(G):
                    _dots_q(bits, qg, g * D + e0, kq, ek + (a + i) * D + e0, D, group_size, w, g * L + i)
            x0, x1 = sk + a * ng + grp, sk + n16 * ng + a * ng + grp
            for g in range(G):
                qsum = np.float32(0.0)
                for e in range(e0, e0 + group_size):
                    qsum += qg[g * D + e]
                if ng == 1:
                    _combine(s[g * L:g * L + n16], w[g * L:g * L + n16], ks[x0:x1], kb[x0:x1], scale,
                             scale * qsum, True)
                else:
                    _combine(s[g * L:g * L + n16], w[g * L:g * L + n16], ks[x0:x1:ng], kb[x0:x1:ng], scale,
                             scale * qsum, grp == 0)
    for i in range(n16, n):  # the tail, a row at a time, on floats
        r = a + i
        for g in range(G):
            acc = np.float32(0.0)
            for grp in range(ng):
                d = np.float32(0.0)
                qsum = np.float32(0.0)
                for e in range(grp * group_size, (grp + 1) * group_size):
                    d += qg[g * D + e] * _value(kq, ek + r * D + e, bits)
                    qsum += qg[g * D + e]
                x = sk + r * ng + grp
                acc += as_f32(ks[x]) * d + as_f32(kb[x]) * qsum
            s[g * L + i] = acc * scale
    for g in range(G):
        mx, tot = softmax_row(s, g * L, n)
        part[p0 + g * (D + SLOT)] = mx
        part[p0 + g * (D + SLOT) + 1] = tot
    if lanes:
        pv_lanes(G, D, s, L, n, vq, q_base[3] + a * D, vs, vb, q_base[4] + a * ng, o)
        for g in range(G):
            dst = p0 + g * (D + SLOT) + SLOT
            for e in range(D):
                part[dst + e] = o[g * D + e]
        return
    rows, width = pv_shape(G, D)
    width = min(width, group_size, 64)
    o[:] = 0.0
    for g in range(G, (G + rows - 1) // rows * rows):
        s[g * L:g * L + n] = 0.0  # rows past the group: the kernel reads ``rows`` at a time
    ev, sv = q_base[3] * 8 // bits, q_base[4]
    bs = 2 * G * ng  # qp's tail: the bias sums of a call's rows
    for grp in range(ng):
        e0 = grp * group_size
        for g0 in range(0, G, rows):
            for e in range(e0, e0 + group_size, width):
                _pv_q(bits, rows, width, s, g0 * L, L, vq, ev + a * D + e, D, vs, vb, sv + a * ng + grp, ng, o,
                      g0 * D + e, n, qp, bs)
            for g in range(g0, min(G, g0 + rows)):
                t = qp[bs + g - g0]
                for e in range(e0, e0 + group_size):
                    o[g * D + e] += t
    for g in range(G):
        dst = p0 + g * (D + SLOT) + SLOT
        for e in range(D):
            part[dst + e] = o[g * D + e]
