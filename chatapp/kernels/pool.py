"""Running a kernel on several cores without waiting on a core that is busy elsewhere.

numba's ``prange`` (OpenMP or its workqueue) splits a loop evenly between threads and joins
them at a barrier. When another process holds one of the cores, the share of the thread that
is not running waits for the scheduler's next slice: on this 2-core machine a 0.8 ms 4-bit
product then took 8-16 ms, dozens of times per decoded token.

Here the work is cut into chunks that threads claim one at a time from a shared counter
(an atomic add). The calling thread claims chunks too, and returns once every claimed chunk is
done, so a helper thread that never got a core simply claims nothing. Measured, 4096x4096 4-bit
product, ms (median / 90th percentile over 300 calls):

                          idle          one core busy
    numba prange (OMP)    0.91 / 0.97   0.80 / 4.8  (max 10)
    this pool             0.81 / 0.85   1.50 / 1.6  (max 4.4)
    one thread            1.46 / 1.52   1.49 / 1.6

A kernel for the pool is a nogil numba function whose first two arguments are the control
array (``ctl``: [next chunk, chunks done]) and the chunk size, and which loops:

    while True:
        c = claim(ctl, n_chunks)
        if c < 0: break
        ... work on chunk c ...
        chunk_done(ctl)
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from typing import Callable

import numpy as np
from numba import njit

from .llvm import atomic_add


@njit(nogil=True, cache=True, inline="always")
def claim(ctl, n_chunks):  # pragma: no cover - jitted
    """The index of the next unclaimed chunk, or -1 when none is left."""
    c = atomic_add(ctl, 0, 1)
    return c if c < n_chunks else -1


@njit(nogil=True, cache=True, inline="always")
def chunk_done(ctl):  # pragma: no cover - jitted
    atomic_add(ctl, 1, 1)


@njit(nogil=True, cache=True)
def _spin_until_done(ctl, n_chunks, spins):  # pragma: no cover - jitted
    """Spin until every chunk is done or ``spins`` checks have passed; True when done."""
    for _ in range(spins):
        if atomic_add(ctl, 1, 0) >= n_chunks:
            return True
    return atomic_add(ctl, 1, 0) >= n_chunks


# ~20-50 us of checks: a helper's last chunk normally ends within that. Past it the helper is most
# likely descheduled mid-chunk, and spinning would keep this core busy; sleeping frees it, so the
# scheduler can move the helper here instead of making it wait for its own core.
_SPINS = 20_000
_NAP_S = 50e-6


def _wait_done(ctl: np.ndarray, n_chunks: int) -> None:
    while not _spin_until_done(ctl, n_chunks, _SPINS):
        time.sleep(_NAP_S)


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class WorkPool:
    """The calling thread plus ``threads - 1`` helper threads sharing chunked kernels."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._queues: list[queue.SimpleQueue] = []
        for i in range(self.threads - 1):
            q: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(q,), name=f"chatapp-kernel-{i + 1}", daemon=True).start()
            self._queues.append(q)

    @staticmethod
    def _serve(q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            kernel, args = job
            kernel(*args)

    def map(self, fn: Callable[[int, int], None], n_items: int) -> None:
        """Call ``fn(item, worker)`` for every item in range(n_items), items claimed one at a time
        by the calling thread (worker 0) and the helpers (1 ..), for work that is a sequence of
        calls which release the GIL (numpy's BLAS, nogil kernels). Returns when all are done."""
        if n_items <= 0:
            return
        claim = itertools.count()  # next() is atomic under the GIL
        lock = threading.Lock()
        finished = threading.Event()
        state = {"done": 0, "error": None}

        def work(worker: int) -> None:
            while (item := next(claim)) < n_items:
                try:
                    fn(item, worker)
                except BaseException as e:  # re-raised in the calling thread
                    state["error"] = e
                with lock:
                    state["done"] += 1
                    if state["done"] == n_items:
                        finished.set()

        if n_items > 1:
            for i, q in enumerate(self._queues):
                q.put((work, (i + 1,)))
        work(0)
        finished.wait()
        if state["error"] is not None:
            raise state["error"]

    def run(self, kernel: Callable, n_chunks: int, chunk: int, *args) -> None:
        """Run ``kernel(ctl, chunk, *args)`` over ``n_chunks`` chunks on every thread."""
        if n_chunks <= 0:
            return
        ctl = np.zeros(2, np.int64)
        call = (ctl, chunk, *args)
        if n_chunks > 1:
            for q in self._queues:
                q.put((kernel, call))
        kernel(*call)
        _wait_done(ctl, n_chunks)

    def broadcast(self, kernel: Callable, *args) -> None:
        """Run ``kernel(*args)`` on every thread, the calling one included, for a kernel that
        shares its work out and waits for it itself (``decode_step``: claim counters and
        barriers of its own in ``args``). Returns when the calling thread's call returns."""
        for q in self._queues:
            q.put((kernel, args))
        kernel(*args)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        self._queues = []


_pool: WorkPool | None = None
_pool_lock = threading.Lock()


def pool() -> WorkPool:
    """The process-wide pool (one thread per usable core unless ``set_threads`` said otherwise)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = WorkPool(usable_cores())
        return _pool


def set_threads(threads: int | None) -> WorkPool:
    """Use ``threads`` threads (None or 0: one per usable core) for the kernels from now on."""
    global _pool
    want = int(threads) if threads else usable_cores()
    with _pool_lock:
        if _pool is not None and _pool.threads == want:
            return _pool
        if _pool is not None:
            _pool.close()
        _pool = WorkPool(want)
        return _pool


def chunks(n: int, chunk: int) -> int:
    return (n + chunk - 1) // chunk
