"""The attention-scored cache: equal to prealloc under its budget, sinks and recent window never
evicted, kept keys re-positioned exactly, scores that follow attention, state round trips."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cache import CacheSettings, make_caches
from cache.factory import restore_caches
from cache.sparsity import attention_mass
from tests.conftest import tiny_llama
from tests.test_cache import TOL, decode, drop, random_ids

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


@hsettings(max_examples=8, **FAST)
@given(n=st.integers(2, 150), prefill=st.integers(1, 40), seed=st.integers(0, 1000))
def test_scored_quant_under_its_budget_is_window_quant(n, prefill, seed):
    """Below its budget scored-quant quantises exactly what window-quant does and evicts nothing:
    the same logits (both MLX attention over the same packed middle), and prealloc's up to 8-bit."""
    model = tiny_llama(layers=2)
    ids = random_ids(n, seed=seed)
    prefill = min(prefill, n)
    small = dict(sinks=4, window=16, evict_chunk=16, max_kv_tokens=max(20, n + 1))
    sq = make_caches(model, CacheSettings(mode="scored-quant", **small))
    wq = make_caches(model, CacheSettings(mode="window-quant", **small))
    a, b = decode(model, sq, ids, prefill), decode(model, wq, ids, prefill)
    assert sq[0].evicted == 0 and sq[0].offset == n
    assert sq[0].usage().quant_tokens == wq[0].usage().quant_tokens
    assert mx.abs(a - b).max().item() < 1e-3
    full = decode(model, make_caches(model, CacheSettings(mode="prealloc")), ids, prefill)
    assert mx.abs(a - full).max().item() < TOL[8]


@pytest.mark.parametrize("mode", ["scored", "scored-quant"])
@hsettings(max_examples=10, **FAST)
@given(sinks=st.integers(0, 6), window=st.integers(6, 30), chunk=st.integers(1, 12), extra=st.integers(0, 30),
       n=st.integers(40, 160), prefill=st.integers(1, 60), seed=st.integers(0, 1000))
