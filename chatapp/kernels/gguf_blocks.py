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
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .llvm import I8
from .pool import chunk_done, chunks, claim, pool
from .simd import is_c_array, vload

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


_V16B = ir.VectorType(I8, 16)
_I32 = ir.IntType(32)


@intrinsic
def q4_quants_to_mlx(typingctx, src, s_off, dst, d_off):
    """The 16 quant bytes of a GGUF Q4 block at byte ``s_off`` of ``src`` (uint8), written at byte
    ``d_off`` of ``dst`` (uint8) as MLX holds them: GGUF's byte j holds elements j and j + 16 (low,
    high nibble), MLX's byte j elements 2j and 2j + 1. One 16-byte load, the nibbles split into
    the block's 32 elements in order, re-paired by two shuffles: ~6 vector instructions a block
    where the uint64 bit-twiddling before took ~60 scalar ones (one thread: 1.45 -> 3.2 GB/s of
    blocks, near what the copy itself moves)."""
    if not (is_c_array(src, (types.uint8,), 1) and is_c_array(dst, (types.uint8,), 1)):
        return None

    def codegen(context, builder, signature, args):
        sp = context.make_array(signature.args[0])(context, builder, args[0]).data
        dp = context.make_array(signature.args[2])(context, builder, args[2]).data
        v = vload(builder, sp, args[1], _V16B)
        lo = builder.and_(v, ir.Constant(_V16B, [15] * 16))  # elements 0-15
        hi = builder.lshr(v, ir.Constant(_V16B, [4] * 16))  # elements 16-31
        even = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2))))
        odd = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2))))
        out = builder.or_(even, builder.shl(odd, ir.Constant(_V16B, [4] * 16)))
        builder.store(out, builder.bitcast(builder.gep(dp, [args[3]]), _V16B.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(src, s_off, dst, d_off), codegen


@njit(nogil=True, cache=True)
def _q4_blocks(ctl, chunk, src, block_bytes, dst_rows, w, scales, biases):  # pragma: no cover - jitted
    """q4_blocks on the pool's threads, ``chunk`` rows a claim."""
    src16 = src.view(np.uint16)
    n = dst_rows.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            _q4_row(src, src16, i, dst_rows[i], block_bytes, w, scales, biases)
        chunk_done(ctl)


@njit(nogil=True, cache=True, inline="always")
def _q4_row(src, src16, i, r, block_bytes, w, scales, biases):  # pragma: no cover - jitted
    """Source row i into row r of w (uint8 [rows, blocks * 16]), scales and biases."""
    blocks = scales.shape[1]
    row_bytes = blocks * 16
    for b in range(blocks):
        o = (i * blocks + b) * block_bytes
        h = np.int64(src16[o // 2])
        scales[r, b] = h
        biases[r, b] = src16[o // 2 + 1] if block_bytes == Q4_1_BYTES else times_minus_pow2(h, 3)
        q4_quants_to_mlx(src, o + block_bytes - 16, w, r * row_bytes + b * 16)


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


def q4_blocks(src, block_bytes, dst_rows, w, scales, biases) -> None:
    """Rows of Q4_0 (``block_bytes`` 18) or Q4_1 (20) blocks in ``src`` (the rows' bytes, uint8,
    starting at an even address) into ``w`` (the packed words' bytes, uint8 [rows, blocks * 16]),
    ``scales`` and ``biases`` (uint16 [rows, blocks]: float16 bits; Q4_1's minima, Q4_0's -8 x
    scale); source row i goes to row ``dst_rows[i]``. On the kernel threads."""
    pool().run(_q4_blocks, chunks(dst_rows.shape[0], ROWS_PER_CHUNK), ROWS_PER_CHUNK, src, block_bytes,
               dst_rows, w.reshape(-1), scales, biases)


def q8_blocks(src, dst_rows, w, scales, biases) -> None:
    """Rows of Q8_0 blocks in ``src`` (uint8) into ``w`` (uint8 [rows, blocks * 32], the int8
    quants + 128), ``scales`` and ``biases`` (uint16 [rows, blocks]: float16 bits, the biases
    -128 x scale); source row i goes to row ``dst_rows[i]``. On the kernel threads."""
    pool().run(_q8_blocks, chunks(dst_rows.shape[0], ROWS_PER_CHUNK), ROWS_PER_CHUNK, src, dst_rows, w, scales,
               biases)
