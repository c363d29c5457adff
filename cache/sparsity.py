"""Attention sparsity of the window modes: the share of the last queries' attention mass on the
tokens the policy could evict next.

The scored modes have their own (scored.py: the votes of their last queries over the middle).
For ``window`` and ``window-quant`` no scores exist, so the cache keeps references to the
queries of its last ``OBSERVE`` decode steps (``record``: the arrays the step computed anyway, no
copy and no extra work per step), and this module runs one attention pass of those queries over
what the cache holds when the share is asked for (once per turn, for the status bar and
--stats-json): O(queries x held) per layer, next to the turn's O(tokens x held).

What the policy could evict: for ``window-quant`` the middle (neither sinks nor the recent
window), as for the scored modes; for ``window``, which keeps sinks + window and drops the
oldest non-sink tokens first, the ``evict_chunk`` oldest non-sink tokens (the next eviction's).
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

OBSERVE = 16  # decode steps whose queries are kept (as the scored modes' observation window)


def observer() -> deque:
    return deque(maxlen=OBSERVE)


def record(seen: deque, queries: mx.array, scale: float, index: int, evicted: int) -> None:
    """Keep a decode step's queries, the held index of its token and the evictions so far."""
    seen.append((queries, scale, index, evicted))


def evictable(cache) -> tuple[int, int]:
    """[start, end) of the held tokens the window policies could evict (see the docstring)."""
    held = cache.offset
    s = min(cache.sinks, held)
    if cache.quant is None:
        return s, min(held, s + cache.chunk)
    return s, max(s, held - (cache.window or 0))


def evictable_share(cache, seen: deque) -> float | None:
    """Share of the kept queries' attention mass (all heads, softmax over what they could see)
    that falls on ``evictable(cache)``; None before a decode step or with nothing evictable."""
    held = cache.offset
    start, end = evictable(cache)
    if not seen or end <= start:
        return None
    keys, _ = cache.content()
    total = inside = 0.0
    for q, scale, index, evicted in seen:
        moved = cache.evicted - evicted  # tokens evicted since: the query's token moved back as much
        i = index - moved
        if not 0 <= i < held:
            continue
        if moved and cache.repos is not None:
            q = cache.repos.shift(q, -moved)
        B, n_q, _, D = q.shape
        n_kv = keys.shape[1]
        g = (q.astype(mx.float32) * scale).reshape(B, n_kv, n_q // n_kv, 1, D)
        s = g @ mx.expand_dims(keys[:, :, : i + 1].astype(mx.float32), 2).swapaxes(-1, -2)
        p = mx.softmax(s, axis=-1, precise=True).sum(axis=(0, 1, 2, 3))
        total += p.sum().item()
        inside += p[start : min(end, i + 1)].sum().item()
    return inside / total if total > 0 else None
