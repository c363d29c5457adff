"""MLX's memory gauges and limits, as plain numbers for the statistics and the UI.

Gauges (read on the engine thread, handed on as :class:`MemoryGauges`):

* ``active``: bytes in arrays MLX holds now (``mx.get_active_memory``);
* ``cache``: bytes of freed buffers MLX keeps for reuse instead of returning them to the system
  (``mx.get_cache_memory``); a cache that allocates a new, larger buffer every token (``concat``)
  makes it churn;
* ``peak``: the highest ``active`` since the peak was last reset (the session resets it when a
  turn starts, so it is the turn's peak);
* ``total``: the device's memory, the budget every share is taken of (:func:`memory_total`).

Limits (``[memory]`` in config, applied once before the model loads by :func:`apply_limits`):
``mx.set_memory_limit`` and ``mx.set_cache_limit``. What they do depends on the backend; on the
CPU backend (mlx 0.32, ``backend/no_gpu/allocator.cpp``, and checked here) the memory limit never
refuses an allocation: MLX only stops scheduling more work while active memory is over it and
tasks are running, so it throttles rather than caps. The cache limit works on every backend
(default 32 MiB on the CPU): freed buffers beyond it go back to the system.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import mlx.core as mx

from .stats import MemoryGauges

MiB = 1 << 20


def memory_total() -> int:
    """Bytes of memory the device can use: MLX's figure on GPUs, physical RAM on the CPU backend."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    size = int(info.get("memory_size", 0) or 0)
    if not size:
        try:
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            size = 0
    return size


@functools.cache
def _device_total() -> int:
    return memory_total()  # fixed for the process: read once, not at every gauge reading


def read_gauges(kv_held: int = 0, tokens: int = 0) -> MemoryGauges:
    """Read the allocator's gauges now (three counter reads: cheap enough for every few tokens)."""
    return MemoryGauges(
        active=int(mx.get_active_memory()),
        cache=int(mx.get_cache_memory()),
        peak=int(mx.get_peak_memory()),
        total=_device_total(),
        kv_held=kv_held,
        tokens=tokens,
    )


# ---- limits ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryLimits:
    """``[memory]`` in config: 0 / -1 keep MLX's own default (see config.toml)."""

    limit_mb: int = 0  # 0: MLX's default memory limit
    cache_limit_mb: int = -1  # -1: MLX's default; 0: no buffer cache


def apply_limits(limits: MemoryLimits, backend: str) -> list[str]:
    """Set MLX's memory and cache limits; returns one note per limit set, saying what it does here."""
    notes = []
    if limits.limit_mb > 0:
        mx.set_memory_limit(limits.limit_mb * MiB)
        if backend == "cpu":
            notes.append(f"memory.limit_mb = {limits.limit_mb}: on the CPU backend MLX does not refuse allocations "
                         "past it, it only waits for running work before scheduling more (a throttle, not a cap)")
        else:
            notes.append(f"memory.limit_mb = {limits.limit_mb}: MLX's memory limit set")
    if limits.cache_limit_mb >= 0:
        mx.set_cache_limit(limits.cache_limit_mb * MiB)
        what = "no buffer cache: freed buffers go back to the system at once" if limits.cache_limit_mb == 0 else \
            "freed buffers beyond it go back to the system"
        notes.append(f"memory.cache_limit_mb = {limits.cache_limit_mb}: {what}")
    return notes


__all__ = ["MemoryGauges", "MemoryLimits", "apply_limits", "memory_total", "read_gauges"]
