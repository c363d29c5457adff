"""Maintenance done in place outside MLX: what a cache may hand its flushes and evictions to.

Through MLX, quantising a chunk out of the recent window, dropping evicted rows and turning the
kept keys back each rewrite whole buffers (a slice update whose source is the same buffer copies
it), between two decode steps: a stall in the stream. A native decode step that already writes
its rows into the buffers' memory (backend/fused_decode.py) installs an implementation of this
protocol on each cache (``SegmentedKVCache.native``, backend/kv_native.py), which does the same
work on those host views in place. Each method does its work and returns True, or does nothing
and returns False where it may not (no host views, rows a snapshot may still hold, a layout or
dtype it does not take): the cache then goes through MLX as before.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .buffers import FullBuffer


class RowOps(Protocol):
    def flush(self, full: FullBuffer, quant, start: int, n: int, delta: int) -> bool:
        """Quantise full-precision rows [start, start + n) (keys moved ``delta`` positions on
        first) onto the end of ``quant``, and remove them from ``full``."""

    def remove(self, full: FullBuffer, start: int, n: int) -> bool:
        """Remove rows [start, start + n) of ``full``, moving the rows after them back."""

    def rotate(self, full: FullBuffer, start: int, delta: int) -> bool:
        """Move the keys of rows [start, length) of ``full`` by ``delta`` positions."""

    def remove_front(self, quant, n: int) -> bool:
        """Remove the first ``n`` rows of ``quant``, moving the rows after them back."""

    def votes(self, full: FullBuffer, quant, sinks: int, queries: np.ndarray, scale: float) -> np.ndarray | None:
        """The scored caches' votes: attention mass per KV head and held token ([kv_heads, held])
        of ``queries`` [heads, L, D], the last L held tokens' (sparsity.attention_mass); None
        where it cannot read the keys."""

    def turn_rows(self, x: np.ndarray, delta: int) -> bool:
        """The scored caches' kept queries: move float32 host rows ``x`` [..., D] by ``delta``
        positions in place (as ``rotate`` moves keys)."""

    def select(self, quant, keep: np.ndarray, deltas: np.ndarray, first: int) -> bool:
        """The scored caches' eviction from the quantised middle: keep rows ``keep`` (ascending),
        keys from row ``first`` on moved by their own ``deltas`` positions and quantised again."""

    def select_full(self, full: FullBuffer, keep: np.ndarray, deltas: np.ndarray, start: int) -> bool:
        """The scored cache's eviction with no quantised middle: keep rows ``keep`` of ``full``
        (ascending; all rows before ``start``), keys moved by their own ``deltas`` positions."""
