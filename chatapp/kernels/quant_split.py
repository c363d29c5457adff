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

A unit walks its rows a tile of QTILE at a time: the tile's keys are dequantised into float32
scratch that stays in L1 (16 values per vector load, convert and FMA: simd.dequant16), then every
query head of the KV head meets them 16 keys at a time (group_attention's ``_scores``: one pass
over the tile for all G heads); the values likewise, under the P V outer-product kernel. The
first version took one dot product per (head, key, group) with a horizontal sum each, reading
every row G times. Measured on Zen 1 (SmolLM2's 3 heads of 64 a KV head, 1,800 rows): 112 ns a
row at 8 bits and 326 at 4 then; float16 rows take 88 through attend_split, and the tiles add
~26 (8 bits) or ~36 (4 bits) of dequantisation. Written as numba loops with the group size a
runtime value, that dequantisation stayed scalar (72-95 ns a row of 64).

The middle's keys sit ``delta_q`` positions further on than their compacted positions (cache/kv.py:
an eviction moves the quantised keys by a single delta that is applied to the queries instead of
re-quantising them), so its scores use the queries roped at position + delta_q: the caller ropes
``qg`` with those angles.
"""

from __future__ import annotations

from numba import njit

from .attention import accumulate_full, scores_full, softmax_max_inplace
from .group_attention import SLOT, _pv, _scores, pv_shape
from .llvm import as_f32
from .simd import dequant16
from .views import rows_of

QTILE = 64  # quantised rows dequantised at a time: 64 x 128 float32 = 32 KiB of keys or values


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


@njit(fastmath=True, nogil=True, cache=True)
def attend_quant_split(qg, G, D, quant, q_base, a, b, bits, group_size, scale, s, L, o, part, p0, kt,
                       vt):  # pragma: no cover - jitted
    """One unit over quantised rows a .. b - 1 of one KV head: the G query heads qg [G * D]
    (roped at the middle's position, unscaled); ``quant`` = (k packed bytes, k scales, k biases,
    v packed bytes, v scales, v biases) flat per-head buffers, the head's rows starting at element
    ``q_base[i]`` of each. Leaves in part, from p0, per head g: max, sum of exp, then the D
    unnormalised outputs. s [G4 * L] (L >= b - a) and o [G4 * D] are the caller's scratch as
    attend_split's (G4: G rounded up to the P V kernel's rows), kt / vt [QTILE * D] float32."""
    kq, ks, kb, vq, vs, vb = quant
    n = b - a
    for t0 in range(0, n, QTILE):
        m = min(QTILE, n - t0)
        dequant_rows(kq, ks, kb, q_base[0], q_base[1], a + t0, m, bits, group_size, D, kt)
        if D % 16 == 0:
            _scores(qg, G, D, kt, 0, 0, m, scale, s[t0:], L)
        else:
            for g in range(G):
                scores_full(qg[g * D:(g + 1) * D], rows_of(kt, 0, m, D), scale, s[g * L + t0:g * L + t0 + m])
    for g in range(G):
        mx, tot = softmax_max_inplace(s[g * L:g * L + n])
        part[p0 + g * (D + SLOT)] = mx
        part[p0 + g * (D + SLOT) + 1] = tot
    rows, width = pv_shape(G, D)
    o[:] = 0.0
    for g in range(G, (G + rows - 1) // rows * rows):
        s[g * L:g * L + n] = 0.0  # rows past the group: the kernel reads ``rows`` at a time
    for t0 in range(0, n, QTILE):
        m = min(QTILE, n - t0)
        dequant_rows(vq, vs, vb, q_base[3], q_base[4], a + t0, m, bits, group_size, D, vt)
        if width:
            for g0 in range(0, G, rows):
                for e in range(0, D, width):
                    _pv(rows, width, s, g0 * L + t0, L, vt, e, D, o, g0 * D + e, m, 1)
        else:
            for g in range(G):
                accumulate_full(s[g * L + t0:g * L + t0 + m], rows_of(vt, 0, m, D), o[g * D:(g + 1) * D])
    for g in range(G):
        dst = p0 + g * (D + SLOT) + SLOT
        for e in range(D):
            part[dst + e] = o[g * D + e]
