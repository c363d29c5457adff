"""How fast this machine reads memory with the kernels' threads: the ceiling for decode.

A decoded token reads every weight once, so tokens/s can never exceed bandwidth / weight bytes.
``read_bandwidth`` streams a buffer larger than the caches through the same pool the kernels
use (summing 64-byte lines, 16 float32 lanes at a time) and reports the best of a few passes.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from .pool import chunk_done, chunks, claim, pool


@njit(fastmath=True, nogil=True, cache=True)
def _sum(part):  # pragma: no cover - jitted
    acc = np.float32(0.0)
    for i in range(part.shape[0]):
        acc += part[i]
    return acc


@njit(fastmath=True, nogil=True, cache=True)
def _sum_chunks(ctl, chunk, data, partial):  # pragma: no cover - jitted
    n = data.shape[0]
    n_chunks = (n + chunk - 1) // chunk
    while True:
        c = claim(ctl, n_chunks)
        if c < 0:
            break
        partial[c] = _sum(data[c * chunk : min(n, (c + 1) * chunk)])
        chunk_done(ctl)


def read_bandwidth(gib: float = 1.0, passes: int = 5) -> float:
    """Bytes per second read by the kernel pool over a ``gib`` GiB buffer (best of ``passes``)."""
    data = np.ones(int(gib * 2**30) // 4, np.float32)
    chunk = 1 << 20
    partial = np.zeros(chunks(data.shape[0], chunk), np.float32)
    best = float("inf")
    for _ in range(passes + 1):  # the first pass compiles (or loads) the kernel
        t = time.perf_counter()
        pool().run(_sum_chunks, partial.shape[0], chunk, data, partial)
        best = min(best, time.perf_counter() - t)
    return data.nbytes / best
