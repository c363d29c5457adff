"""MLX's packed 3-, 5- and 6-bit quants as a bit stream, packed and unpacked natively.

MLX stores a row of ``bits``-bit quants as a little-endian bit stream (value i at bits
[i*bits, (i+1)*bits)), so 8 values fill ``bits`` whole bytes. No kernel here reads that in place:
the fused steps read such a weight widened to a byte a value (backend/fused_layers.widened), and a
GGUF file's Q5_0/Q5_K blocks are packed into it at load (model/gguf_kquants.pack_bits). Both ran
through MLX or numpy before: widening SmolLM2 Q4_K_M's 166 five-bit matrices by mx.dequantize
took 1.36 s of a 3.3 s load on the Xeon, packing them with eight numpy passes 0.38 s.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def unpack_rows(packed, bits, out):  # pragma: no cover - jitted
    """out [N, K] (uint8) = the quants of packed [N, K * bits / 8] (uint8, MLX's bit stream);
    K a multiple of 8."""
    N, K = out.shape
    mask = np.uint64((1 << bits) - 1)
    for r in range(N):
        for g in range(K // 8):
            w = np.uint64(0)
            base = g * bits
            for b in range(bits):
                w |= np.uint64(packed[r, base + b]) << np.uint64(8 * b)
            for i in range(8):
                out[r, 8 * g + i] = np.uint8((w >> np.uint64(bits * i)) & mask)


@njit(nogil=True, cache=True)
def pack_rows(q, bits, out):  # pragma: no cover - jitted
    """out [N, K * bits / 8] (uint8) = MLX's bit stream of the quants q [N, K] (uint8, each
    < 2**bits); K a multiple of 8."""
    N, K = q.shape
    for r in range(N):
        for g in range(K // 8):
            w = np.uint64(0)
            for i in range(8):
                w |= np.uint64(q[r, 8 * g + i]) << np.uint64(bits * i)
            base = g * bits
            for b in range(bits):
                out[r, base + b] = np.uint8((w >> np.uint64(8 * b)) & np.uint64(255))


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [N, K] quants of a packed [N, K * bits / 8] row array (3, 5 or 6 bits)."""
    n, width = packed.shape
    out = np.empty((n, width * 8 // bits), np.uint8)
    unpack_rows(np.ascontiguousarray(packed), bits, out)
    return out


def pack_bits_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packed bytes [..., K * bits / 8] of uint8 quants [..., K] (3, 5 or 6 bits)."""
    lead, k = q.shape[:-1], q.shape[-1]
    flat = np.ascontiguousarray(q.reshape(-1, k), dtype=np.uint8)
    out = np.empty((flat.shape[0], k * bits // 8), np.uint8)
    pack_rows(flat, bits, out)
    return out.reshape(*lead, k * bits // 8)
