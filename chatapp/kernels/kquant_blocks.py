"""GGUF's 5-bit and Q6_K blocks unpacked natively at load, for model/gguf_kquants.py (whose
docstring says what each becomes in MLX's layout).

Q5_0/Q5_1: 16 bytes of nibbles and 4 bytes of fifth bits a block, to a byte a value; numpy's
unpackbits and concatenations took 0.17 s of SmolLM2 Q4_K_M's load for 166 tensors.

Q6_K's pairs of 16-value sub-blocks regrouped as 8-bit groups of 32: the numpy version made
~10 temporaries the size of the tensor (float32 quants, their products, min/max reductions):
0.37 s of that load for 14 tensors. This is the same float32 arithmetic, value by value, in the
same order, so its bytes, scales and biases are the same bits (tests/test_gguf_kquants.py holds
the numpy version and compares them).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def q6_k_groups(q, s, k, scale, bias):  # pragma: no cover - jitted
    """q int16 [G, 32] (the signed quants of G groups, two sub-blocks of 16), s float32 [G, 2]
    (the sub-blocks' scales d * sc) -> k uint8 [G, 32] on one grid of step scale[g] =
    |s_big| / 4 (s_big the sub-block scale of larger magnitude, the first on ties), offset so
    that both sub-blocks' levels fit 0..255 where they can, and bias[g] = -offset x step."""
    zero, one, four = np.float32(0.0), np.float32(1.0), np.float32(4.0)
    t = np.empty(32, np.float32)
    for g in range(q.shape[0]):
        a0, a1 = s[g, 0], s[g, 1]
        s_big = a1 if abs(a1) > abs(a0) else a0
        step = abs(s_big) / four
        safe = one if step == zero else step
        r0, r1 = a0 / safe, a1 / safe
        lo, hi = np.float32(np.inf), np.float32(-np.inf)
        for i in range(32):
            v = np.rint(np.float32(q[g, i]) * (r0 if i < 16 else r1))
            t[i] = v
            lo = min(lo, v)
            hi = max(hi, v)
        off = min(max(np.float32(128.0), -lo), np.float32(255.0) - hi)
        if hi - lo > np.float32(255.0):
            off = -lo
        for i in range(32):
            k[g, i] = np.uint8(min(max(t[i] + off, zero), np.float32(255.0)))
        scale[g] = step
        bias[g] = -off * step


@njit(nogil=True, cache=True)
def five_bit_values(qs, qh, out):  # pragma: no cover - jitted
    """Q5_0/Q5_1 blocks -> out uint8 [n, 32]: qs [n, 16] bytes of nibbles (element j low, j + 16
    high), qh [n, 4] the fifth bits (bit j of the little-endian uint32 for element j)."""
    for b in range(qs.shape[0]):
        high = (np.uint32(qh[b, 0]) | np.uint32(qh[b, 1]) << np.uint32(8) | np.uint32(qh[b, 2]) << np.uint32(16)
                | np.uint32(qh[b, 3]) << np.uint32(24))
        for j in range(16):
            v = qs[b, j]
            out[b, j] = (v & np.uint8(15)) | np.uint8(((high >> np.uint32(j)) & np.uint32(1)) << np.uint32(4))
            out[b, 16 + j] = (v >> np.uint8(4)) | np.uint8(((high >> np.uint32(16 + j)) & np.uint32(1)) << np.uint32(4))
