"""The scored caches' scores and kept queries on the host where native row ops serve them
(cache/scored.py, ``host_scores``): the same numbers as the MLX arrays they were before, and an
eviction on the fused route that runs no MLX operation in scored.py (no array read back)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cache import CacheSettings  # noqa: E402
from cache.rope import Repositioner  # noqa: E402
from cache.scored import ScoredKVCache  # noqa: E402
from tests.test_fused_policies import _close, _pair, _Run, _settings  # noqa: E402


class _Ops:
    """Stands in for native row ops: only whether any is installed matters to the scores' home."""


def _bare(host: bool, held: int) -> ScoredKVCache:
    c = ScoredKVCache(CacheSettings(mode="scored", sinks=2, window=8, evict_chunk=4, max_kv_tokens=32))
    c.native = _Ops() if host else None
    c._held = lambda: held
    return c


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 5), held=st.integers(1, 700), since=st.integers(0, 400), scale=st.floats(1e-3, 1e3),
       seed=st.integers(0, 10_000))
def test_host_scores_equal_the_mlx_arrays_bit_for_bit(heads, held, since, scale, seed):
    """The decay and the votes' sum, the sum over heads, the running sum and the +-pool mean:
    numpy's float32 operations on host scores give MLX's bits, so the tokens chosen are the same."""
    rng = np.random.default_rng(seed)
    old = (rng.random((heads, max(0, held - int(rng.integers(0, 5))))) * scale).astype(np.float32)
    votes = (rng.random((heads, held)) * scale).astype(np.float32)
    got = []
    for host in (False, True):
        c = _bare(host, held)
        c._scores = old.copy() if host else mx.array(old)
        c._since = since
        c._votes = (lambda v: lambda: v)(votes if host else mx.array(votes))
        c._update_scores()
        assert isinstance(c._scores, np.ndarray) == host
        got.append((np.array(c._scores), np.array(c._token_scores()), np.array(c.token_scores())))
    for a, b in zip(*got):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b)


def test_scores_move_between_homes_once():
    """Scores an MLX route left (a restore) are read back once when native ops serve the cache,
    and go back to MLX when they no longer do; ``scores`` reads MLX arrays either way."""
    c = _bare(True, 6)
    c._scores = mx.arange(12, dtype=mx.float32).reshape(2, 6)
    c._votes = lambda: np.ones((2, 6), np.float32)
    c._since = 0
    c._update_scores()
    assert isinstance(c._scores, np.ndarray) and c._scores[1, 5] == 12.0
    assert isinstance(c.scores, mx.array) and c.scores.tolist() == c._scores.tolist()
    c.native = None
    c._votes = lambda: mx.ones((2, 6))
    c._update_scores()
    assert isinstance(c._scores, mx.array) and c._scores[1, 5].item() == 13.0


def test_turn_rows_moves_queries_as_the_models_rope():
    """NativeRowOps.turn_rows turns kept queries back as Repositioner.shift does through MLX's RoPE
    (both pairings), in place; it declines rows that are not float32 pairs."""
    from chatapp.backend.kv_native import NativeRowOps

    D = 64
    rng = np.random.default_rng(3)
    x = rng.standard_normal((9, 16, D)).astype(np.float32)
    for traditional in (False, True):
        ops = NativeRowOps((1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32), traditional)
        repos = Repositioner(lambda a, offset, t=traditional: mx.fast.rope(a, D, traditional=t, base=10000,
                                                                           scale=1.0, offset=offset))
        for delta in (-1, -37, -1000):
            y = x.copy()
            assert ops.turn_rows(y, delta)
            want = np.array(repos.shift(mx.array(x[None]), delta))[0]
            # the angles' float32 rounding differs from MLX's (as the keys' native turn's does)
            assert np.abs(y - want).max() <= 1e-4 * np.abs(want).max()
            assert not np.array_equal(y, x)
    assert not ops.turn_rows(x.astype(np.float16), -3)
    assert not ops.turn_rows(x[..., :-1], -3)  # an odd head_dim has no pairs


@pytest.mark.parametrize("mode", ["scored", "scored-quant"])
def test_an_eviction_on_the_fused_route_runs_no_mlx_op_in_scored(mode, monkeypatch):
    """On the fused route the votes, the choice of rows and the voters' turn run on host arrays:
    with every MLX name scored.py reaches made to fail, the due evictions still run."""
    import cache.scored as scored

    _, fast = _pair()
    run = _Run(fast, _settings(mode))
    run.prefill(list(range(3, 40)))
    for t in range(8):
        run.step((5 * t) % 97)
    run.prefill(list(range(50, 80)))  # past the budget: an eviction is due
    assert all(c._pending for c in run.caches)

    class _NoMLX:
        def __getattr__(self, name):
            raise AssertionError(f"scored.py used mx.{name} during a native eviction")

    monkeypatch.setattr(scored, "mx", _NoMLX())
    before = [c.evicted for c in run.caches]
    for c in run.caches:
        c.settle()
    assert all(c.evicted > b for c, b in zip(run.caches, before))
    assert all(isinstance(c._scores, np.ndarray) and c._obs_mx is None for c in run.caches)


