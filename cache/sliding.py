"""A sliding-window layer's cache (Gemma 3's local layers: each token attends to itself and the
``window - 1`` tokens before it), held as the segmented caches hold theirs.

mlx-lm gives these layers a ``RotatingKVCache``: a ring of ``window`` rows whose order turns
with every token. The fused CPU steps (chatapp/backend/fused_decode.py) read and write a
layer's K/V in place in one contiguous buffer in sequence order, as they do the other layers':
this cache keeps the last tokens there, between ``chunk`` and twice ``chunk`` more than the window,
dropping the oldest rows ``chunk`` at a time (one move of the rows kept, as the window modes'
eviction). The rows past the window are the slack a trim needs: a turn that drops the last tokens
of the reply before it (the template's end of turn; a regenerated or edited reply) trims them
and the rows before come back into the window, where mlx-lm's ring (no slack) had to re-prefill
the whole conversation once it had wrapped round. Gemma 3 270M: 15 KB a token of slack over its
15 sliding layers (float16).
Unlike the window *policy* it never re-bases positions: a sliding layer's keys stay at the
positions they were computed at and ``offset`` counts every token seen, as ``RotatingKVCache``'s
does, so whatever the session's policy does to the full-attention layers (evict, quantise),
these keep exactly the model's own window. Its attention masks to the window (``make_mask``), so
a cache holding up to ``chunk`` rows more than the window gives the same logits as the ring.

It is not a policy cache: ``layers.uniform`` and ``layers.primary`` skip it, conversions keep
it as it is, and a trim that would leave the next token's window short is refused
(``can_trim``): the session then re-prefills, as it must with mlx-lm's ring.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .base import CacheStateError
from .buffers import FullBuffer
from .kv import SegmentedKVCache, register_with_mlx_lm
from .settings import CacheSettings


class SlidingKVCache(SegmentedKVCache):
    """The last ``window`` tokens of a sliding-window layer (and one to two chunks more, the slack a
    trim takes back), full precision."""

    sliding = True

    def __init__(self, settings: CacheSettings, window: int):
        super().__init__(settings)
        self._plain = False  # maintenance (dropping) follows each append
        # grown by whole chunks, as the state setter rebuilds it (the held rows stay within two
        # chunks of the window: nothing to gain from growing by half the capacity)
        self.full = FullBuffer(settings.chunk_size, geometric=False)
        self.window_size = int(window)
        self.mode = "sliding"
        self.dropped = 0  # tokens before the held ones: their positions stay as computed

    @property
    def offset(self) -> int:
        """Every token seen (the next token's position), as ``RotatingKVCache.offset``."""
        if self._pending:
            self._maintain()
        return self.full.length + self.dropped

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The mask of ``N`` new tokens over the held rows and themselves, as mlx-lm's
        ``RotatingKVCache.make_mask`` gives it (so that models which ask for a window other than
        their cache's, plamo3's ``window + 1``, get mlx-lm's logits): a chunk sees the last
        ``window - 1`` held rows at most, masked causally to ``window_size`` (the cache's window
        when not given); one token the last min(window_size, window) keys, itself included."""
        if self._pending:
            self._maintain()
        held, W = self.full.length, self.window_size
        if N > 1:
            mask = create_causal_mask(N, held, window_size=window_size or W)
            seen = min(W - 1, held)  # the ring keeps window - 1 rows for a chunk
            return mask & (mx.arange(held + N) >= held - seen)[None] if seen < held else mask
        w = min(window_size or W, W)
        if held + 1 <= w:
            return None  # every held row is inside the window
        return (mx.arange(held + 1) >= held + 1 - w)[None]

    def _needs_maintenance(self) -> bool:
        return self.full.length >= self.window_size - 1 + 2 * self.chunk

    def _maintain(self) -> None:
        """Drop all but the last ``window - 1`` rows (the next token's window) and ``chunk`` more
        (the slack a trim takes back)."""
        self._pending = False
        n = self.full.length - (self.window_size - 1 + self.chunk)
        if n <= 0:
            return
        if self.native is None or not self.native.remove(self.full, 0, n):
            self.full.remove(0, n)
        self.dropped += n

    def can_trim(self, n: int) -> bool:
        """Whether dropping the last ``n`` tokens leaves the next token's whole window held (the
        tokens dropped from the front cannot come back)."""
        if self._pending:
            self._maintain()
        return not self.dropped or self.full.length - n >= self.window_size - 1

    def is_trimmable(self) -> bool:
        return self.can_trim(1)

    def trim(self, n: int) -> int:
        if not self.can_trim(n):
            return 0
        return super().trim(n)

    @property
    def meta_state(self):
        return ("0", "0", str(self.window_size), str(self.dropped))

    @meta_state.setter
    def meta_state(self, v):
        v = tuple(v)
        try:
            window, dropped = int(v[2]), int(v[3])
        except (IndexError, TypeError, ValueError):
            raise CacheStateError(f"sliding meta state must be (0, 0, window, dropped), got {v!r}") from None
        if window != self.window_size or dropped < 0:
            raise CacheStateError(f"a sliding cache of window {window} (dropped {dropped}) restored into one of "
                                  f"{self.window_size}")
        self.dropped = dropped

    @classmethod
    def from_state(cls, state, meta_state=("0", "0")):
        meta = tuple(meta_state)
        if len(meta) != 4:
            raise NotImplementedError("SlidingKVCache.from_state needs its window (meta_state[2])")
        c = cls(CacheSettings(mode="prealloc"), int(meta[2]))
        c.load_state(list(state), meta)
        return c


# model types whose layers each place their tokens by their own cache's ``offset`` and take their
# masks from a cache of their own kind (read in mlx-lm's code: gemma3_text's attention ropes with
# ``cache.offset``, its global mask comes from a global layer's cache, its window's from a sliding
# one's): the evicting policies may compact the full layers' positions while these windows keep
# theirs. Elsewhere (a model that positions every layer by the first cache's offset) that would
# turn the sliding layers' keys by the wrong positions, so the evicting modes stay refused.
OWN_OFFSETS = ("gemma3_text", "gemma3")  # gemma3: the multimodal checkpoints, whose code calls gemma3_text's


register_with_mlx_lm(SlidingKVCache)
