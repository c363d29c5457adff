"""What the side panel and the status bar show of a session's caches: one :class:`CacheView`.

The session owns its caches; this module only reads them. ``scan_messages`` decides the cost:
with it, the conversation is mapped message by message (:func:`cache_map.session_map`
re-tokenises what was added since the last call) and every evicting layer's attention share is
read (one pass per layer), so it runs once per turn; the live views while a reply streams pass
``scan_messages=False`` and reuse the last turn's message boundary and share.
"""

from __future__ import annotations

from typing import Any, Sequence

from cache import total_usage
from cache.layers import primary

from .cache_map import session_map
from .memory import memory_total
from .stats import CacheView

# layers the attention share is measured on, spread over the depth: each reads its whole history
# (SmolLM2's 30 layers at 4,190 tokens: 1.2 s at every turn's end; 4 of them 0.16 s)
SPARSITY_LAYERS = 4


def attention_sparsity(caches: Sequence[Any]) -> float | None:
    """Mean over up to SPARSITY_LAYERS layers (spread over the depth) of the evicting caches'
    attention share on what they could evict (the scored modes' votes, the window modes' last
    decode queries; None otherwise)."""
    caches = list(caches)
    if len(caches) > SPARSITY_LAYERS:
        step = (len(caches) - 1) / (SPARSITY_LAYERS - 1)
        caches = [caches[round(i * step)] for i in range(SPARSITY_LAYERS)]
    shares = [s for c in caches if (s := getattr(c, "attention_sparsity", lambda: None)()) is not None]
    return sum(shares) / len(shares) if shares else None


def first_visible_message(session: Any, starts: list[int]) -> int:
    """Index of the first message the model still sees: those wholly inside the evicted run
    (after the sinks, when the mode keeps sinks) are gone."""
    evicted = getattr(primary(session.caches), "evicted", 0)
    if not evicted:
        return 0
    limit = (session.settings.sinks if session.settings.evicts else 0) + evicted
    bounds = starts + [len(session.cached)]
    return sum(1 for i in range(len(bounds) - 1) if bounds[i + 1] <= limit)


def session_view(session: Any, scan_messages: bool, first_visible: int, sparsity: float | None) -> CacheView:
    """The session's cache usage for display; ``first_visible`` and ``sparsity`` are the last
    scan's, used as they are when ``scan_messages`` is off."""
    usage = total_usage(session.caches)
    first = primary(session.caches)
    rows = []
    if scan_messages:
        starts, rows = session_map(session)
        first_visible = first_visible_message(session, starts)
        sparsity = attention_sparsity(session.caches)
    return CacheView(
        mode=session.mode, tokens=usage.tokens, capacity=usage.capacity,
        full_tokens=usage.full_tokens, quant_tokens=usage.quant_tokens, evicted=getattr(first, "evicted", 0),
        bytes_held=usage.bytes_held, bytes_allocated=usage.bytes_allocated,
        full_bytes=usage.full_bytes, quant_bytes=usage.quant_bytes,
        memory_total=memory_total(),
        conversation_tokens=len(session.cached), first_visible_message=first_visible,
        per_layer_bytes=[c.nbytes for c in session.caches],
        attention_sparsity=sparsity, messages=rows,
        evicted_by_policy=dict(getattr(first, "evicted_by", {})),
        quantised_by_policy=dict(getattr(first, "quantised_by", {})),
    )