_ops = st.lists(st.one_of(st.tuples(st.just("prefill"), st.integers(2, 20)),
                          st.tuples(st.just("decode"), st.integers(1, 24)),
                          st.tuples(st.just("trim"), st.integers(1, 6)),
                          st.tuples(st.just("snapshot"), st.just(0))), min_size=3, max_size=8)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["scored", "scored-quant"]), bits=st.sampled_from([4, 8]), ops=_ops,
       seed=st.integers(0, 10_000))
def test_host_scores_evict_as_the_mlx_scores_did(mode, bits, ops, seed):
    """Two fused models fed the same tokens, one keeping its scores as MLX arrays (the route
    before ``host_scores``), one on the host: after random prefills, decode steps, trims and
    snapshots they evict the same tokens at the same times, and their scores, voters and logits
    agree (the voters' turn after an eviction is the native RoPE's rather than MLX's: ~1e-7)."""
    runs = []
    for host in (False, True):
        _, fast = _pair()
        runs.append(_Run(fast, _settings(mode, bits)))
        runs[-1].host = host
    rng = np.random.default_rng(seed)

    def homes(run):
        for c in run.caches:
            c.host_scores = run.host

    dropped = [[], []]
    for op, arg in [("prefill", 6)] + ops + [("decode", 70)]:
        tokens = rng.integers(1, 97, size=arg).tolist()
        for i, run in enumerate(runs):
            homes(run)
            if op == "prefill":
                out = [run.prefill(tokens)]
            elif op == "decode":
                out = []
                for t in tokens:
                    out.append(run.step(t))
                    dropped[i].append((run.caches[0].evicted, tuple(run.caches[0].last_dropped)))
            elif op == "trim":
                run.trim(arg)
                out = []
            else:
                run.snapshot_restore()
                homes(run)
                out = []
            run.out = out
        for a, b in zip(runs[0].out, runs[1].out):
            assert _close(b, a, 1e-4)
    assert dropped[0] == dropped[1]
    for a, b in zip(*(r.caches for r in runs)):
        a.settle()
        b.settle()
        assert a.evicted == b.evicted > 0 and a.last_dropped == b.last_dropped
        assert (a._scores is None) == (b._scores is None)
        if a._scores is not None:
            assert isinstance(a._scores, mx.array)
            assert _close(np.array(b.scores), np.array(a.scores), 1e-4)
        if a._obs is not None:
            assert _close(np.array(b._obs), np.array(a._obs), 1e-4)


@pytest.mark.parametrize("mode", ["scored", "scored-quant"])
def test_a_native_step_settles_every_layers_votes_in_one_map(mode, monkeypatch):
    """cache.layers.settle asks every layer for its votes first and runs them as one pool map (a layer's
    3 KV heads on 2 threads left a thread idle): the same tokens evicted, and the same scores, as
    each layer settled on its own."""
    from cache.layers import settle
    from chatapp.backend.kv_native import NativeRowOps

    _, fast = _pair()
    runs = []
    for _ in range(2):
        run = _Run(fast, _settings(mode))
        run.prefill(list(range(3, 40)))
        for t in range(8):
            run.step((5 * t) % 97)
        run.prefill(list(range(50, 80)))  # past the budget: an eviction is due
        runs.append(run)
    assert len(runs[0].caches) > 1 and all(c._pending for c in runs[0].caches)
    for c in runs[0].caches:
        c.settle()
    maps = []
    real = NativeRowOps.votes_many
    monkeypatch.setattr(NativeRowOps, "votes_many", lambda self, rs: maps.append(len(rs)) or real(self, rs))
    ops = {id(c.native): c.native for c in runs[1].caches}  # (layers of one RoPE share theirs)
    counted = {k: o.done.get("votes", 0) for k, o in ops.items()}
    settle(runs[1].caches)
    assert maps == [len(runs[1].caches)]
    # each layer's votes counted on its own ops, as when it settled alone
    assert {k: o.done.get("votes", 0) - counted[k] for k, o in ops.items()} == {
        k: sum(c.native is o for c in runs[1].caches) for k, o in ops.items()}
    for a, b in zip(*(r.caches for r in runs)):
        assert b.evicted == a.evicted > 0 and b.last_dropped == a.last_dropped
        assert np.array_equal(a._scores, b._scores) and b._given_votes is None