def test_sinks_and_recent_window_are_never_evicted(mode, sinks, window, chunk, extra, n, prefill, seed):
    model = tiny_llama(layers=1)
    s = CacheSettings(mode=mode, sinks=sinks, window=window, evict_chunk=chunk,
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


@pytest.mark.parametrize("mode, bits, limit", [("scored", 8, 1e-3), ("scored-quant", 8, TOL[8]),
                                               ("scored-quant", 4, TOL[4])])
def test_evicted_cache_equals_a_full_pass_over_what_it_holds(mode, bits, limit):
    """One layer: after scored evictions (tokens gone from the middle of the sequence), logits
    equal a full pass over exactly the kept tokens: the per-token re-rotation is exact (up to
    the quantisation of the middle for scored-quant, whose moved keys are re-quantised)."""
    model = tiny_llama(layers=1)
    s = CacheSettings(mode=mode, sinks=4, window=24, evict_chunk=8, max_kv_tokens=56, kv_bits=bits)
    caches = make_caches(model, s)
    ids = random_ids(200, seed=5)
    kept = list(ids[:10])
    model(mx.array([kept]), cache=caches)
    scattered = False
    for t in ids[10:]:
        before = caches[0].evicted
        got = model(mx.array([[t]]), cache=caches)[0, -1]
        want = model(mx.array([kept + [t]]))[0, -1]
        assert mx.abs(got - want).max().item() < limit
        kept.append(t)
        if caches[0].offset and caches[0].evicted > before:
            gone = caches[0].last_dropped
            scattered |= gone != list(range(gone[0], gone[0] + len(gone)))
            kept = [x for i, x in enumerate(kept) if i not in set(gone)]
    assert caches[0].evicted > 0 and scattered  # it evicted, and not just the oldest run
    if mode == "scored-quant":
        assert caches[0].usage().quant_tokens > 0


def test_attention_mass_matches_the_softmax_and_sums_to_queries():
    q = mx.random.normal((1, 8, 5, 64), key=mx.random.key(1))
    k = mx.random.normal((1, 2, 20, 64), key=mx.random.key(2))
    mass = attention_mass(q, k, 0.125)
    s = (q.reshape(1, 2, 4, 5, 64) * 0.125) @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    causal = mx.arange(15, 20)[:, None] >= mx.arange(20)[None]
    want = mx.softmax(mx.where(causal, s, -1e30), axis=-1).sum(axis=(0, 2, 3))
    assert mass.shape == (2, 20) and mx.abs(mass - want).max().item() < 1e-5
    assert abs(mass.sum().item() - 8 * 5) < 1e-3  # every query head's row sums to one


@pytest.mark.parametrize("mode", ["scored", "scored-quant"])
def test_scored_state_round_trip_keeps_scores_and_evicts_alike(mode):
    model = tiny_llama(layers=2)
    s = CacheSettings(mode=mode, sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
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
    scores = c._votes().sum(axis=0)  # the last queries' attention, summed over KV heads
    want = scores[start:end].sum().item() / scores.sum().item()
    assert 0 < share < 1 and abs(share - want) < 1e-6
    items = status_items("m", "scored", None, CacheView(mode="scored", attention_sparsity=share))
    assert any(i.label == "attn on evictable" and i.value == f"{share:.0%}" for i in items)
    assert not any(i.label == "attn on evictable" for i in status_items("m", "window", None, CacheView(mode="window")))


@pytest.mark.parametrize("mode", ["window", "window-quant"])
def test_window_modes_report_the_share_of_the_last_queries_on_what_they_evict_next(mode):
    """The window modes keep their last decode steps' queries (no work per step) and attend them
    over what is held when asked: the share on the middle (window-quant) or on the oldest
    evict_chunk non-sink tokens (window), equal to a direct softmax over the dequantised keys."""
    from cache.sparsity import evictable

    model = tiny_llama(layers=1)
    s = CacheSettings(mode=mode, sinks=4, window=24, evict_chunk=8, max_kv_tokens=56, kv_group_size=32)
    c = make_caches(model, s)[0]
    assert c.attention_sparsity() is None  # nothing attended yet
    k, v = mx.random.normal((1, 2, 70, 64), key=mx.random.key(1)), mx.random.normal((1, 2, 70, 64))
    c.absorb(k, v)
    assert c.offset and c.evicted > 0  # settled: it evicted (and window-quant quantised)
    q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(2))
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    c.attend(q, 0.125, None)
    start, end = evictable(c)
    assert end > start
    keys, _ = c.content()
    p = mx.softmax((q.reshape(1, 2, 4, 1, 64) * 0.125) @ mx.expand_dims(keys, 2).swapaxes(-1, -2), axis=-1)
    mass = p.sum(axis=(0, 1, 2, 3))
    want = mass[start:end].sum().item() / mass.sum().item()
    assert abs(c.attention_sparsity() - want) < 1e-5
    if mode == "window":
        assert (start, end) == (4, 12)  # the next eviction's evict_chunk oldest non-sink tokens
    else:
        assert (start, end) == (4, c.offset - 24) and c.usage().quant_tokens > 0
    c.trim(1)
    assert c.attention_sparsity() is None  # the recorded query was trimmed
    prealloc = make_caches(model, CacheSettings(mode="prealloc"))[0]
    assert prealloc.attention_sparsity() is None


MODES_ALL = ["concat", "prealloc", "quantized", "window", "window-quant", "scored", "scored-quant"]


@pytest.mark.parametrize("other", MODES_ALL)
def test_conversion_to_and_from_scored_quant_keeps_what_is_held(other):
    """scored-quant after evictions -> every mode: what is held survives (or, for a mode that
    keeps everything, a re-prefill is asked for); every mode -> scored-quant with room: the
    same tokens, and the next logits equal the source's up to 8-bit quantisation."""
    from cache import convert_caches

    model = tiny_llama(layers=1)
    small = dict(sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
    # window's budget is sinks + window: give it the room the others get from max_kv_tokens
    big = dict(sinks=4, window=196 if other == "window" else 24, evict_chunk=8, max_kv_tokens=200)
    ids = random_ids(120, seed=11)
    src = make_caches(model, CacheSettings(mode="scored-quant", **small))
    decode(model, src, ids, prefill=30)
    assert src[0].evicted > 0
    conv = convert_caches(src, model, CacheSettings(mode=other, **big))
    if CacheSettings(mode=other).budget is None:
        assert conv.action == "reprefill"
    else:
        assert conv.action == "converted" and conv.caches[0].offset == src[0].offset
        k0, v0 = src[0].content()
        k1, v1 = conv.caches[0].content()
        assert mx.abs(k0 - k1).max().item() < 0.05 and mx.abs(v0 - v1).max().item() < 0.05
    # the other way: a cache of ``other`` that holds 80 tokens, into scored-quant with room
    first = make_caches(model, CacheSettings(mode=other, **big))
    decode(model, first, ids[:80], prefill=40)
    back = convert_caches(first, model, CacheSettings(mode="scored-quant", **{**big, "window": 24}))
    assert back.caches[0].offset == first[0].offset and back.caches[0].evicted == first[0].evicted
    if back.action == "unchanged":  # the same settings: the very same caches
        assert back.caches is first
        return
    a = model(mx.array([[7]]), cache=first)[0, -1]
    b = model(mx.array([[7]]), cache=back.caches)[0, -1]
    assert mx.abs(a - b).max().item() < TOL[8] * 2


def test_scored_quant_holds_more_tokens_than_scored_in_the_same_bytes():
    """The point of the mode: at the KV bytes of a full-precision budget it keeps ~3x the tokens."""
    from cache import total_usage

    model = tiny_llama(layers=1)
    ids = random_ids(300, seed=12)
    sc = make_caches(model, CacheSettings(mode="scored", sinks=4, window=16, evict_chunk=8, max_kv_tokens=64))
    sq = make_caches(model, CacheSettings(mode="scored-quant", sinks=4, window=16, evict_chunk=8, max_kv_tokens=160))
    decode(model, sc, ids, prefill=100)
    decode(model, sq, ids, prefill=100)
    assert total_usage(sq).bytes_held <= total_usage(sc).bytes_held
    assert sq[0].offset >= 2 * sc[0].offset and sq[0].evicted > 0
    assert drop(list(range(5)), sq[0], 0) == list(range(5))


def test_scores_are_the_last_queries_votes_pooled_over_neighbours():
    """Eviction scores: the kept last queries' attention mass per KV head, added to the decayed
    earlier votes, summed over heads and averaged over +-pool neighbours."""
    from cache.scored import OBSERVE, POOL

    model = tiny_llama(layers=1)
    s = CacheSettings(mode="scored", sinks=4, window=24, evict_chunk=8, max_kv_tokens=56)
    caches = make_caches(model, s)
    decode(model, caches, random_ids(70, seed=6), prefill=20)
    c = caches[0]
    assert c._obs.shape[2] == OBSERVE
    c._fit_scores()  # the scores of tokens that arrived since the last read are added lazily
    before = c.scores
    votes = c._votes()
    want = before * (c.decay ** c._since) + votes
    c._update_scores()
    assert mx.allclose(c.scores, want).item() and c._since == 0
    t = c.scores.sum(axis=0).tolist()
    pooled = c.token_scores().tolist()
    for i in (0, 10, len(t) - 1):
        near = t[max(0, i - POOL): i + POOL + 1]
        assert abs(pooled[i] - sum(near) / len(near)) < 1e-4
    assert abs(sum(votes.sum(axis=0).tolist()) - OBSERVE * 8) < 1e-2  # 8 query heads, rows sum to one
