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
    return bool(_all_symmetric(scales, biases, np.float32(symmetric_offset(bits))))


@njit(nogil=True, cache=True)
def _all_symmetric(scales, biases, offset):  # pragma: no cover - jitted
    """One pass, stopping at the first bias that is not offset x its scale. Compared in float32,
    where the product of a float16 or float32 scale by a power of two is exact: a bias that had
    to round (overflow, the last bits of a subnormal) is not equal. 8 of a 7B model's layers:
    0.11 s (numpy, converting and comparing whole arrays: 0.38 s)."""
    for r in range(scales.shape[0]):
        for g in range(scales.shape[1]):
            if as_f32(biases[r, g]) != offset * as_f32(scales[r, g]):
                return False
    return True


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
