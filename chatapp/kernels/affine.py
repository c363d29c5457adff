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
    if biases.shape != scales.shape or biases.size == 0:
        return False
    def f32(a: np.ndarray) -> np.ndarray:
        return a.view(np.float16) if a.dtype == np.uint16 else a
    # compared in the arrays' own dtype: -8 * s is exact there unless it overflows, and then
    # the stored bias (rounded to inf or clipped) is not equal and the array stays
    s, b = f32(scales), f32(biases)
    return bool(np.array_equal(b, (s * s.dtype.type(symmetric_offset(bits))).astype(s.dtype)))


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
