"""Products with MLX's packed 4-bit and 8-bit weights, computed on the packed bytes.

MLX's affine quantisation stores a weight W[N, K] as ``packed`` (uint32 [N, K * bits / 32]),
``scales`` and ``biases`` ([N, K / group_size]), with W[r, k] = scales[r, g] * q[r, k] +
biases[r, g] for g = k // group_size. Element k of a row sits in the little-endian bytes of
the packed words: with 4 bits, byte j holds element 2j in its low nibble and 2j+1 in its high
nibble; with 8 bits, byte j is element j.

Rather than re-laying the weights at load (time, and a second copy of them), the activations
are split once per call into their even and odd elements (``split_even_odd``), so the 4-bit
inner loop reads weight bytes and both activation halves contiguously. Each row is

    y[r] = sum_g scales[r, g] * (q_g . x_g) + sum_g biases[r, g] * sum(x_g)

with the per-group sums of x precomputed (``group_sums``). The row products are written with
explicit 16-lane vectors (simd.py): blocks of 32 weight bytes whatever the group size (32, 64
or 128), partial products accumulated per lane and scaled per group, one reduction per row.

Several tokens (``matmul`` with T <= the caller's threshold) loop over the tokens per row: the
row's bytes stay in L1, so the weights are read from memory once, but the unpacking is
repeated per token. Past a few tokens, ``matmul_dequantized`` is faster: it dequantises blocks
of rows into a reused float32 scratch and hands each block to numpy's BLAS (one sgemm per
block), so a prompt costs one pass over the weights plus BLAS-speed arithmetic.

Requirements (``unsupported`` says why not): K a multiple of 64, group size 32, 64 or 128,
bits 4 or 8, scales/biases float32 or float16 (float16 read as uint16 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from .llvm import as_f32, byte_to_f32, hi_nibble, lo_nibble
from .pool import chunk_done, chunks, claim, pool
from .rows4 import ROWS, q4_rows4_dot, q8_rows4_dot
from .simd import q4_row_dot, q8_row_dot

GROUP_SIZES = (32, 64, 128)
BITS = (4, 8)
K_MULTIPLE = 64  # a 32-byte block of 4-bit weights holds 64 elements
SCRATCH_BYTES = 4 * 1024 * 1024  # a dequantised block of rows: stays in the L2/L3 caches


def unsupported(bits: int, group_size: int, in_features: int, mode: str = "affine") -> str | None:
    """None when the kernels handle such a weight, else why not (one phrase)."""
    if mode != "affine":
        return f"quantisation mode {mode!r} (kernels: affine)"
    if bits not in BITS:
        return f"{bits}-bit weights (kernels: 4 and 8 bits)"
    if group_size not in GROUP_SIZES:
        return f"group size {group_size} (kernels: 32, 64, 128)"
    if in_features % K_MULTIPLE:
        return f"input width {in_features} is not a multiple of {K_MULTIPLE}"
    return None


@dataclass
class PackedWeight:
    """numpy views (no copies) of one quantised weight's arrays."""

    packed: np.ndarray  # uint8 [N, K * bits / 8]
    scales: np.ndarray  # float32, or uint16 holding float16 bits, [N, K / group_size]
    biases: np.ndarray  # like scales
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 8 // self.bits

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes


