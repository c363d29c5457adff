"""The decode step's attention over a cache's quantised middle: one KV head's query heads over a
split of its quantised rows, leaving partials that ``group_attention.merge_splits`` joins with
the full-precision splits; and ``dequant_rows``, which the prefill's key blocks use.

A window-quant, quantized or scored-quant cache holds sinks | quantised middle | recent window.
The sinks and the recent window share one contiguous full-precision buffer, which the fused step
reads as it reads prealloc's (group_attention.attend_split); the middle is MLX's packed 8- or
4-bit layout per token (``mx.quantize`` along head_dim: packed bytes, one scale and one bias per
group), read here as stored: no dequantised copy of the history. Softmax is order-free, so the
two parts need not be in sequence order: each unit leaves its max, its sum of exp and its
unnormalised output, and the merge weighs them as it weighs the full splits.

The middle's keys sit ``delta_q`` positions further on than their compacted positions (cache/kv.py:
an eviction moves the quantised keys by a single delta that is applied to the queries instead of
re-quantising them), so its scores use the queries roped at position + delta_q: the caller ropes
``qq`` with those angles. Scores: for 8 bits the query in natural order; for 4 bits the packed
byte j of a group holds elements 2j (low nibble) and 2j + 1 (high), so the query is split into
its even and odd elements once per unit (``_scores_quant``'s layout); the output of the values'
4-bit rows comes back the same way and is interleaved here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .attention import _accumulate_quant, _scores_quant, softmax_max_inplace
from .group_attention import SLOT
from .llvm import as_f32, byte_to_f32, hi_nibble, lo_nibble
from .views import rows_of


@njit(fastmath=True, nogil=True, cache=True)
def dequant_rows(packed, scales, biases, p_base, s_base, r0, n, bits, group_size, D, out):  # pragma: no cover
    """out[0:n * D] = rows r0 .. r0 + n - 1 of one head's quantised buffers (its bytes from
    packed[p_base], its groups' scales and biases from s_base) in MLX's affine layout (4 bits:
    element 2j in the low nibble of byte j), as float32 in natural order. (2-D views walked
    from 0, one loop per bit width: a row at a time through offset indices measured ~8x
    slower, the loops left scalar.)"""
    P = D * bits // 8
    ng = D // group_size
    pk = rows_of(packed, p_base + r0 * P, n, P)
    sc = rows_of(scales, s_base + r0 * ng, n, ng)
    bi = rows_of(biases, s_base + r0 * ng, n, ng)
    ot = rows_of(out, 0, n, D)
    if bits == 8:
        for i in range(n):
            for g in range(ng):
                s = as_f32(sc[i, g])
                b = as_f32(bi[i, g])
                for j in range(g * group_size, (g + 1) * group_size):
                    ot[i, j] = byte_to_f32(pk[i, j]) * s + b
    else:
        half = group_size // 2
        for i in range(n):
            for g in range(ng):
                s = as_f32(sc[i, g])
                b = as_f32(bi[i, g])
                for j in range(g * half, (g + 1) * half):
                    ot[i, 2 * j] = lo_nibble(pk[i, j]) * s + b
                    ot[i, 2 * j + 1] = hi_nibble(pk[i, j]) * s + b


@njit(fastmath=True, nogil=True, cache=True)
def prepare_quant_queries(qg, G, D, bits, group_size, qq, qsum):  # pragma: no cover - jitted
    """qq [G * D]: each head's query in the quantised part's order (natural for 8 bits, evens then
    odds for 4), qsum [G * D / group_size] its group sums (natural order)."""
    ng = D // group_size
    half = D // 2
    for g in range(G):
        for gi in range(ng):
            acc = np.float32(0.0)
            for e in range(gi * group_size, (gi + 1) * group_size):
                acc += qg[g * D + e]
            qsum[g * ng + gi] = acc
        if bits == 4:
            for j in range(half):
                qq[g * D + j] = qg[g * D + 2 * j]
                qq[g * D + half + j] = qg[g * D + 2 * j + 1]
        else:
            for e in range(D):
                qq[g * D + e] = qg[g * D + e]


@njit(fastmath=True, nogil=True, cache=True)
def attend_quant_split(qq, qsum, G, D, quant, q_base, a, b, bits, group_size, scale, s, L, o, part,
                       p0):  # pragma: no cover - jitted
    """One unit over quantised rows a .. b - 1 of one KV head: qq / qsum from
    ``prepare_quant_queries`` (queries roped at the middle's position); ``quant`` = (k packed
    bytes, k scales, k biases, v packed bytes, v scales, v biases) flat per-head buffers, the
    head's rows starting at element ``q_base[i]`` of each. Leaves in part, from p0, per head g:
    max, sum of exp, then the D unnormalised outputs (natural order). s [G * L] (L >= b - a) and
    o [2 * D] are the caller's scratch."""
    kq, ks, kb, vq, vs, vb = quant
    n = b - a
    P = D * bits // 8
    ng = D // group_size
    kqr = rows_of(kq, q_base[0] + a * P, n, P)
    ksr = rows_of(ks, q_base[1] + a * ng, n, ng)
    kbr = rows_of(kb, q_base[2] + a * ng, n, ng)
    vqr = rows_of(vq, q_base[3] + a * P, n, P)
    vsr = rows_of(vs, q_base[4] + a * ng, n, ng)
    vbr = rows_of(vb, q_base[5] + a * ng, n, ng)
    half = D // 2
    for g in range(G):
        sg = s[g * L:g * L + n]
        _scores_quant(qq[g * D:(g + 1) * D], qsum[g * ng:(g + 1) * ng], kqr, ksr, kbr, bits, group_size, scale, sg)
        mx, tot = softmax_max_inplace(sg)
        dst = p0 + g * (D + SLOT)
        part[dst] = mx
        part[dst + 1] = tot
        acc = o[:D]
        for e in range(D):
            acc[e] = 0.0
        _accumulate_quant(sg, vqr, vsr, vbr, bits, group_size, acc)
        if bits == 4:  # [evens | odds] -> natural order
            for j in range(half):
                part[dst + SLOT + 2 * j] = acc[j]
                part[dst + SLOT + 2 * j + 1] = acc[half + j]
        else:
            for e in range(D):
                part[dst + SLOT + e] = acc[e]
