"""The attention-scored cache: equal to prealloc under its budget, sinks and recent window never
evicted, kept keys re-positioned exactly, scores that follow attention, state round trips."""

from __future__ import annotations

import mlx.core as mx
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cache import CacheSettings, make_caches
from cache.factory import restore_caches
from cache.scored import attend_scored
from tests.conftest import tiny_llama
from tests.test_cache import TOL, decode, random_ids

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@hsettings(max_examples=12, **FAST)
@given(n=st.integers(2, 150), prefill=st.integers(1, 40), seed=st.integers(0, 1000))
def test_budget_above_the_conversation_equals_prealloc(n, prefill, seed):
    model = tiny_llama(layers=2)
    ids = random_ids(n, seed=seed)
    prefill = min(prefill, n)
    small = dict(sinks=4, window=16, evict_chunk=16, max_kv_tokens=max(20, n + 1))
    scored = make_caches(model, CacheSettings(mode="scored", **small))
    full = make_caches(model, CacheSettings(mode="prealloc"))
    a, b = decode(model, scored, ids, prefill), decode(model, full, ids, prefill)
    assert scored[0].evicted == 0 and scored[0].offset == full[0].offset == n
    # float32 explicit softmax against the fused SDPA: equal up to rounding
    assert mx.abs(a - b).max().item() < TOL["full"]


@hsettings(max_examples=15, **FAST)
@given(sinks=st.integers(0, 6), window=st.integers(6, 30), chunk=st.integers(1, 12), extra=st.integers(0, 30),
       n=st.integers(40, 160), prefill=st.integers(1, 60), seed=st.integers(0, 1000))
def test_sinks_and_recent_window_are_never_evicted(sinks, window, chunk, extra, n, prefill, seed):
    model = tiny_llama(layers=1)
    s = CacheSettings(mode="scored", sinks=sinks, window=window, evict_chunk=chunk,
                      max_kv_tokens=sinks + window + extra)
    caches = make_caches(model, s)
    c = caches[0]
    ids = random_ids(n, seed=seed)
    held = []  # (index in the conversation) of every token the cache holds
    pos = 0
    steps = [ids[:prefill]] + [[t] for t in ids[prefill:]]
    for step in steps:
        before = c.evicted
        model(mx.array([step]), cache=caches)
        held += list(range(pos, pos + len(step)))
        pos += len(step)
        if c.offset and c.evicted > before:  # offset settles the policy
            gone = set(c.last_dropped)
            assert len(gone) == c.evicted - before
            assert all(sinks <= i < len(held) - window for i in gone)
            held = [t for i, t in enumerate(held) if i not in gone]
        assert len(held) == c.offset <= s.budget + chunk + len(step)
        first = list(range(min(sinks, pos)))
        last = list(range(max(0, pos - window), pos))
        assert held[: len(first)] == first and set(last) <= set(held)


def test_evicted_cache_equals_a_full_pass_over_what_it_holds():
    """One layer: after scored evictions (tokens gone from the middle of the sequence), logits
    equal a full pass over exactly the kept tokens: the per-token re-rotation is exact."""
    model = tiny_llama(layers=1)
    s = CacheSettings(mode="scored", sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
    caches = make_caches(model, s)
    ids = random_ids(200, seed=5)
    kept = list(ids[:10])
    model(mx.array([kept]), cache=caches)
    scattered = False
    for t in ids[10:]:
        before = caches[0].evicted
        got = model(mx.array([[t]]), cache=caches)[0, -1]
        want = model(mx.array([kept + [t]]))[0, -1]
        assert mx.abs(got - want).max().item() < 1e-3
        kept.append(t)
        if caches[0].offset and caches[0].evicted > before:
            gone = caches[0].last_dropped
            scattered |= gone != list(range(gone[0], gone[0] + len(gone)))
            kept = [x for i, x in enumerate(kept) if i not in set(gone)]
    assert caches[0].evicted > 0 and scattered  # it evicted, and not just the oldest run


def test_attention_mass_matches_sdpa_and_sums_to_queries():
    q = mx.random.normal((1, 8, 5, 64), key=mx.random.key(1))
    k = mx.random.normal((1, 2, 20, 64), key=mx.random.key(2))
    v = mx.random.normal((1, 2, 20, 64), key=mx.random.key(3))
    out, mass = attend_scored(q, k, v, 0.125, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    assert mx.abs(out - want).max().item() < 1e-4
    assert abs(mass.sum().item() - 8 * 5) < 1e-3  # every query head's row sums to one


def test_scored_state_round_trip_keeps_scores_and_evicts_alike():
    model = tiny_llama(layers=2)
    s = CacheSettings(mode="scored", sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
    live = make_caches(model, s)
    decode(model, live, random_ids(120, seed=2), prefill=30)
    assert live[0].evicted > 0
    restored = restore_caches(model, s, [c.state for c in live], [c.meta_state for c in live])
    assert mx.array_equal(restored[0].scores, live[0].scores).item()
    more = random_ids(30, seed=8)
    a = decode(model, live, more, prefill=1)
    b = decode(model, restored, more, prefill=1)
    assert mx.array_equal(a, b).item()
    assert (live[0].evicted, live[0].last_dropped) == (restored[0].evicted, restored[0].last_dropped)


def test_contiguous_tail_tracks_what_can_be_trimmed_and_survives_restore():
    model = tiny_llama(layers=1)
    s = CacheSettings(mode="scored", sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
    caches = make_caches(model, s)
    decode(model, caches, random_ids(100, seed=3), prefill=20)
    c = caches[0]
    tail = c.contiguous_tail
    assert c.evicted > 0 and s.window <= tail < c.offset - s.sinks
    assert c.trim(5) == 5 and c.contiguous_tail == tail - 5
    restored = restore_caches(model, s, [x.state for x in caches], [x.meta_state for x in caches])
    assert restored[0].contiguous_tail == tail - 5


def test_attention_sparsity_is_the_middle_share_and_shown_in_the_status_bar():
    from chatapp.engine.stats import CacheView
    from chatapp.ui.format import status_items

    model = tiny_llama(layers=1)
    s = CacheSettings(mode="scored", sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
    caches = make_caches(model, s)
    decode(model, caches, random_ids(90, seed=4), prefill=20)
    c = caches[0]
    share = c.attention_sparsity()
    start, end = c.evictable()
    want = c.scores[start:end].sum().item() / c.scores.sum().item()
    assert 0 < share < 1 and abs(share - want) < 1e-6
    items = status_items("m", "scored", None, CacheView(mode="scored", attention_sparsity=share))
    assert any(i.label == "attn on evictable" and i.value == f"{share:.0%}" for i in items)
    assert not any(i.label == "attn on evictable" for i in status_items("m", "window", None, CacheView(mode="window")))
