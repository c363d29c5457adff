"""Cache usage accounting: what is really held, and what is allocated, by precision."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable


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


def total_usage(caches: Iterable) -> CacheUsage:
    """Sum of the per-layer usage; per-layer token counts are equal, so tokens are per layer."""
    layers = [c.usage() for c in caches]
    total = CacheUsage()
    for u in layers:
        total = total + u
    n = max(1, len(layers))
    # Token counts describe the sequence, not the sum over layers; bytes and slots add up.
    total.full_tokens //= n
    total.quant_tokens //= n
    total.evicted //= n
    total.full_slots //= n
    total.quant_slots //= n
    return total
