"""Symmetric affine weights: the kernels' weights without their bias array.

MLX's affine layout dequantises w = scale * q + bias per group. GGUF's Q4_0 and Q8_0 are
symmetric (w = d * (q - 8), d * q with q signed), so ``mx.load`` writes bias = -8 * scale
(4-bit) or -128 * scale (8-bit) into every group: a second array as large as the scales that
a decoded token reads for nothing (Q4_0 with float16 scales: 20 bytes per 32 weights instead of
18). ``drop_symmetric_biases`` replaces such a bias array by an empty one ([N, 0]), and every
kernel that meets one takes the bias as ``-2 ** (bits - 1) * scale`` (``bias_at``): the product
by a power of two is exact, so results are the same bits as with the array.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .llvm import as_f32
from .pool import chunk_done, chunks, claim, pool


def symmetric_offset(bits: int) -> float:
    """The bias of a symmetric group, in units of its scale: -2 ** (bits - 1)."""
    return -float(1 << (bits - 1))


def is_symmetric(scales: np.ndarray, biases: np.ndarray, bits: int) -> bool:
    """Whether every bias is exactly ``symmetric_offset(bits)`` times its scale (float32, or
    float16 bits as uint16)."""
    if biases.shape != scales.shape or biases.dtype != scales.dtype or biases.size == 0:
        return False
    if scales.ndim != 2 or not (scales.flags.c_contiguous and biases.flags.c_contiguous):
        return False
    found = np.ones(1, np.int64)  # cleared by the first chunk that meets an asymmetric group
    pool().run(_all_symmetric, chunks(scales.shape[0], SCAN_ROWS), SCAN_ROWS, scales, biases,
               np.float32(symmetric_offset(bits)), found)
    return bool(found[0])


SCAN_ROWS = 256  # rows a thread claims at a time


@njit(nogil=True, cache=True)
def _all_symmetric(ctl, chunk, scales, biases, offset, found):  # pragma: no cover - jitted
    """Clear ``found[0]`` when a bias is not offset x its scale; the pool's threads claim chunks
    of rows, and skip the rest once one has cleared it. Compared in float32, where the product
    of a float16 or float32 scale by a power of two is exact: a bias that had to round
    (overflow, the last bits of a subnormal) is not equal. A row's groups are compared without
    a branch, so the loop vectorises (float16 converted 16 lanes at a time): the scales and
    biases of a 7B model's 32 layers, 0.8 GB, in 0.33 s as one thread's loop that stopped at the
    first mismatch, 0.06 s so."""
    n = scales.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        if found[0]:
            for r in range(c * chunk, min(n, (c + 1) * chunk)):
                same = True
                for g in range(scales.shape[1]):
                    same &= as_f32(biases[r, g]) == offset * as_f32(scales[r, g])
                if not same:
                    found[0] = 0
                    break
        chunk_done(ctl)


def drop_symmetric_biases(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray,
                          bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed, scales, biases), with biases empty ([N, 0], same dtype) when they are symmetric."""
    if is_symmetric(scales, biases, bits):
        biases = np.empty((biases.shape[0], 0), biases.dtype)
    return packed, scales, biases


@njit(nogil=True, cache=True, inline="always")
def bias_at(scales, biases, bits, r, g):  # pragma: no cover - jitted
    """The float32 bias of row r, group g: biases[r, g], or -2^(bits-1) x the scale when the
    bias array is empty (symmetric weights)."""
    if biases.shape[1]:
        return as_f32(biases[r, g])
    return np.float32(-(1 << (bits - 1))) * as_f32(scales[r, g])
