"""What every chatapp cache shares: mlx-lm's mask, size and batching helpers, the state error,
and the per-policy tallies (kv.py and concat.py hold the caches)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask


def tally(counts: dict[str, int], mode: str, n: int) -> None:
    """Add ``n`` tokens to ``mode``'s count (the per-policy evicted / quantised tallies)."""
    if n:
        counts[mode] = counts.get(mode, 0) + n


class CacheStateError(ValueError):
    """Saved cache state that cannot be restored into this cache; the message says why."""


class _CacheBase:
    mode: str = ""

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """mlx-lm's ``create_attention_mask`` for this cache: a windowed mask whenever the model
        asks for a window (a decode step too: the window may already exclude early tokens)."""
        offset = self.offset
        if window_size is not None:
            return create_causal_mask(N, offset, window_size=window_size)
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, offset)
        return "causal"

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """Bytes really held (not the allocated buffer); ``usage()`` has both."""
        return self.usage().bytes_held

    @classmethod
    def merge(cls, caches):
        """mlx-lm's batched cache of several single-sequence caches (``BatchKVCache``: full
        precision, left-padded), as mlx-lm's ``KVCache.merge`` gives."""
        from mlx_lm.models.cache import BatchKVCache

        return BatchKVCache.merge(caches)

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``QuantizedKVCache`` holding this cache's tokens (as ``KVCache.to_quantized``)."""
        from mlx_lm.models.cache import QuantizedKVCache as MlxQuantizedKVCache

        q = MlxQuantizedKVCache(group_size=group_size, bits=bits)
        k, v = self.content()
        if k is not None:
            q.keys = mx.quantize(k, group_size=group_size, bits=bits)
            q.values = mx.quantize(v, group_size=group_size, bits=bits)
            q.offset = k.shape[2]
        return q


def is_sliding(c) -> bool:
    """A sliding-window layer's own cache (sliding.SlidingKVCache), not a policy's."""
    return getattr(c, "sliding", False) is True
