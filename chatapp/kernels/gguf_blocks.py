"""GGUF's block quants rewritten as MLX's affine layout, one block at a time (numba).

A GGUF Q4_0/Q4_1/Q8_0 tensor is a run of 32-element blocks: a float16 scale (Q4_1: then a
float16 minimum) and the quants. Q4 blocks hold elements j and j + 16 in the low and high nibble
of byte j; MLX's 4-bit words hold elements 2j and 2j + 1 in byte j. Q8_0 quants are int8; MLX's
are uint8 with the bias -128 * scale. These kernels write the quants and the float16 bits of the
scales (and Q4_1's minima) straight into the arrays the model keeps, row by row, each source row
to the row ``dst_rows`` names (llama.cpp's q/k row order undone on the way), so a tensor is
converted in one pass from a read buffer, without the file mapped whole or a second copy of the
weights. What they write is bit for bit what ``mx.load`` makes of the same file (tests/test_gguf.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .pool import chunk_done, chunks, claim, pool

Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES = 18, 20, 34  # bytes per block of 32


@njit(nogil=True, cache=True, inline="always")
def times_minus_pow2(h, k):  # pragma: no cover - jitted
    """The float16 bits of -2**k times the float16 ``h`` (bits), rounded as float32 -> float16
    rounds it (MLX computes Q4_0's biases as -8 x scale, Q8_0's as -128 x scale): exact for every
    finite result, an infinity past float16's range. Integer arithmetic: numba has no float16."""
    sign = (h & 0x8000) ^ 0x8000
    e = (h >> 10) & 31
    m = h & 1023
    if e == 31:  # infinities change sign; a NaN stays itself, quietened, as x86's multiply leaves it
        return h ^ 0x8000 if m == 0 else h | 0x200
    if e == 0:  # zero or subnormal: m x 2**-24, times 2**k, exact as a subnormal or a normal half
        v = m << k
        if v < 1024:
            return sign | v
        shift = 0
        while (v >> shift) >= 2048:
            shift += 1
        return sign | ((shift + 1) << 10) | ((v >> shift) & 1023)
    if e + k > 30:
        return sign | 0x7C00
    return sign | ((e + k) << 10) | m


@njit(nogil=True, cache=True, inline="always")
def _pack_pairs(x):  # pragma: no cover - jitted
    """Eight 4-bit values, one in the low nibble of each byte of ``x`` (uint64), as the uint32
    that holds them two to a byte in order (byte j: values 2j, 2j + 1)."""
    x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return (x | (x >> np.uint64(16))) & np.uint64(0xFFFFFFFF)


@njit(nogil=True, cache=True)
def _q4_blocks(ctl, chunk, src16, block_bytes, dst_rows, w, scales, biases):  # pragma: no cover - jitted
    """q4_blocks on the pool's threads, ``chunk`` rows a claim."""
    per_block = block_bytes // 2
    quants = per_block - 8
    nib = np.uint64(0x0F0F0F0F0F0F0F0F)
    n = dst_rows.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            _q4_row(src16, i, dst_rows[i], per_block, quants, nib, w, scales, biases)
        chunk_done(ctl)


@njit(nogil=True, cache=True, inline="always")
def _q4_row(src16, i, r, per_block, quants, nib, w, scales, biases):  # pragma: no cover - jitted
    """Source row i into row r. A block's 16 quant bytes are read as two uint64: their low
    nibbles are the block's elements 0-7 and 8-15, their high nibbles 16-23 and 24-31."""
    blocks = scales.shape[1]
    for b in range(blocks):
        o = (i * blocks + b) * per_block
        h = np.int64(src16[o])
        scales[r, b] = h
        biases[r, b] = src16[o + 1] if quants == 2 else times_minus_pow2(h, 3)
        q = o + quants
        x0 = (np.uint64(src16[q]) | (np.uint64(src16[q + 1]) << np.uint64(16))
              | (np.uint64(src16[q + 2]) << np.uint64(32)) | (np.uint64(src16[q + 3]) << np.uint64(48)))
        x1 = (np.uint64(src16[q + 4]) | (np.uint64(src16[q + 5]) << np.uint64(16))
              | (np.uint64(src16[q + 6]) << np.uint64(32)) | (np.uint64(src16[q + 7]) << np.uint64(48)))
        d = b * 4
        w[r, d] = _pack_pairs(x0 & nib)
        w[r, d + 1] = _pack_pairs(x1 & nib)
        w[r, d + 2] = _pack_pairs((x0 >> np.uint64(4)) & nib)
        w[r, d + 3] = _pack_pairs((x1 >> np.uint64(4)) & nib)


@njit(nogil=True, cache=True)
def _q8_blocks(ctl, chunk, src, dst_rows, w, scales, biases):  # pragma: no cover - jitted
    """q8_blocks on the pool's threads, ``chunk`` rows a claim."""
    blocks = scales.shape[1]
    n = dst_rows.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            _q8_row(src, i, dst_rows[i], blocks, w, scales, biases)
        chunk_done(ctl)


@njit(nogil=True, cache=True, inline="always")
def _q8_row(src, i, r, blocks, w, scales, biases):  # pragma: no cover - jitted
    """Source row i into row r."""
    for b in range(blocks):
        o = (i * blocks + b) * Q8_0_BYTES
        h = np.int64(src[o]) | (np.int64(src[o + 1]) << 8)
        scales[r, b] = h
        biases[r, b] = times_minus_pow2(h, 7)
        d = b * 32
        for j in range(32):
            w[r, d + j] = src[o + 2 + j] ^ np.uint8(128)


ROWS_PER_CHUNK = 64  # rows a thread claims at a time


def q4_blocks(src16, block_bytes, dst_rows, w, scales, biases) -> None:
    """Rows of Q4_0 (``block_bytes`` 18) or Q4_1 (20) blocks in ``src16`` (the rows' bytes as
    uint16) into ``w`` (uint32 [rows, blocks * 4]), ``scales`` and ``biases`` (uint16 [rows,
    blocks]: float16 bits; Q4_1's minima, Q4_0's -8 x scale); source row i goes to row
    ``dst_rows[i]``. On the kernel threads."""
    pool().run(_q4_blocks, chunks(dst_rows.shape[0], ROWS_PER_CHUNK), ROWS_PER_CHUNK, src16, block_bytes,
               dst_rows, w, scales, biases)


def q8_blocks(src, dst_rows, w, scales, biases) -> None:
    """Rows of Q8_0 blocks in ``src`` (uint8) into ``w`` (uint8 [rows, blocks * 32], the int8
    quants + 128), ``scales`` and ``biases`` (uint16 [rows, blocks]: float16 bits, the biases
    -128 x scale); source row i goes to row ``dst_rows[i]``. On the kernel threads."""
    pool().run(_q8_blocks, chunks(dst_rows.shape[0], ROWS_PER_CHUNK), ROWS_PER_CHUNK, src, dst_rows, w, scales,
               biases)
