"""The attention-scored cache: keep the tokens attention uses (H2O / TOVA style eviction).

Layout and budget are the window modes' (sinks | middle | recent window, at most
``max_kv_tokens`` after maintenance, eviction ``evict_chunk`` at a time), but when the budget is
passed the tokens dropped are the middle tokens with the least *accumulated attention mass*
instead of the oldest ones. Sinks and the recent window are never evicted.

Why a mode and not an option of window / window-quant: the window modes' middle is ordered by
age (the quantised middle keeps a single rotation delta for all its keys, see kv.py), which is
what lets them evict from the front without re-rotating quantised keys. Scored eviction removes
tokens from anywhere in the middle, so every kept key after an evicted one moves by its own
amount: a different mechanism (per-token re-rotation over a full-precision buffer, scores kept
alongside), so a different class, chosen by name like the other mechanisms.

The score, per token and shared by all heads of a layer: ``score = decay ** L * score + mass``
where ``mass`` is the attention probability the step's L queries gave the token, summed over
query heads and queries. Shared rather than per KV head because the buffers are one contiguous
[batch, kv_heads, tokens, head_dim] array: per-head eviction would make the token axis ragged.
The decay (per query) keeps old tokens from winning only because more queries have seen them
(H2O's bias towards the start); tokens that were recently useful stay.

Scores come from the attention this cache computes anyway: ``attend`` runs the attention itself
(scores, softmax, values, as attend_mixed does) and sums the probabilities; ``mx.depends`` ties
the updated scores to the step's output, so they are evaluated with it and the probabilities
are freed. The installed CPU decode / prefill kernels do not return probabilities, so the
scored mode does not use them (the MLX path serves; documented in docs/).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .attention import causal_mask
from .kv import CACHE_CLASSES, CacheStateError, SegmentedKVCache
from .rope import Repositioner
from .settings import CacheSettings

SCORE_DECAY = 0.995  # per query; a horizon of ~200 queries


def attend_scored(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                  mask: Any) -> tuple[mx.array, mx.array]:
    """Attention over full-precision keys, and the attention mass each key received ([N])."""
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    out_dtype = queries.dtype
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    s = q @ mx.expand_dims(keys.astype(mx.float32), 2).swapaxes(-1, -2)
    if isinstance(mask, str) or (mask is None and L > 1):
        mask = causal_mask(L, s.shape[-1])
    if mask is not None:
        s = mx.where(mask, s, mx.finfo(s.dtype).min) if mask.dtype == mx.bool_ else s + mask
    p = mx.softmax(s, axis=-1, precise=True)
    out = p @ mx.expand_dims(values.astype(mx.float32), 2)
    mass = p.sum(axis=(0, 1, 2, 3))
    return out.reshape(B, n_q, L, -1).astype(out_dtype), mass


def shift_each(repos: Repositioner, x: mx.array, deltas: mx.array) -> mx.array:
    """Move token i of ``x`` ([..., N, D]) by ``deltas[i]`` (<= 0) positions.

    One RoPE call per bit of the largest shift (log2 of the tokens evicted), each applied to the
    tokens whose shift has that bit, in float32 with one cast at the end.
    """
    n = int(-mx.min(deltas).item()) if deltas.size else 0
    if n == 0:
        return x
    y = x.astype(mx.float32)
    amount = -deltas
    bit = 1
    while bit <= n:
        on = ((amount // bit) % 2 == 1)[:, None]
        moved = repos.rope(y[..., None, :], offset=-bit)[..., 0, :]
        y = mx.where(on, moved, y)
        bit *= 2
    return y.astype(x.dtype)


class ScoredKVCache(SegmentedKVCache):
    """Sinks and a recent window always kept; past ``max_kv_tokens`` the least-attended middle
    tokens are evicted, ``evict_chunk`` at a time, and the kept keys move to compact positions."""

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None):
        super().__init__(settings, sinks=settings.sinks, window=settings.window,
                         budget=settings.budget, repositioner=repositioner)
        self.scores = mx.zeros((0,), mx.float32)
        self.last_dropped: list[int] = []  # held indices the last eviction removed (tests, stats)
        # Trailing held tokens that follow each other in the conversation with nothing evicted
        # between them: only these can be trimmed and re-used token-exactly (the engine asks).
        self._tail = 0

    @property
    def contiguous_tail(self) -> int:
        if self._pending:
            self._maintain()
        return self._tail

    def absorb(self, keys: mx.array, values: mx.array) -> None:
        super().absorb(keys, values)
        self._tail += keys.shape[2]
        self._fit_scores()

    def _fit_scores(self) -> None:
        """New tokens start at zero (they sit in the protected recent window while they gather mass)."""
        n = self.full.length - self.scores.shape[0]
        if n > 0:
            self.scores = mx.concatenate([self.scores, mx.zeros((n,), mx.float32)])
        elif n < 0:
            self.scores = self.scores[: self.full.length]

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        if self._awaiting_attend:
            self._awaiting_attend, self._dispatched = False, True
        k, v = self.full.view()
        out, mass = attend_scored(queries, k, v, scale, mask)
        self._fit_scores()
        self.scores = self.scores * (SCORE_DECAY ** queries.shape[2]) + mass
        return mx.depends(out, self.scores)

    def trim(self, n: int) -> int:
        done = super().trim(n)
        self._tail = max(0, self._tail - done)
        self._fit_scores()
        return done

    def evictable(self) -> tuple[int, int]:
        """The [start, end) range of held tokens the policy may evict (the middle)."""
        s = min(self.sinks, self.full.length)
        return s, max(s, self.full.length - (self.window or 0))

    def _evict(self, n: int) -> None:
        """Drop the ``n`` least-attended middle tokens; each kept key moves back by the number of
        tokens evicted before it."""
        start, end = self.evictable()
        n = min(n, end - start)
        if n <= 0:
            return
        held = self.full.length
        mid = self.scores[start:end].tolist()
        # Least mass first; ties (e.g. tokens absorbed by a conversion, all at zero) go to the
        # oldest, so with no scores the policy is the window's. Once per chunk, in Python.
        drop = set(sorted(range(len(mid)), key=lambda i: (mid[i], i))[:n])
        self.last_dropped = sorted(start + i for i in drop)
        keep, deltas, gone = [], [], 0
        for i in range(held):
            if i - start in drop:
                gone += 1
            else:
                keep.append(i)
                deltas.append(-gone)
        idx, deltas = mx.array(keep, mx.int32), mx.array(deltas, mx.int32)
        k, v = self.full.view()
        k, v = mx.take(k, idx, axis=2), mx.take(v, idx, axis=2)
        k = shift_each(self.repos, k, deltas)
        self.scores = self.scores[idx]
        self.full.trim(held)
        self.full.append(k, v)
        self.evicted += n
        self._tail = min(self._tail, held - 1 - self.last_dropped[-1])

    # ---- persistence: [keys, values, scores], so a restored cache evicts as the saved one would
    @property
    def state(self):
        if self._pending:  # settle first: a restore would, and the scores must match the tokens
            self._maintain()
        if not self._held():
            return []
        k, v = self.full.view()
        return [k, v, self.scores]

    @state.setter
    def state(self, v):
        v = list(v)
        if len(v) not in (0, 2, 3):
            raise CacheStateError(f"expected 0, 2 or 3 state arrays for scored, got {len(v)}")
        SegmentedKVCache.state.fset(self, v[:2])
        self.scores = mx.zeros((0,), mx.float32)
        if len(v) == 3:
            if v[2].ndim != 1 or v[2].shape[0] != self.full.length:
                raise CacheStateError(f"scores of shape {tuple(v[2].shape)} do not fit {self.full.length} tokens")
            self.scores = v[2].astype(mx.float32)
        self._fit_scores()

    @property
    def meta_state(self):
        return (*SegmentedKVCache.meta_state.fget(self), str(self._tail))

    @meta_state.setter
    def meta_state(self, v):
        v = tuple(v)
        if len(v) != 3:
            raise CacheStateError(f"scored meta state must be (delta_q, evicted, contiguous_tail), got {v!r}")
        SegmentedKVCache.meta_state.fset(self, v[:2])
        try:
            tail = int(v[2])
        except (TypeError, ValueError):
            raise CacheStateError(f"contiguous_tail must be an integer, got {v[2]!r}") from None
        if not 0 <= tail <= self._held():
            raise CacheStateError(f"contiguous_tail {tail} is outside 0..{self._held()}")
        self._tail = tail

    def attention_sparsity(self) -> float | None:
        """Share of the accumulated attention mass on tokens the policy could evict (the middle)."""
        if not self.full.length:
            return None
        start, end = self.evictable()
        total = self.scores.sum().item()
        return self.scores[start:end].sum().item() / total if total > 0 else None


CACHE_CLASSES["scored"] = ScoredKVCache
