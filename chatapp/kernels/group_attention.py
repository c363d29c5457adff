"""The decode step's attention: one KV head's query heads together, over a split of the keys.

The first fused decode (decode_step until this module) ran ``scores_full`` and
``accumulate_full`` once per query head: each of a KV group's G heads read the group's K and V
again, each key's score was a horizontal sum, and the values were added into an output held in
memory (a load and a store per element per key). With SmolLM2 (9 heads on 3 KV heads of 64) at
4,096 cached tokens that was ~16 ms of a 25 ms token; 7B's 32 heads read 64 MB of K/V a layer.

Here a unit of work is a KV head and a split of its keys (flash decoding): the G queries meet
each key row once while it is in L1, scores run 16 keys at a time (``microkernels.dots16``: one
transpose-and-add per 16 keys), and P V runs on ``outer4x32`` with the head dims in lanes
(G rows of P, zero-padded to 4, times the value rows: accumulators stay in registers). Each
unit leaves, per query head, its max score, its sum of exp and its unnormalised output; the
splits are merged after the phase's barrier by ``merge_splits``. Splitting keeps both cores busy
when there are fewer KV heads than about four units a thread (SmolLM2 has 3).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .attention import PREFETCH_BYTES, accumulate_full, fast_exp, scores_full
from .llvm import as_f32, prefetch
from .microkernels import (
    A_ROWS,
    dots16,
    outer1x32,
    outer1x64,
    outer1x128,
    outer2x32,
    outer2x64,
    outer2x128,
    outer4x32,
    outer4x64,
)
from .softmax_lanes import softmax_row
from .views import rows_of

UNITS = 8  # (KV head, key split) units a layer aims for
MIN_SPLIT = 256  # keys per split at least: below that a split's fixed costs dominate
SLOT = 2  # floats before each partial output: its max and its sum


@njit(nogil=True, cache=True, inline="always")
def n_splits(n_kv_heads, n_keys):  # pragma: no cover - jitted
    """Key splits per KV head for ``n_keys`` keys (cached rows plus the new one)."""
    s = (UNITS + n_kv_heads - 1) // n_kv_heads
    return max(1, min(s, n_keys // MIN_SPLIT))


def part_size(n_heads: int, n_kv_heads: int, D: int) -> int:
    """Floats of the shared partials buffer: every query head's partials for the most splits
    ``n_splits`` gives."""
    return (UNITS + n_kv_heads - 1) // n_kv_heads * n_heads * (D + SLOT)


@njit(nogil=True, cache=True, inline="always")
def pv_shape(G, D):  # pragma: no cover - jitted
    """(rows, lanes) of the outer-product kernel for P V: rows of P per call (1, 2 or 4 heads)
    and head dims per call (the most of 128, 64, 32 that divide D and fit 16 accumulators);
    lanes 0: D is no multiple of 32 (accumulate_full instead)."""
    rows = 1 if G == 1 else (2 if G == 2 else A_ROWS)
    for width in (128, 64, 32):
        if D % width == 0 and rows * width <= 256:
            return rows, width
    return rows, 0


@njit(nogil=True, cache=True)
def _pv(rows, width, s, s_off, L, v, v_off, D, o, o_off, n, acc=0):  # pragma: no cover - jitted
    """o[i, 0:width] = sum_r s[s_off + i * L + r] * v[v_off + r * D, 0:width] for i < rows
    (o rows D apart; ``acc`` 1: added to o): the outerRxW kernel of that shape."""
    if rows == 1:
        if width == 128:
            outer1x128(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
        elif width == 64:
            outer1x64(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
        else:
            outer1x32(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
    elif rows == 2:
        if width == 128:
            outer2x128(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
        elif width == 64:
            outer2x64(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
        else:
            outer2x32(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
    elif width == 64 or width == 128:  # 4 rows: 64 lanes (16 accumulators) at most
        outer4x64(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)
    else:
        outer4x32(s, s_off, L, 1, v, v_off, D, o, o_off, D, n, acc)


@njit(fastmath=True, nogil=True, cache=True)
def _scores(qg, G, D, k_cache, k_base, a, b, scale, s, L, v_cache, v_base):  # pragma: no cover - jitted
    """s[g * L + i] = scale * qg[g] . k[a + i] for the cached rows a .. b - 1 of a head whose rows
    start at k_cache[k_base]: 16 keys per dots16 call, the tail one by one.

    The first head's pass brings the rows from memory: it asks for the keys PREFETCH_BYTES ahead
    and for the values of the rows it reads (P V reads them next, from L2; the later heads' passes
    read the keys from L2). Left to the hardware prefetchers, a split's 16 row streams kept too
    few misses in flight: 35 ns a key (G 3, D 64, float16, one thread streaming a 4k step's
    96 MB; 13 with the rows in cache), 25-28 with these hints (distances of 1-8 KB: the same)."""
    n = b - a
    n16 = n // 16 * 16
    line = 64 // k_cache.itemsize
    ahead = PREFETCH_BYTES // k_cache.itemsize
    for g in range(G):
        for i in range(0, n16, 16):
            if g == 0:
                r0 = (a + i) * D
                for j in range(0, 16 * D, line):
                    prefetch(k_cache, k_base + r0 + ahead + j)
                    prefetch(v_cache, v_base + r0 + j)
            dots16(qg, g * D, k_cache, k_base + (a + i) * D, D, D, scale, s, g * L + i)
        for i in range(n16, n):
            d = np.float32(0.0)
            row = k_base + (a + i) * D
            for e in range(D):
                d += qg[g * D + e] * as_f32(k_cache[row + e])
            s[g * L + i] = d * scale


@njit(fastmath=True, nogil=True, cache=True)
def attend_split(qg, G, D, k_cache, k_base, v_cache, v_base, a, b, kr, vn, with_new, scale, s, L, o, part,
                 p0):  # pragma: no cover - jitted
    """One unit: the G query heads qg [G * D] (roped, unscaled) over cached rows a .. b - 1 of
    one KV head (rows at k_cache[k_base + n * D], v_cache[v_base + n * D]; float32 or float16
    bits) and, ``with_new``, the new key kr / value vn [D] (float32). Leaves in part, from p0,
    per head g: max, sum of exp, then the D unnormalised outputs. s [G4 * L] and o [G4 * D]
    are the caller's scratch (G4: G rounded up to a multiple of A_ROWS; L >= b - a + 1)."""
    n = b - a
    m = n + 1 if with_new else n
    if D % 16 == 0:
        _scores(qg, G, D, k_cache, k_base, a, b, scale, s, L, v_cache, v_base)
    else:
        for g in range(G):
            scores_full(qg[g * D:(g + 1) * D], rows_of(k_cache, k_base + a * D, n, D), scale,
                        s[g * L:g * L + n])
    for g in range(G):
        if with_new:
            d = np.float32(0.0)
            for e in range(D):
                d += qg[g * D + e] * kr[e]
            s[g * L + n] = d * scale
        mx, tot = softmax_row(s, g * L, m)
        part[p0 + g * (D + SLOT)] = mx
        part[p0 + g * (D + SLOT) + 1] = tot
    # P V: rows of P (a group of up to 4 heads; zero rows past G) times the value rows, the
    # head dims in lanes, as many per call as the accumulators allow (pv_shape)
    rows, width = pv_shape(G, D)
    o[:] = 0.0
    if width:
        for g in range(G, (G + rows - 1) // rows * rows):
            s[g * L:g * L + n] = 0.0  # rows past the group: the kernel reads ``rows`` at a time
        for g0 in range(0, G, rows):
            for e in range(0, D, width):
                _pv(rows, width, s, g0 * L, L, v_cache, v_base + a * D + e, D, o, g0 * D + e, n)
        for g in range(G):
            dst = p0 + g * (D + SLOT) + SLOT
            for e in range(D):
                part[dst + e] = o[g * D + e]
    else:
        for g in range(G):
            o[:D] = 0.0
            accumulate_full(s[g * L:g * L + n], rows_of(v_cache, v_base + a * D, n, D), o[:D])
            dst = p0 + g * (D + SLOT) + SLOT
            for e in range(D):
                part[dst + e] = o[e]
    if with_new:
        for g in range(G):
            p = s[g * L + n]
            dst = p0 + g * (D + SLOT) + SLOT
            for e in range(D):
                part[dst + e] += p * vn[e]


@njit(fastmath=True, nogil=True, cache=True)
def merge_splits(part, n_heads, n_kv_heads, S, D, attn):  # pragma: no cover - jitted
    """attn[h * D:(h + 1) * D] = softmax-weighted output of head h from its S splits' partials
    (unit u = kv_head * S + split holds its G heads from u * G * (D + SLOT))."""
    G = n_heads // n_kv_heads
    for h in range(n_heads):
        kh, g = h // G, h % G
        base = kh * S * G * (D + SLOT) + g * (D + SLOT)
        mx = part[base]
        for sp in range(1, S):
            mx = max(mx, part[base + sp * G * (D + SLOT)])
        tot = np.float32(0.0)
        for e in range(D):
            attn[h * D + e] = 0.0
        for sp in range(S):
            p = base + sp * G * (D + SLOT)
            w = fast_exp(part[p] - mx)
            tot += w * part[p + 1]
            for e in range(D):
                attn[h * D + e] += w * part[p + SLOT + e]
        inv = np.float32(1.0) / tot
        for e in range(D):
            attn[h * D + e] *= inv
