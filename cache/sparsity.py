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


def attention_mass(queries: mx.array, keys: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    """The attention mass each key receives per KV head ([kv_heads, N]) from ``queries``: by
    default the last positions of the ``N`` keys (causal), else ``mask`` ([L, N], True where a
    query sees a key). Scores only, no values. The keys are transposed into a contiguous copy
    first: MLX's CPU matmul against a transposed view is ~4x slower (66 against 14 ms for 16
    queries over 1,495 SmolLM2 keys per layer, measured on the loaded machine)."""
    B, n_q, L, D = queries.shape
    n_kv, N = keys.shape[1], keys.shape[2]
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    kt = mx.contiguous(keys.astype(mx.float32).swapaxes(-1, -2))
    s = q @ mx.expand_dims(kt, 2)
    if mask is None:
        mask = mx.arange(N - L, N)[:, None] >= mx.arange(N)[None]
    s = mx.where(mask, s, mx.finfo(s.dtype).min)
    return mx.softmax(s, axis=-1, precise=True).sum(axis=(0, 2, 3))


def evictable_share(cache, seen: deque) -> float | None:
    """Share of the kept queries' attention mass (all heads, softmax over what each could see)
    that falls on ``evictable(cache)``; None before a decode step or with nothing evictable."""
    held = cache.offset
    start, end = evictable(cache)
    if not seen or end <= start:
        return None
    queries, ends, scale = [], [], 1.0
    for q, scale, index, evicted in seen:
        if not isinstance(q, mx.array):  # host floats [heads, D] a native decode step kept
            q = mx.array(q).reshape(1, q.shape[0], 1, q.shape[1])
        moved = cache.evicted - evicted  # tokens evicted since: the query's token moved back as much
        i = index - moved
        if not 0 <= i < held:
            continue
        queries.append(cache.repos.shift(q, -moved) if moved and cache.repos is not None else q)
        ends.append(i + 1)
    if not queries:
        return None
    with cache.borrowed():  # every view taken here is evaluated and dropped inside the block
        keys, _ = cache.content()
        mask = mx.arange(held)[None] < mx.array(ends)[:, None]
        mass = attention_mass(mx.concatenate(queries, axis=2), keys, scale, mask).sum(axis=0)
        total, part = mass.sum().item(), mass[start:end].sum().item()
        del keys, mass
    return part / total if total > 0 else None