def split_even_odd(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x[T, K] -> (x[:, 0::2], x[:, 1::2]), both contiguous: the halves the 4-bit kernels read."""
    return np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2])


def group_sums(x: np.ndarray, group_size: int) -> np.ndarray:
    """Sum of each group of x[T, K]: [T, K / group_size] (the biases' share of the product)."""
    T, K = x.shape
    return x.reshape(T, K // group_size, group_size).sum(axis=2, dtype=np.float32)


def _row_chunk(n_rows: int) -> int:
    # ~64 chunks: small enough that an idle thread finds work, large enough that claiming
    # one (an atomic add) costs nothing next to it
    return max(16, -(-n_rows // 64))


def matmul(w: PackedWeight, x: np.ndarray) -> np.ndarray:
    """x[T, K] (float32) times W^T -> [T, N], reading the packed weights once."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.out_features), np.float32)
    xsum = group_sums(x, w.group_size)
    chunk = _row_chunk(w.out_features)
    n = chunks(w.out_features, chunk)
    xa, xb = split_even_odd(x) if w.bits == 4 else (x, x)
    pool().run(_matmul, n, chunk, w.packed, w.scales, w.biases, xa, xb, xsum, out, w.group_size, w.bits)
    return out


class Scratch:
    """Float32 buffers reused for dequantised blocks, one per pool thread."""

    def __init__(self) -> None:
        self._bufs: dict[int, np.ndarray] = {}

    def rows(self, worker: int, n_rows: int, width: int) -> np.ndarray:
        buf = self._bufs.get(worker)
        if buf is None or buf.size < n_rows * width:
            buf = self._bufs[worker] = np.empty(n_rows * width, np.float32)
        return buf[: n_rows * width].reshape(n_rows, width)


def matmul_dequantized(w: PackedWeight, x: np.ndarray, scratch: Scratch) -> np.ndarray:
    """x[T, K] times W^T -> [T, N] by blocks of rows: dequantise a block into ``scratch``, then one
    single-threaded sgemm (numpy's BLAS) for it. Each pool thread takes whole blocks, so the two
    steps never wait for each other across threads and no BLAS thread pool spins beside ours.
    4-bit blocks come out de-interleaved (even elements, then odd), so x is permuted the same
    way once instead of the weights each time. The caller keeps numpy's BLAS single-threaded
    (`chatapp.backend.numpy_blas`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    K, N = w.in_features, w.out_features
    xp = np.concatenate(split_even_odd(x), axis=1) if w.bits == 4 else x  # [T, K], like the blocks
    out = np.empty((x.shape[0], N), np.float32)
    # at least one block per thread: a small weight (SmolLM2's 1536x576) fits one scratch block,
    # which left the other core idle for the whole gemm (1.14 -> 0.79 ms for 30 tokens)
    block = max(16, min(N, SCRATCH_BYTES // (4 * K), -(-N // pool().threads)))
    kernel = _q4_dequantize if w.bits == 4 else _q8_dequantize

    def one_block(b: int, worker: int) -> None:
        r0 = b * block
        rows = min(block, N - r0)
        buf = scratch.rows(worker, rows, K)
        kernel(np.zeros(2, np.int64), rows, w.packed, w.scales, w.biases, r0, buf, w.group_size)
        # out's column block is a valid BLAS matrix (leading dimension N): written in place
        np.matmul(xp, buf.T, out=out[:, r0 : r0 + rows])

    pool().map(one_block, chunks(N, block))
    return out


def dequantize(w: PackedWeight) -> np.ndarray:
    """The whole weight as float32 [N, K] in natural element order (tests, small weights)."""
    out = np.empty((w.out_features, w.in_features), np.float32)
    kernel = _q4_dequantize if w.bits == 4 else _q8_dequantize
    chunk = _row_chunk(w.out_features)
    pool().run(kernel, chunks(w.out_features, chunk), chunk, w.packed, w.scales, w.biases, 0, out, w.group_size)
    if w.bits == 4:  # de-interleaved: [evens | odds] -> natural order
        half = w.in_features // 2
        out = np.stack([out[:, :half], out[:, half:]], axis=2).reshape(w.out_features, w.in_features)
    return out


# --- kernels (chunked for pool.run: ctl, chunk, then the arguments) ---------------------------


@njit(fastmath=True, nogil=True, cache=True, inline="always")
def _bias_term(biases, xsum, r, t):  # pragma: no cover - jitted
    acc = np.float32(0.0)
    for g in range(biases.shape[1]):
        acc += as_f32(biases[r, g]) * xsum[t, g]
    return acc


# Rows are read whole, one after the other, so a chunk is one sequential stream from memory: rows
# cut into L1-sized segments (to keep the activations in L1) read 2 KiB pieces 5.5 KiB apart at
# K = 11008 instead, which the prefetchers follow worse (5.5 against 4.4 ms for 4096x11008).
@njit(fastmath=True, nogil=True, cache=True)
def _matmul(ctl, chunk, wb, scales, biases, xa, xb, xsum, out, group_size, bits):  # pragma: no cover - jitted
    """out[t, r] = W[r] . x[t]: 4 bits with xa/xb the even/odd activations, 8 bits with xa = x."""
    N = wb.shape[0]
    n_chunks = (N + chunk - 1) // chunk
    tmp = np.empty(ROWS, np.float32)
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        r = c * chunk
        end = min(N, (c + 1) * chunk)
        if xa.shape[0] == 1:
            # one token (the decode's output head): four rows per call share the activation loads
            # and prefetch ahead (rows4.py); the same sums as the row kernels', bit for bit
            while r + ROWS <= end:
                if bits == 4:
                    q4_rows4_dot(wb, r, xa[0], xb[0], scales, group_size, tmp)
                else:
                    q8_rows4_dot(wb, r, xa[0], scales, group_size, tmp)
                for i in range(ROWS):
                    out[0, r + i] = tmp[i] + _bias_term(biases, xsum, r + i, 0)
                r += ROWS
        for r in range(r, end):
            for t in range(xa.shape[0]):
                if bits == 4:
                    dot = q4_row_dot(wb[r], xa[t], xb[t], scales[r], group_size)
                else:
                    dot = q8_row_dot(wb[r], xa[t], scales[r], group_size)
                out[t, r] = dot + _bias_term(biases, xsum, r, t)
        chunk_done(ctl)


@njit(fastmath=True, nogil=True, cache=True)
def _q4_dequantize(ctl, chunk, wb, scales, biases, r0, out, group_size):  # pragma: no cover - jitted
    """out[i] = row r0 + i of a 4-bit W as float32, de-interleaved: even elements, then odd."""
    R = out.shape[0]
    K2 = wb.shape[1]
    half = group_size // 2
    n_chunks = (R + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for i in range(c * chunk, min(R, (c + 1) * chunk)):
            r = r0 + i
            # two views of the row: with one array and two offsets LLVM cannot prove the stores
            # independent and leaves the loop scalar (4 -> ~30 G weights/s with the views)
            lo = out[i, :K2]
            hi = out[i, K2:]
            for g in range(scales.shape[1]):
                s = as_f32(scales[r, g])
                m = as_f32(biases[r, g])
                base = g * half
                for j in range(half):
                    b = wb[r, base + j]
                    lo[base + j] = lo_nibble(b) * s + m
                    hi[base + j] = hi_nibble(b) * s + m
        chunk_done(ctl)


@njit(fastmath=True, nogil=True, cache=True)
def _q8_dequantize(ctl, chunk, wb, scales, biases, r0, out, group_size):  # pragma: no cover - jitted
    """out[i] = row r0 + i of an 8-bit W as float32, in natural order."""
    R = out.shape[0]
    n_chunks = (R + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        for i in range(c * chunk, min(R, (c + 1) * chunk)):
            r = r0 + i
            for g in range(scales.shape[1]):
                s = as_f32(scales[r, g])
                m = as_f32(biases[r, g])
                base = g * group_size
                for j in range(group_size):
                    out[i, base + j] = byte_to_f32(wb[r, base + j]) * s + m
        chunk_done(ctl)
