"""Cache usage accounting: what is really held, and what is allocated, by precision."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable

from .base import is_sliding


@dataclass
class CacheUsage:
    full_tokens: int = 0  # tokens held at full precision
    quant_tokens: int = 0  # tokens held quantised
    evicted: int = 0  # tokens dropped by the window policy (no longer seen by the model)
    full_slots: int = 0  # full-precision slots allocated
    quant_slots: int = 0  # quantised slots allocated
    full_bytes: int = 0  # bytes of K and V actually held at full precision
    quant_bytes: int = 0  # bytes held quantised (packed values + scales + biases)
    full_bytes_allocated: int = 0
    quant_bytes_allocated: int = 0

    @property
    def tokens(self) -> int:
        return self.full_tokens + self.quant_tokens

    @property
    def capacity(self) -> int:
        return self.full_slots + self.quant_slots

    @property
    def bytes_held(self) -> int:
        return self.full_bytes + self.quant_bytes

    @property
    def bytes_allocated(self) -> int:
        return self.full_bytes_allocated + self.quant_bytes_allocated

    def __add__(self, other: "CacheUsage") -> "CacheUsage":
        return CacheUsage(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def layer_usage(c) -> CacheUsage:
    """One layer's usage: a chatapp cache reports its own; one of mlx-lm's (a sliding window, a
    recurrent state, ...) counts its bytes at full precision and the tokens it attends over
    (``size()``: 0 for recurrent state, which holds no tokens)."""
    usage = getattr(c, "usage", None)
    if usage is not None:
        return usage()
    try:
        b = int(c.nbytes)
    except (AttributeError, NotImplementedError, TypeError):
        b = 0
    n = int(c.size()) if hasattr(c, "size") else 0
    return CacheUsage(full_tokens=n, full_slots=n, full_bytes=b, full_bytes_allocated=b)


def total_usage(caches: Iterable) -> CacheUsage:
    """Sum of the per-layer usage. Bytes and allocations add up over every layer; token counts
    describe the sequence, so they are per layer: those of the chatapp policy caches (equal in
    every such layer), or for a model without any, the longest of its own caches."""
    caches = list(caches)
    # the policy caches (a sliding window's own cache has usage() too, but not the sequence's count)
    ours = [c for c in caches if hasattr(c, "usage") and not is_sliding(c)]
    total = CacheUsage()
    for c in caches:
        total = total + layer_usage(c)
    counted = [layer_usage(c) for c in ours] if ours else [max((layer_usage(c) for c in caches),
                                                               key=lambda u: u.tokens, default=CacheUsage())]
    n = max(1, len(counted))
    for name in ("full_tokens", "quant_tokens", "evicted", "full_slots", "quant_slots"):
        setattr(total, name, sum(getattr(u, name) for u in counted) // n)
    return total
