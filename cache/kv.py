"""Per-layer KV caches speaking mlx-lm's cache protocol.

``offset``, ``update_and_fetch``, ``make_mask``, ``state``/``meta_state``/``from_state``,
``trim``/``is_trimmable``, ``size``, ``empty`` and ``nbytes`` are what mlx-lm's models and
helpers call; ``attend`` (see attention.py) and ``usage`` are ours.

Positions: caches that evict report ``offset`` = tokens held, so the model places a new token
right after the kept ones (compacted positions) and never passes its trained context.
Maintenance (quantising the oldest recent tokens, evicting) runs lazily before the next read of
``offset`` rather than inside ``update_and_fetch``, so the attention of the step that wrote the
tokens still sees them at the positions it computed them with.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from .attention import attend_full, attend_mixed, prefill_kernel
from .base import CacheStateError, _CacheBase, tally
from .buffers import FullBuffer
from .concat import ConcatKVCache
from .quant_channel import quant_buffer
from .rope import Repositioner
from .row_ops import RowOps
from .settings import CacheSettings
from .sparsity import evictable_share, observer, record
from .usage import CacheUsage


class SegmentedKVCache(_CacheBase):
    """The preallocated cache and its windowed / quantised policies, in one mechanism.

    Sequence order is: sinks | quantised middle | recent. Sinks and recent share one contiguous
    full-precision buffer (so a cache with nothing quantised hands the fused SDPA one slice);
    the middle lives in a quantised buffer. Policy knobs:

    - ``window``: recent tokens kept at full precision (None: all of them, i.e. prealloc);
    - ``quant``: quantise tokens that leave the recent window, once ``quant_start`` are held;
    - ``budget``: most tokens held; the oldest non-sink tokens beyond it are evicted.

    Flushing and eviction happen ``chunk`` tokens at a time. Evicting d tokens moves everything
    after them d positions back: recent keys are re-rotated in place (float32, at most
    window/chunk + 1 times per token), while the quantised middle keeps a single rotation delta
    ``delta_q`` that is applied to the queries instead, so quantised keys are never re-quantised.
    """

    def __init__(
        self,
        settings: CacheSettings,
        *,
        sinks: int = 0,
        window: int | None = None,
        quantize: bool = False,
        quant_start: int = 0,
        budget: int | None = None,
        repositioner: Repositioner | None = None,
    ):
        self.settings = settings
        self.mode = settings.mode
        self.sinks, self.window, self.budget = sinks, window, budget
        self.quant_start, self.chunk = quant_start, settings.evict_chunk
        # nothing to quantise or evict: every token kept at full precision, in a buffer with no bound
        self._plain = not quantize and budget is None
        self.full = FullBuffer(settings.chunk_size, geometric=self._plain)
        self.quant = quant_buffer(settings) if quantize else None
        self.repos = repositioner
        # in-place maintenance on the buffers' host views, installed by a native decode step
        # (row_ops.py); None, or where it declines: through MLX
        self.native: RowOps | None = None
        self.delta_q = 0
        self.evicted = 0
        # Tokens each policy evicted / quantised so far, by mode name (a conversion carries them
        # over, see convert.py; a restore attributes the saved eviction count to the saved mode).
        self.evicted_by: dict[str, int] = {}
        self.quantised_by: dict[str, int] = {}
        self._pending = False
        # Whether this model routes attention through attend() (see attention.py): unknown until
        # seen. Until then update_and_fetch returns the full (dequantised) history, which is
        # right either way; once attend() has followed an update, it may skip building it.
        self._dispatched: bool | None = None
        self._awaiting_attend = False
        # An evicting cache's last decode queries, for attention_sparsity (sparsity.py).
        self._seen = observer() if budget is not None else None

    # ---- protocol -------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        if self._pending:
            self._maintain()
        return self._held()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._plain:  # nothing to quantise or evict: the hot path of prealloc
            self.full.append(keys, values)
            return self.full.view()
        if self._awaiting_attend:
            self._dispatched = False  # the model attended without calling attend(): never skip
        self.absorb(keys, values)
        if self._dispatched and self._quant_len():
            # attend() will run, so skip building the dequantised history: even unevaluated,
            # its graph costs ~50 us of Python per layer and step.
            return self.full.view()
        self._awaiting_attend = self._dispatched is None
        return self.content()

    def serves(self, keys: mx.array, values: mx.array) -> bool:
        """Whether ``keys``/``values``, passed to attention, are what ``update_and_fetch`` handed
        the model (all held tokens, or the full-precision part), so that ``attend`` may compute
        the attention from the cache itself. Absorbed multi-head latent attention (DeepSeek V3)
        caches latents and attends over arrays made from them (a decode step passes the cached
        keys as both keys and values): those must be used as passed."""
        held = self.full._held_view
        if held is not None and keys is held[0] and values is held[1]:
            return True
        if not self._quant_len() or keys is values:
            return False
        # a quantised history handed out whole (content(): new arrays on every call)
        fk, fv = self.full.keys, self.full.values
        n = self._held()
        return (keys.shape[2] == n and values.shape[2] == n and keys.shape[1] == fk.shape[1]
                and keys.shape[3] == fk.shape[3] and values.shape[1] == fv.shape[1] and values.shape[3] == fv.shape[3])

    def decline_attend(self) -> None:
        """The model's attention does not go through ``attend`` (``serves`` said no): hand it the
        whole held history from every ``update_and_fetch`` from now on."""
        self._dispatched, self._awaiting_attend = False, False

    def keys_and_values(self) -> tuple[mx.array | None, mx.array | None]:
        """mlx-lm 0.32's name for the held K/V (layers that share another layer's K/V read it,
        e.g. afm7's KV-reuse layers): full precision, in sequence order."""
        return self.content()

    @property
    def keys(self) -> mx.array | None:
        return self.content()[0]

    @property
    def values(self) -> mx.array | None:
        return self.content()[1]

    def wrote_in_place(self, n: int) -> None:
        """Count ``n`` tokens that a native step wrote into ``full``'s buffers in place
        (``full.writable_in_place(n)`` said it may): what ``update_and_fetch`` of those rows
        would have left. The writer settled the cache first (``settle``), so the rows follow
        what it holds; the policy's maintenance they make due runs before the next read, as
        after ``update_and_fetch``."""
        if self._pending:
            raise ValueError(f"{self.mode}: rows written in place before the cache's maintenance ran (settle)")
        self.full.wrote_in_place(n)
        if not self._plain:
            self._arrived(n)

    @contextmanager
    def borrowed(self):
        """For a reader that evaluates what it takes from the cache before the block ends (the
        attention share, sparsity.py): the views it took are not counted as handed out, so the
        next maintenance may still run in place (row_ops.py)."""
        full_shared, quant_shared = self.full.shared, getattr(self.quant, "shared", 0)
        try:
            yield self
        finally:
            self.full.shared, self.full._held_view = full_shared, None
            if self.quant is not None and hasattr(self.quant, "shared"):
                self.quant.shared, self.quant._held_view = quant_shared, None

    def buffers(self) -> list[mx.array]:
        """The arrays the cache writes into, as they are: evaluating them runs the writes MLX has
        pending, handing out no view (``state`` hands out views of the held rows, which in-place
        maintenance must then leave alone, row_ops.py)."""
        parts = [self.full.keys, self.full.values]
        if self.quant is not None:
            parts += [*(self.quant.keys or []), *(self.quant.values or [])]
        return [a for a in parts if a is not None]

    def settle(self) -> None:
        """Run the maintenance that is due (quantise a chunk, evict): a native step reads the
        buffers as they are, so it settles every cache first, as reading ``offset`` would."""
        if self._pending:
            self._maintain()

    @property
    def keeps_queries(self) -> bool:
        """Whether the cache keeps decode steps' queries (``keep_queries``): the evicting modes do."""
        return self._seen is not None

    def keep_queries(self, queries, scale: float) -> None:
        """The roped queries of a decode step a native step ran (host floats [heads, D]): what
        ``attend`` keeps of them (the sparsity figure's; the scored caches' votes, scored.py)."""
        if self._seen is not None:
            record(self._seen, queries, scale, self._held() - 1, self.evicted)

    # how many of a prefill chunk's last queries the cache keeps (keep_chunk_queries): none here
    chunk_queries_kept = 0

    def keep_chunk_queries(self, queries, scale: float, n_tokens: int) -> None:
        """The last roped queries (host floats [n, heads, D]) of a ``n_tokens`` chunk a native
        prefill ran, for a cache whose ``chunk_queries_kept`` asks for them."""

    def reserve(self, n: int) -> bool:
        """Room for ``n`` more tokens now, rather than when they arrive, in a cache that keeps
        every token at full precision and already holds rows (nothing otherwise: the bounded
        modes' buffers stop growing at their budget). Growing copies every row held into new
        memory: in the middle of a reply that is a stall (8 layers of a 7B model at 4,096
        tokens: 0.4-1 s), so a session reserves a turn's worth before the turn's prefill.
        Evaluated here, one layer at a time: the old and the new buffers of every layer at
        once would be MLX's peak. Returns whether the buffers grew."""
        k = self.full.keys
        if not self._plain or k is None or self.full.length + n <= self.full.capacity:
            return False
        rows = mx.zeros((k.shape[0], k.shape[1], 1, k.shape[3]), k.dtype)  # the rows' shape
        self.full.reserve(n, rows, rows)
        mx.eval(self.full.keys, self.full.values)
        return True

    def absorb(self, keys: mx.array, values: mx.array) -> None:
        """Take tokens outside a model step (conversion, restore); the policy then applies."""
        if self._pending:
            self._maintain()
        self.full.append(keys, values)
        self._arrived(keys.shape[2])

    def _arrived(self, n: int) -> None:
        """What follows ``n`` rows arriving in ``full`` (appended, or written in place)."""
        self._pending = self._needs_maintenance()

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """Attention for the step that just wrote its tokens (see attention.py)."""
        if self._awaiting_attend:
            self._awaiting_attend, self._dispatched = False, True  # the dispatch is in place
        if self._seen is not None and queries.shape[2] == 1:
            record(self._seen, queries, scale, self._held() - 1, self.evicted)
        k, v = self.full.view()
        if not self._quant_len():
            return attend_full(queries, k, v, scale, mask)
        if queries.shape[2] > 1 and prefill_kernel() is not None:
            # A prefill chunk with a faster kernel installed: dequantising the history once per
            # layer (O(N)) is cheap next to the chunk's attention over it (O(L*N)).
            k, v = self.content()
            return attend_full(queries, k, v, scale, mask)
        qk, qv = self.quant.packed()
        s = self.sinks
        parts = [
            ("full", k[..., :s, :], v[..., :s, :]),
            (self.quant.kind, qk, qv),
            ("full", k[..., s:, :], v[..., s:, :]),
        ]
        if not s:
            parts = parts[1:]
        # Quantised keys sit delta_q positions further on (see the class docstring): scores
        # against them use queries moved by the same amount, since only relative position counts.
        shifted = self.repos.shift(queries, self.delta_q) if self.delta_q else None
        return attend_mixed(queries, parts, scale, mask, self.quant.bits, self.quant.group_size, shifted)

    def content(self) -> tuple[mx.array | None, mx.array | None]:
        """All held K/V in sequence order at compacted positions, full precision (lazy)."""
        if not self._held():
            return None, None
        k, v = self.full.view()
        if not self._quant_len():
            return k, v
        qk, qv = self.quant.dequantized()
        if self.delta_q:
            qk = self.repos.shift(qk, -self.delta_q)
        s = self.sinks
        return (
            mx.concatenate([k[..., :s, :], qk.astype(k.dtype), k[..., s:, :]], axis=2),
            mx.concatenate([v[..., :s, :], qv.astype(v.dtype), v[..., s:, :]], axis=2),
        )

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens held (recent first, then quantised, then sinks)."""
        if self._pending:
            self._maintain()
        if self._seen is not None:
            self._seen.clear()  # the recorded queries may be among the trimmed tokens
        want, done = n, 0
        floor = self.sinks if self._quant_len() else 0
        take = min(want, self.full.length - min(floor, self.full.length))
        self.full.trim(take)
        done += take
        if self.quant is not None and done < want:
            take = min(want - done, self.quant.length)
            self.quant.trim(take)
            done += take
        if done < want and not self._quant_len():
            take = min(want - done, self.full.length)
            self.full.trim(take)
            done += take
        if not self._quant_len():
            self.delta_q = 0
        return done

    def attention_sparsity(self) -> float | None:
        """Share of the last decode steps' attention on what the policy could evict next
        (sparsity.py); None for the modes that never evict."""
        return evictable_share(self, self._seen) if self._seen is not None else None

    def usage(self) -> CacheUsage:
        if self._pending:
            self._maintain()
        fb, qb = self.full.token_bytes(), (self.quant.token_bytes() if self.quant else 0)
        ql, qc = (self.quant.length, self.quant.capacity) if self.quant else (0, 0)
        return CacheUsage(
            full_tokens=self.full.length, quant_tokens=ql, evicted=self.evicted,
            full_slots=self.full.capacity, quant_slots=qc,
            full_bytes=fb * self.full.length, quant_bytes=qb * ql,
            full_bytes_allocated=fb * self.full.capacity, quant_bytes_allocated=qb * qc,
        )

    # ---- maintenance ----------------------------------------------------------------------
    def _held(self) -> int:
        return self.full.length + self._quant_len()

    def _quant_len(self) -> int:
        return self.quant.length if self.quant is not None else 0

    def _recent(self) -> int:
        return self.full.length - min(self.sinks, self.full.length)

    def _flush_due(self) -> bool:
        return (
            self.quant is not None
            and self._held() >= self.quant_start
            and self._recent() >= (self.window or 0) + self.chunk
        )

    def _evict_due(self) -> bool:
        return self.budget is not None and self._held() >= self.budget + self.chunk

    def _needs_maintenance(self) -> bool:
        return self._flush_due() or self._evict_due()

    def _maintain(self) -> None:
        self._pending = False
        if self._flush_due():
            self._flush(self._recent() - (self.window or 0))
        if self._evict_due():
            self._evict(self._held() - self.budget)

    def _flush(self, n: int) -> None:
        """Quantise the ``n`` oldest recent tokens into the middle."""
        n = self.quant.flushable(n)
        if n <= 0:
            return
        s = self.sinks if self.full.length > self.sinks else 0
        if self.native is None or not self.native.flush(self.full, self.quant, s, n, self.delta_q):
            k, v = self.full.view(s, s + n)
            if self.delta_q:
                k = self.repos.shift(k, self.delta_q)
            self.quant.append(k, v)
            self.full.remove(s, n)
        tally(self.quantised_by, self.mode, n)

    def _evict(self, n: int) -> None:
        """Drop the ``n`` oldest non-sink tokens and move what follows back by ``n`` positions."""
        from_quant = self.quant.front_cut(min(n, self._quant_len())) if self._quant_len() else 0
        n = max(n, from_quant)
        native = self.native
        if from_quant:
            if native is None or not native.remove_front(self.quant, from_quant):
                self.quant.remove_front(from_quant)
            self.delta_q = self.delta_q + from_quant if self.quant.length else 0
        from_recent = n - from_quant
        if from_recent and (native is None or not native.remove(self.full, self.sinks, from_recent)):
            self.full.remove(self.sinks, from_recent)
        self._move_window(-n)
        self.evicted += n
        tally(self.evicted_by, self.mode, n)

    def _move_window(self, delta: int) -> None:
        """Turn the keys after the sinks by ``delta`` positions (in place where the native step
        allows, else through MLX): what follows rows evicted before them."""
        if self.native is None or not self.native.rotate(self.full, self.sinks, delta):
            self.full.rotate(self.sinks, delta, self.repos)

    # ---- persistence ----------------------------------------------------------------------
    @property
    def state(self):
        if not self._held():
            return []
        k, v = self.full.view()
        out = [k, v]
        if self._quant_len():
            out += self.quant.to_state()
        return out

    @state.setter
    def state(self, v):
        """Rebuild the buffers from what ``state`` returned: [] or [keys, values] (sinks and
        recent, full precision) plus, when tokens are quantised, K and V as (packed, scales,
        biases) each. Pending maintenance is recomputed from the restored sizes, so a restored
        cache goes on exactly as the saved one would have."""
        v = list(v)
        if len(v) not in (0, 2, 8):
            raise CacheStateError(f"expected 0, 2 or 8 state arrays, got {len(v)}")
        if len(v) == 8 and self.quant is None:
            raise CacheStateError(f"the state holds quantised tokens but {self.mode} keeps none")
        self.full = FullBuffer(self.settings.chunk_size, geometric=self._plain)
        if self.quant is not None:
            self.quant = quant_buffer(self.settings)
        if v:
            if not v[0].shape[2]:  # every token quantised: buffers of the rows' shape, none written
                self.full.reserve(1, v[0], v[1])
            self.full.append(v[0], v[1])
        if len(v) == 8:
            n = v[2].shape[2]
            if self.quant.kind == "quant" and any(x.ndim != 4 or x.shape[2] != n for x in v[2:]):
                raise CacheStateError("quantised key/value arrays disagree on the number of tokens")
            try:
                self.quant.from_state(v[2:8])
            except ValueError as e:
                raise CacheStateError(str(e)) from None
        self._pending = self._needs_maintenance()

    @property
    def meta_state(self):
        return tuple(str(x) for x in (self.delta_q, self.evicted))

    @meta_state.setter
    def meta_state(self, v):
        v = tuple(v)
        try:
            delta_q, evicted = (int(x) for x in v)
        except (TypeError, ValueError):
            raise CacheStateError(f"meta state must be two integers (delta_q, evicted), got {v!r}") from None
        if delta_q < 0 or evicted < 0:
            raise CacheStateError(f"delta_q and evicted must be >= 0 (got {delta_q}, {evicted})")
        if evicted and self.budget is None:
            raise CacheStateError(f"{self.mode} never evicts, but the state says {evicted} tokens were evicted")
        if delta_q and not self._quant_len():
            raise CacheStateError("a rotation delta (delta_q) without quantised tokens")
        self.delta_q, self.evicted = delta_q, evicted
        self.evicted_by = {self.mode: evicted} if evicted else {}

    def load_state(self, state, meta_state) -> None:
        """Set ``state`` then ``meta_state`` (the order the checks need)."""
        self.state = state
        self.meta_state = meta_state

    @classmethod
    def from_state(cls, state, meta_state=("0", "0")):
        """A cache holding ``state`` (mlx-lm's ``load_prompt_cache`` calls this with the state
        alone). mlx-lm's file keeps no settings, so the quantisation bits and group size are read
        from the arrays' shapes; the evicting modes need the model's RoPE and their window
        settings, which it does not keep either: chatapp's own snapshots (chatapp/store) do."""
        mode = next((m for m, k in CACHE_CLASSES.items() if k is cls), None)
        if mode is None or CacheSettings(mode=mode).evicts:
            raise NotImplementedError(
                f"{cls.__name__}.from_state: a {mode or cls.__name__} cache needs the model's RoPE and its window "
                "settings, which mlx-lm's prompt-cache files do not keep; save it with chatapp's KV snapshots")
        state = list(state)
        settings = CacheSettings(mode=mode)
        if len(state) == 8:  # values quantised per token: packed [.., D * bits / 32], scales [.., D / group]
            d = state[1].shape[-1]
            bits, group = state[5].shape[-1] * 32 // d, d // max(1, state[6].shape[-1])
            settings = settings.with_(kv_bits=bits, kv_group_size=group)
        last: Exception | None = None
        for layout in ("token", "channel"):
            c = cls(settings.with_(kv_key_layout=layout))
            try:
                c.load_state(state, tuple(meta_state))
                return c
            except CacheStateError as e:
                last = e
        raise last



