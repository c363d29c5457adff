"""The naive cache: ``mx.concatenate`` on every token (kept to show what that costs)."""

from __future__ import annotations

import mlx.core as mx

from .base import CacheStateError, _CacheBase
from .rope import Repositioner
from .settings import CacheSettings
from .usage import CacheUsage


class ConcatKVCache(_CacheBase):
    """The naive cache: ``mx.concatenate`` on every token, copying the whole history each step."""

    mode = "concat"

    def __init__(self, settings: CacheSettings | None = None, repositioner: Repositioner | None = None):
        self.settings = settings
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.evicted = 0
        self.evicted_by: dict[str, int] = {}
        self.quantised_by: dict[str, int] = {}

    @property
    def offset(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        return self.keys, self.values

    def absorb(self, keys: mx.array, values: mx.array) -> None:
        """Take tokens outside a model step (conversion, restore)."""
        self.update_and_fetch(keys, values)

    def keys_and_values(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values

    def buffers(self) -> list[mx.array]:
        """The held arrays (SegmentedKVCache.buffers)."""
        return [a for a in (self.keys, self.values) if a is not None]

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if n:
            end = self.offset - n
            self.keys, self.values = self.keys[:, :, :end], self.values[:, :, :end]
        return n

    def content(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values

    def load_state(self, state, meta_state) -> None:
        state = list(state)
        if len(state) not in (0, 2):
            raise CacheStateError(f"expected 0 or 2 state arrays, got {len(state)}")
        self.state = state
        self.meta_state = meta_state

    def usage(self) -> CacheUsage:
        if self.keys is None:
            return CacheUsage()
        b = self.keys.nbytes + self.values.nbytes
        n = self.offset
        return CacheUsage(full_tokens=n, full_slots=n, full_bytes=b, full_bytes_allocated=b)

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    @state.setter
    def state(self, v):
        self.keys, self.values = (v[0], v[1]) if v else (None, None)

    @property
    def meta_state(self):
        return ()

    @meta_state.setter
    def meta_state(self, v):
        if tuple(v):
            raise CacheStateError(f"concat caches carry no meta state (got {tuple(v)!r})")

    @classmethod
    def from_state(cls, state, meta_state=()):
        c = cls()
        c.state = state
        c.meta_state = meta_state
        return c
