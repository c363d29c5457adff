"""The model's own cache layout, and which of its slots chatapp's policy caches take over.

mlx-lm models that need more than one full-attention ``KVCache`` per layer say so with
``make_cache()``: ``RotatingKVCache`` for sliding-window layers, ``ArraysCache`` for recurrent
state (Mamba, gated delta, short convolutions), ``CacheList`` for layers that hold several,
``ChunkedKVCache`` for chunked attention, fewer slots than layers where layers share K/V, more
where a model loops. chatapp's policies (prealloc, quantized, ...) replace only the plain
``KVCache`` slots; every other slot stays mlx-lm's own object, so its masks, positions and state
are mlx-lm's. The helpers below let the code that walks the caches (accounting, the cache map,
trimming, conversions, snapshots) tell the two apart.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlx_lm.models.cache import KVCache, RotatingKVCache

from .base import is_sliding
from .kv import _CacheBase

# What each of mlx-lm's kinds holds, for the one-line reasons shown to the user.
_KIND_WORDS = {
    "RotatingKVCache": "sliding-window",
    "SlidingKVCache": "sliding-window",
    "ArraysCache": "recurrent-state",
    "MambaCache": "recurrent-state",
    "CacheList": "multi-part",
    "ChunkedKVCache": "chunked-attention",
    "QuantizedKVCache": "quantised",
    "ConcatenateKVCache": "concatenating",
}


def model_layout(model) -> list:
    """The caches mlx-lm itself would give ``model`` (``make_prompt_cache`` without a size cap)."""
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [KVCache() for _ in model.layers]


def takes_policy(slot: Any) -> bool:
    """Whether a slot of the model's own layout is a plain full-attention cache (exactly mlx-lm's
    ``KVCache``, not a subclass), which a chatapp policy cache may stand in for."""
    return type(slot) is KVCache


def is_ours(c: Any) -> bool:
    return isinstance(c, _CacheBase)


def slides(slot: Any) -> bool:
    """A slot of the model's own layout that is a plain sliding window (``RotatingKVCache`` keeping
    no leading tokens): chatapp's ``SlidingKVCache`` (sliding.py) stands in for it."""
    return type(slot) is RotatingKVCache and slot.keep == 0


def is_policy(c: Any) -> bool:
    """A chatapp cache that holds the session's policy (not a sliding-window layer's own cache)."""
    return is_ours(c) and not is_sliding(c)


def foreign(caches: Sequence[Any]) -> list:
    """The slots that stay mlx-lm's own."""
    return [c for c in caches if not is_ours(c)]


def uniform(caches: Sequence[Any]) -> bool:
    """Every slot is a chatapp policy cache (the layout of a plain decoder-only transformer)."""
    return bool(caches) and all(is_policy(c) for c in caches)


def primary(caches: Sequence[Any]) -> Any:
    """The first chatapp policy cache (the one whose policy the session reports), else the first slot."""
    first = next((c for c in caches if is_ours(c)), caches[0] if caches else None)
    return next((c for c in caches if is_policy(c)), first)


def kinds(caches: Sequence[Any]) -> str:
    """The foreign slots in words: ``4 sliding-window (RotatingKVCache), 2 recurrent-state (ArraysCache)``."""
    counts: dict[str, int] = {}
    for c in caches:
        if takes_policy(c) or is_policy(c):
            continue
        name = type(c).__name__
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {_KIND_WORDS.get(name, 'other')} ({name})" for name, n in counts.items())


def position(caches: Sequence[Any]) -> int:
    """Tokens the attention layers hold (the decode step's context): the primary cache's
    ``offset``, or 0 for a model with no attention cache at all (a pure recurrent model)."""
    for c in ([primary(caches)] if caches else []) + list(caches):
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0


def untrimmable(caches: Sequence[Any], n: int | None = None) -> list:
    """The slots that cannot drop their last ``n`` tokens now (recurrent state, a sliding window
    that has wrapped round, or dropped more than its slack: SlidingKVCache.can_trim)."""
    return [c for c in caches
            if not (c.can_trim(n) if n is not None and hasattr(c, "can_trim") else c.is_trimmable())]


def trim_reason(caches: Sequence[Any], n: int | None = None) -> str:
    """Why ``untrimmable(caches, n)`` cannot be trimmed, in words ("" when all can)."""
    names: dict[str, int] = {}
    for c in untrimmable(caches, n):
        names[type(c).__name__] = names.get(type(c).__name__, 0) + 1
    if not names:
        return ""
    why = {
        "ArraysCache": "recurrent state summarises every token and cannot be rewound",
        "RotatingKVCache": "the sliding window has already overwritten the tokens before it",
        "SlidingKVCache": "the sliding window has already dropped the tokens it would need again",
    }
    parts = [f"{n} {name} layers ({why.get(name, 'not trimmable')})" for name, n in names.items()]
    return "; ".join(parts)


__all__ = ["foreign", "is_ours", "is_policy", "kinds", "model_layout", "position", "primary", "settle", "slides",
           "takes_policy", "trim_reason", "uniform", "untrimmable"]


def settle(caches: Sequence[Any]) -> None:
    """Run the maintenance due in each of our caches (quantise a chunk, evict) now. Where the
    scored caches' votes run natively, every layer's are asked first and run as one pool map
    (NativeRowOps.votes_many): a layer's 3 KV heads on 2 threads left a thread idle, and a pool
    dispatch per layer cost more than one for all of them."""
    ours = [c for c in caches if is_ours(c) and hasattr(c, "settle")]
    asked = []
    for c in ours:
        request = getattr(c, "vote_request", None)
        r = request() if request is not None else None
        if r is not None:
            asked.append((c, r))
    if len(asked) > 1:
        for (c, _), mass in zip(asked, asked[0][0].native.votes_many([r for _, r in asked])):
            c.take_votes(mass)
    for c in ours:
        c.settle()