class PreallocKVCache(SegmentedKVCache):
    """Contiguous buffer, grown by whole chunks (by half its capacity at least: FullBuffer),
    written in place; keeps every token."""

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None):
        super().__init__(settings)


class QuantStartKVCache(SegmentedKVCache):
    """Full precision until ``quant_start`` tokens, then quantised ``evict_chunk`` at a time.

    Up to ``evict_chunk - 1`` of the newest tokens wait at full precision for the next chunk
    (the usage accounting shows them as such).
    """

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None):
        super().__init__(settings, window=0, quantize=True, quant_start=settings.quant_start)


class WindowKVCache(SegmentedKVCache):
    """Attention sinks plus a sliding window at full precision; memory bounded."""

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None):
        super().__init__(settings, sinks=settings.sinks, window=settings.window,
                         budget=settings.budget, repositioner=repositioner)


class WindowQuantKVCache(SegmentedKVCache):
    """Sinks and a recent window at full precision, older tokens quantised, a token budget."""

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None):
        super().__init__(settings, sinks=settings.sinks, window=settings.window, quantize=True,
                         budget=settings.budget, repositioner=repositioner)


CACHE_CLASSES: dict[str, type] = {
    "concat": ConcatKVCache,
    "prealloc": PreallocKVCache,
    "quantized": QuantStartKVCache,
    "window": WindowKVCache,
    "window-quant": WindowQuantKVCache,
}


def register_with_mlx_lm(*classes: type) -> None:
    """Make ``classes`` known to mlx-lm's ``load_prompt_cache`` (and ``CacheList.state``), which
    look cache classes up by name in ``mlx_lm.models.cache``; chatapp's names never shadow one
    of mlx-lm's own."""
    import mlx_lm.models.cache as mlx_cache

    for cls in classes:
        there = getattr(mlx_cache, cls.__name__, None)
        if there is not None and there is not cls:
            raise RuntimeError(f"{cls.__name__} is already one of mlx-lm's cache classes")
        setattr(mlx_cache, cls.__name__, cls)


register_with_mlx_lm(*CACHE_CLASSES.values())
