"""The attention-scored caches: keep the tokens attention uses (H2O / TOVA / SnapKV style eviction).

Two modes, one mechanism. ``scored``: layout and budget are the window modes' (sinks | middle |
recent window, at most ``max_kv_tokens`` after maintenance, eviction ``evict_chunk`` at a time),
but when the budget is passed the tokens dropped are the middle tokens with the lowest score
instead of the oldest ones. ``scored-quant``: the same with the middle held quantised (as
window-quant's), so at the KV bytes of a full-precision window it holds ~3.5x (8-bit) the
tokens, and chooses among them by attention. Sinks (and the pinned system prompt, see
CacheSettings.pinning) and the recent window are never evicted.

Why modes and not an option of window / window-quant: the window modes' middle is ordered by
age (the quantised middle keeps a single rotation delta for all its keys, see kv.py), which is
what lets them evict from the front without re-rotating quantised keys. Scored eviction removes
tokens from anywhere in the middle, so every kept key after an evicted one moves by its own
amount (per-token re-rotation, ``shift_each``). In scored-quant the moved keys are dequantised,
re-rotated and quantised again (values never move, so they are taken as stored): the one lossy
step, once per eviction that passes a key; 8-bit measured better than 4-bit at equal bytes
(SmolLM2, BENCHMARKS.md), so the bench's equal-bytes rows use 8. With keys per channel
(``kv_key_layout = "channel"``, quant_channel.py) the buffer re-groups the keys from the first
evicted token's group on; that measured worse than per-token keys here (17.86 against 17.81).

The score, and why (measured on SmolLM2-135M, KJV text, 1,536 tokens, budget 512, chunked
teacher forcing; window 512: ppl 18.98 after 512, full cache 18.75):
- Accumulated attention mass, summed over heads, decay 0.995 per query (the first version):
  19.21 with a recent window of 128, *worse* with more of the budget given to the recent window
  (19.28 at 256, 19.29 at 384), and no better with H2O's undecayed sum (19.34), TOVA's last
  query (19.47), value-norm weighting (19.27) or the max over KV heads (19.28). With all scores
  zero the policy is the window's and gives exactly window's 18.98, so the mechanics are right:
  the choice of tokens was the loss.
- What it lost to: scattered single tokens, moved to compact positions, read as garbled text.
  Keeping original positions (gaps, no re-rotation) recovered part of it (19.04-19.08) but runs
  positions past the trained context in a long chat; scoring *spans* recovered all of it: a
  token's score averaged over its +-4 neighbours (SnapKV's pooling) gives 18.94, below window
  (+-16 is too coarse: 19.06; +-2 and +-8 were not measured).
- Votes from the last ``OBSERVE`` = 16 queries at eviction time (SnapKV's observation window)
  measured the same as votes accumulated every step (19.29 against 19.28 unpooled), and need no
  probabilities from the attention that runs every step: attention goes through the segmented
  path, so the installed CPU decode / prefill kernels serve it, and decode costs what
  window-quant's does. At eviction time one pass of the kept queries over the held keys
  (``_votes``) gives the mass; earlier votes decay by 0.995 per token since.
Scores are kept per KV head ([kv_heads, held]) and summed over heads when choosing: per-head
eviction would make the token axis ragged (the buffers are one [batch, kv_heads, tokens,
head_dim] array).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from .kv import CACHE_CLASSES, CacheStateError, SegmentedKVCache, register_with_mlx_lm, tally
from .rope import Repositioner
from .settings import CacheSettings
from .sparsity import attention_mass

SCORE_DECAY = 0.995  # per token attended since the last votes; a horizon of ~200 tokens
OBSERVE = 16  # the last queries that vote at eviction time (SnapKV's observation window)
POOL = 4  # a token's score is the mean over its +-POOL neighbours (spans, not scattered tokens)


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


def _take(bufs, idx: mx.array) -> list[mx.array]:
    return [mx.take(b, idx, axis=2) for b in bufs]


class ScoredKVCache(SegmentedKVCache):
    """Sinks and a recent window always kept; past ``max_kv_tokens`` the least-attended middle
    tokens are evicted, ``evict_chunk`` at a time, and the kept keys move to compact positions.
    With ``quantize`` (the ``scored-quant`` mode) the middle is held quantised."""

    # The score (the module docstring says why): the last ``observe`` queries vote at eviction
    # time, earlier votes decay by ``decay`` per token since, and a token's score is the mean
    # over its +-``pool`` neighbours.
    decay = SCORE_DECAY
    observe = OBSERVE
    pool = POOL

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None, quantize: bool = False):
        super().__init__(settings, sinks=settings.sinks, window=settings.window, quantize=quantize,
                         budget=settings.budget, repositioner=repositioner)
        # [kv_heads, held] in sequence order: an MLX array, or float32 host memory where native
        # row ops serve the cache (``scores`` reads it as MLX either way; see _host)
        self._scores: mx.array | np.ndarray | None = None
        self.last_dropped: list[int] = []  # held indices the last eviction removed (tests, stats)
        # Trailing held tokens that follow each other in the conversation with nothing evicted
        # between them: only these can be trimmed and re-used token-exactly (the engine asks).
        self._tail = 0
        # The last ``observe`` queries (as the model rotated them) and their scale: the votes.
        # A native decode step's queries arrive as host floats (``keep_queries``) and join them when
        # they are read (_host_obs): an MLX op per layer and token would cost the fused step more
        # than its attention over a short history. Kept as MLX's route keeps them ([1, heads, L, D],
        # _obs_mx) or on the host ([heads, L, D] float32, _obs_np), never both.
        self._obs_mx: mx.array | None = None
        self._obs_np: np.ndarray | None = None
        self._obs_host: list = []
        self._scale = 1.0
        self._since = 0  # tokens attended since the scores were last brought up to date
        self._given_votes: np.ndarray | None = None  # take_votes: the next eviction's, computed

    @property
    def contiguous_tail(self) -> int:
        if self._pending:
            self._maintain()
        return self._tail

    # ---- where the scores and the voters live ---------------------------------------------
    # Through MLX (no native row ops: Metal, CUDA, a model the fused step does not serve) they
    # are MLX arrays, as they always were. Where native row ops serve the cache (the fused CPU
    # step) they are host float32: the votes come from numpy (NativeRowOps.votes), the choice of
    # rows to drop is made with numpy and the kept queries are turned by the native RoPE
    # (NativeRowOps.turn_rows), so MLX arrays there cost an eviction only their read-backs: a
    # small graph evaluated per layer and eviction for the scores, the kept queries and their
    # turn (SmolLM2's 30 layers: 12-25 ms of an eviction on the loaded 2-core Xeon; the tokens
    # chosen are the same, tests/test_scored_host.py).
    # False: the scores stay MLX arrays on every route, as before (the tests compare the two)
    host_scores = True

    @property
    def _host(self) -> bool:
        return self.native is not None and self.host_scores

    @property
    def scores(self) -> mx.array | None:
        """[kv_heads, held] float32 (an MLX array; held on the host where native ops serve)."""
        s = self._scores
        return mx.array(s) if isinstance(s, np.ndarray) else s

    @scores.setter
    def scores(self, value) -> None:
        self._scores = value

    def _scores_like(self, on_host: bool):
        """The scores as host float32 (``on_host``) or as an MLX array: converted once where the
        route changed (a restore, a cache the fused step took over)."""
        s = self._scores
        if s is not None and on_host != isinstance(s, np.ndarray):
            s = self._scores = np.array(s, np.float32) if on_host else mx.array(s)
        return s

    def _host_obs(self) -> np.ndarray | None:
        """The kept queries [heads, L, D] as host float32 (the decode steps' pending ones joined)."""
        if self._obs_mx is not None:  # kept by MLX's route: read back once
            self._obs_np, self._obs_mx = np.array(self._obs_mx[0].astype(mx.float32)), None
        if self._obs_host:
            host = self._obs_host[-self.observe:]
            q = np.stack(host, axis=1).astype(np.float32, copy=False)  # [heads, L, D]
            self._obs_host = []
            if self._obs_np is not None and q.shape[1] < self.observe:
                q = np.concatenate([self._obs_np, q], axis=1)
            self._obs_np = q[:, -self.observe:, :]
        return self._obs_np

    @property
    def _obs(self) -> mx.array | None:
        """The kept queries [1, heads, L, D] as MLX's route reads them."""
        if self._obs_host or self._obs_np is not None:
            q = self._host_obs()
            return mx.array(q[None])
        return self._obs_mx

    @_obs.setter
    def _obs(self, value: mx.array | None) -> None:
        self._obs_mx, self._obs_np, self._obs_host = value, None, []

    def _observed(self) -> int:
        """How many queries are kept (0: none)."""
        q = self._obs_np if self._obs_np is not None else self._obs_mx
        kept = 0 if q is None else q.shape[-2]
        return min(self.observe, kept + len(self._obs_host)) if self._obs_host else kept

    def _arrived(self, n: int) -> None:
        super()._arrived(n)
        self._tail += n
        # the new tokens' zero scores are added when the scores are next read (_fit_scores): an
        # MLX concatenate per layer and decode step cost the fused step ~0.6 ms a token and
        # chained a graph as long as the time to the next eviction
        if self._scores is None:
            self._fit_scores(self.full.keys.shape[1])

    def keep_queries(self, queries, scale: float) -> None:
        """A native decode step's roped queries (host floats [heads, D]): the next votes."""
        super().keep_queries(queries, scale)
        self._obs_host.append(queries)
        if len(self._obs_host) > 2 * self.observe:
            del self._obs_host[:-self.observe]
        self._scale, self._since = scale, self._since + 1

    @property
    def chunk_queries_kept(self) -> int:
        return self.observe

    def keep_chunk_queries(self, queries, scale: float, n_tokens: int) -> None:
        """A native prefill chunk's last roped queries (host floats [n, heads, D]): kept as
        ``attend`` keeps a chunk's, on the host."""
        q = np.array(queries.transpose(1, 0, 2), np.float32)  # [heads, n, D], a copy of its own
        prev = self._host_obs()
        if prev is not None and q.shape[1] < self.observe:
            q = np.concatenate([prev, q], axis=1)
        self._obs_np = q[:, -self.observe:, :]
        self._scale, self._since = scale, self._since + n_tokens

    def _keep_chunk(self, queries: mx.array, scale: float, n_tokens: int) -> None:
        """The last ``observe`` of the kept queries and ``queries`` ([1, heads, L, D], a chunk's
        last L of its ``n_tokens``) become the votes."""
        q, prev = queries, self._obs
        if prev is not None and q.shape[2] < self.observe:
            q = mx.concatenate([prev.astype(q.dtype), q], axis=2)
        self._obs = q[:, :, -self.observe:, :]
        self._scale, self._since = scale, self._since + n_tokens

    def _fit_scores(self, heads: int | None = None) -> None:
        """Scores for every held token: new tokens start at zero (they sit in the protected recent
        window while they gather mass), trimmed ones go."""
        held = self._held()
        s = self._scores
        if s is None:
            if heads is None:
                return
            s = np.zeros((heads, 0), np.float32) if self._host else mx.zeros((heads, 0), mx.float32)
        n = held - s.shape[1]
        if n > 0:
            if isinstance(s, np.ndarray):
                s = np.concatenate([s, np.zeros((s.shape[0], n), np.float32)], axis=1)
            else:
                s = mx.concatenate([s, mx.zeros((s.shape[0], n), mx.float32)], axis=1)
        elif n < 0:
            s = s[:, :held]
        self._scores = s

    def token_scores(self) -> mx.array:
        """One score per held token ([held]): summed over KV heads, averaged over neighbours."""
        t = self._token_scores()
        return mx.array(t) if isinstance(t, np.ndarray) else t

    def _token_scores(self) -> mx.array | np.ndarray:
        """token_scores where the scores live: numpy's operations on host scores are MLX's, in
        the same order (float32 sums over the heads, a running sum, one division), so the same
        bits (tests/test_scored_host.py)."""
        if self._scores is None:
            return np.zeros((self._held(),), np.float32) if self._host else mx.zeros((self._held(),), mx.float32)
        self._fit_scores()
        if isinstance(self._scores, np.ndarray):
            t = self._scores.sum(axis=0)
            if self.pool:
                c = np.concatenate([np.zeros((1,), np.float32), np.cumsum(t, dtype=np.float32)])
                i = np.arange(t.shape[0])
                lo, hi = np.maximum(i - self.pool, 0), np.minimum(i + self.pool + 1, t.shape[0])
                t = (c[hi] - c[lo]) / (hi - lo).astype(np.float32)
            return t
        t = self._scores.sum(axis=0)
        if self.pool:
            c = mx.concatenate([mx.zeros((1,), mx.float32), mx.cumsum(t)])
            i = mx.arange(t.shape[0])
            lo, hi = mx.maximum(i - self.pool, 0), mx.minimum(i + self.pool + 1, t.shape[0])
            t = (c[hi] - c[lo]) / (hi - lo).astype(mx.float32)
        return t

    def attend(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The segmented cache's attention (the installed kernels serve it); the step's last
        queries are kept as the next eviction's votes."""
        out = super().attend(queries, scale, mask)
        self._keep_chunk(queries, scale, queries.shape[2])
        # Evaluated with the step's output: left lazy, each step's kept queries would hold the
        # graph of the step before (a chain as long as the time to the next eviction).
        return mx.depends(out, self._obs)

    def _votes(self) -> mx.array | None:
        """Attention mass per KV head and held token ([kv_heads, held]) from the kept queries,
        which are the last held tokens' (causal among themselves): host float32 where native ops
        give them, else an MLX array."""
        if not self._voters_ready():
            return None
        if self._given_votes is not None:  # asked for with every layer's (vote_request)
            mass, self._given_votes = self._given_votes, None
            return mass
        if self.native is not None:
            mass = self.native.votes(self.full, self.quant, self.sinks, self._host_obs(), self._scale)
            if mass is not None:
                return mass
        k, _ = self.full.view()
        if self._quant_len():  # scored never rotates its middle as a whole: no delta_q here
            qk, _ = self.quant.packed()
            if self.quant.kind == "quant":
                mid = mx.dequantize(*qk, group_size=self.quant.group_size, bits=self.quant.bits)
            else:
                mid = qk.dequantized()
            s = self.sinks
            k = mx.concatenate([k[..., :s, :], mid.astype(k.dtype), k[..., s:, :]], axis=2)
        return attention_mass(self._obs, k, self._scale)

    def _voters_ready(self) -> bool:
        """Whether kept queries can vote over what is held (some kept, none past the held tokens)."""
        held, seen = self._held(), self._observed()
        return bool(seen and held and seen <= held)

    def _update_scores(self) -> None:
        votes = self._votes()
        if votes is None:
            return
        self._fit_scores(votes.shape[0])
        on_host = self._host
        if on_host != isinstance(votes, np.ndarray):  # MLX's votes where native ones declined, or
            votes = np.array(votes, np.float32) if on_host else mx.array(votes)  # native ones kept on MLX
        scores = self._scores_like(on_host)
        # float32 times the decay as float32 (a Python float is weak in both), plus the votes
        self._scores = scores * (self.decay ** self._since) + votes
        self._since = 0

    def trim(self, n: int) -> int:
        done = super().trim(n)
        self._obs = None  # the voters may be among the trimmed tokens
        self._tail = max(0, self._tail - done)
        self._fit_scores()
        return done

    def evictable(self) -> tuple[int, int]:
        """The [start, end) range of held tokens the policy may evict (the middle)."""
        s = min(self.sinks, self.full.length)
        end = self._held() - (self.window or 0)
        if self.quant is not None and self.quant.kind != "quant":
            # per-channel keys are quantised in whole groups: the rest waits in the recent window
            end = min(end, s + self._quant_len())
        return s, max(s, end)

    def _maintain(self) -> None:
        self._pending = False
        self._flush_before_eviction()
        if self._evict_due():
            self._evict(self._held() - self.budget)
        self._given_votes = None

    def _flush_before_eviction(self) -> None:
        """The flushes due before an eviction (done once: after them none is due)."""
        if self._flush_due():
            self._flush(self._recent() - (self.window or 0))
        if self._evict_due() and self.quant is not None and self._recent() > (self.window or 0):
            self._flush(self._recent() - (self.window or 0))  # the whole middle is quantised

    # ---- every layer's votes at once (cache.layers.settle, before a native step and a cache view):
    # one layer's 3 KV heads on 2 threads left a thread idle a third of the time, and a pool
    # dispatch per layer cost more than one for all 30
    def vote_request(self) -> tuple | None:
        """What the maintenance now due will ask ``native.votes`` for (native, full, quant,
        sinks, queries, scale), after the flushes that come before it; None where no eviction is
        due or no native row ops serve the cache. ``take_votes`` then hands the answer back."""
        if not self._pending or self.native is None:
            return None
        self._flush_before_eviction()
        start, end = self.evictable()
        if not self._evict_due() or end <= start or not self._voters_ready():
            return None
        return self.native, self.full, self.quant, self.sinks, self._host_obs(), self._scale

    def take_votes(self, mass: np.ndarray | None) -> None:
        """The votes ``vote_request`` asked for, read by the eviction ``settle`` runs next."""
        self._given_votes = mass

    def _evict(self, n: int) -> None:
        """Drop the ``n`` least-attended middle tokens; each kept key moves back by the number of
        tokens evicted before it."""
        start, end = self.evictable()
        n = min(n, end - start)
        if n <= 0:
            return
        held = self._held()
        self._update_scores()
        mid = np.array(self._token_scores()[start:end])
        # Least mass first; ties (e.g. tokens absorbed by a conversion, all at zero) go to the
        # oldest, so with no scores the policy is the window's.
        dropped = start + np.sort(np.lexsort((np.arange(len(mid)), mid))[:n])
        self.last_dropped = dropped.tolist()
        kept = np.ones(held, bool)
        kept[dropped] = False
        keep = np.flatnonzero(kept)
        deltas = -np.cumsum(~kept)[keep]  # minus the tokens evicted before each kept one
        if self.quant is None:
            if self.native is None or not self.native.select_full(self.full, keep, deltas, start):
                self._evict_full(keep, deltas, held)
        else:
            self._evict_quantised(keep, deltas, start)
        self._after_eviction(keep, n, held)

    def _evict_full(self, keep: np.ndarray, deltas: np.ndarray, held: int) -> None:
        """Keep the tokens ``keep``, each key moved by its own delta, through MLX."""
        idx = mx.array(keep.astype(np.int32))
        k, v = self.full.view()
        k, v = mx.take(k, idx, axis=2), mx.take(v, idx, axis=2)
        k = shift_each(self.repos, k, mx.array(deltas.astype(np.int32)))
        self.full.trim(held)
        self.full.append(k, v)

    def _after_eviction(self, keep: np.ndarray, n: int, held: int) -> None:
        """Scores, voters and counts follow the kept tokens ``keep`` of ``held``, ``n`` evicted."""
        if isinstance(self._scores, np.ndarray):
            s = self._scores  # [heads, held] as the eviction read them (_token_scores fitted them)
            if s.shape[1] < held:
                s = np.concatenate([s, np.zeros((s.shape[0], held - s.shape[1]), np.float32)], axis=1)
            self._scores = s[:, keep]
        else:
            # (the fit trims the scores to the tokens now held, a view of the buffer that still
            # holds them all: the gather reads the kept ones' scores from it)
            self._fit_scores(self.full.keys.shape[1])
            self._scores = self._scores[:, mx.array(keep.astype(np.int32))]
        # the voters sit in the recent window, which moved back by n: turned on the host where
        # they are kept there and native ops serve, else through MLX
        if self._obs_host or self._obs_np is not None:
            q = np.array(self._host_obs(), np.float32, order="C")  # a copy, turned in place
            if self._host and self.native.turn_rows(q, -n):
                self._obs_np = q
            else:
                self._obs = self.repos.shift(mx.array(q[None]), -n)
        elif self._obs_mx is not None:
            self._obs = self.repos.shift(self._obs_mx, -n)
        self.evicted += n
        tally(self.evicted_by, self.mode, n)
        self._tail = min(self._tail, held - 1 - self.last_dropped[-1])

    def _evict_quantised(self, keep_all: np.ndarray, deltas_all: np.ndarray, start: int) -> None:
        """Evict from the quantised middle (all evictable tokens are there, see _maintain).

        Values are taken as stored. Keys before the first evicted token keep their packed
        form; those after it are dequantised, moved each by its own delta and quantised again
        (the one lossy step: a kept key is re-quantised once per eviction that passes it)."""
        q, s = self.quant, start
        nq = q.length
        first = self.last_dropped[0] - s  # middle index of the first evicted token
        in_mid = (keep_all >= s) & (keep_all < s + nq)
        if self.native is not None and self.native.select(q, keep_all[in_mid] - s, deltas_all[in_mid], first):
            self._move_window(-(nq - q.length))
            return
        pairs = [(i - s, d) for i, d in zip(keep_all.tolist(), deltas_all.tolist()) if s <= i < s + nq]
        keep = [i for i, _ in pairs]
        if q.kind != "quant":  # per-channel keys: the buffer re-groups what moved
            q.select(keep, [d for _, d in pairs], lambda k, d: shift_each(self.repos, k, d))
        elif not keep:
            q.hold(None, None, 0)
        else:
            packed_k, packed_v = q.packed()
            before = [i for i in keep if i < first]
            after = [(i, d) for i, d in pairs if i > first]
            parts = []
            if before:
                parts.append(_take(packed_k, mx.array(before, mx.int32)))
            if after:
                kd = mx.dequantize(*_take(packed_k, mx.array([i for i, _ in after], mx.int32)),
                                   group_size=q.group_size, bits=q.bits)
                kd = shift_each(self.repos, kd, mx.array([d for _, d in after], mx.int32))
                parts.append(list(mx.quantize(kd, group_size=q.group_size, bits=q.bits)))
            keys = [mx.concatenate([p[j] for p in parts], axis=2) for j in range(3)] if len(parts) > 1 else parts[0]
            q.hold(keys, _take(packed_v, mx.array(keep, mx.int32)), len(keep))
        # the recent window after the middle moves back by all the tokens evicted
        self._move_window(-(nq - len(keep)))

    # ---- persistence: the segmented state plus the scores and the voters, so a restored cache
    # evicts as the saved one would: [keys, values(, 6 quantised arrays), scores(, queries)]
    @property
    def state(self):
        if self._pending:  # settle first: a restore would, and the scores must match the tokens
            self._maintain()
        if not self._held():
            return []
        self._fit_scores(self.full.view()[0].shape[1])
        obs = self._obs
        extra = [self.scores] + ([obs] if obs is not None else [])
        return [*SegmentedKVCache.state.fget(self), *extra]

    @state.setter
    def state(self, v):
        v = list(v)
        if len(v) not in (0, 2, 3, 4, 8, 9, 10):
            raise CacheStateError(f"expected 0, 2-4 or 8-10 state arrays for {self.mode}, got {len(v)}")
        n_seg = 0 if not v else (2 if len(v) < 8 else 8)
        scores = v[n_seg] if len(v) > n_seg else None
        obs = v[n_seg + 1] if len(v) > n_seg + 1 else None
        SegmentedKVCache.state.fset(self, v[:n_seg])
        self.scores, self._obs = None, None
        if v:
            heads, held = v[0].shape[1], self._held()
            if scores is not None and scores.ndim == 1:  # saved before scores were kept per head
                scores = mx.broadcast_to(scores[None] / heads, (heads, scores.shape[0]))
            if scores is not None:
                if scores.ndim != 2 or scores.shape != (heads, held):
                    raise CacheStateError(f"scores of shape {tuple(scores.shape)} do not fit {heads} heads x "
                                          f"{held} tokens")
                self.scores = scores.astype(mx.float32)
            if obs is not None:
                if obs.ndim != 4 or obs.shape[-1] != v[0].shape[-1] or not 0 < obs.shape[2] <= held:
                    raise CacheStateError(f"saved queries of shape {tuple(obs.shape)} do not fit this cache")
                self._obs = obs
            self._fit_scores(heads)
        self._pending = self._needs_maintenance()

    @property
    def meta_state(self):
        return (*SegmentedKVCache.meta_state.fget(self), str(self._tail), str(self._since), repr(self._scale))

    @meta_state.setter
    def meta_state(self, v):
        v = tuple(v)
        if len(v) not in (3, 5):
            raise CacheStateError(f"scored meta state must be (delta_q, evicted, contiguous_tail[, since, scale]), "
                                  f"got {v!r}")
        SegmentedKVCache.meta_state.fset(self, v[:2])
        try:
            tail = int(v[2])
            since, scale = (int(v[3]), float(v[4])) if len(v) == 5 else (0, 1.0)
        except (TypeError, ValueError):
            raise CacheStateError(f"contiguous_tail, since and scale must be numbers, got {v[2:]!r}") from None
        if not 0 <= tail <= self._held():
            raise CacheStateError(f"contiguous_tail {tail} is outside 0..{self._held()}")
        self._tail, self._since, self._scale = tail, max(0, since), scale

    def attention_sparsity(self) -> float | None:
        """Share of the accumulated attention mass on tokens the policy could evict (the middle)."""
        votes = self._votes() if self._held() else None
        if votes is None:
            return None
        start, end = self.evictable()
        scores = votes.sum(axis=0)
        total = float(scores.sum())
        return float(scores[start:end].sum()) / total if total > 0 else None


class ScoredQuantKVCache(ScoredKVCache):
    """``scored`` over a quantised middle: at the bytes of a full-precision window it holds
    2-4x the tokens, and chooses which of them to keep by attention."""

    def __init__(self, settings: CacheSettings, repositioner: Repositioner | None = None):
        super().__init__(settings, repositioner, quantize=True)


CACHE_CLASSES["scored"] = ScoredKVCache
CACHE_CLASSES["scored-quant"] = ScoredQuantKVCache
register_with_mlx_lm(ScoredKVCache, ScoredQuantKVCache)
