"""The cache library: every mode against a full recompute, accounting, conversion, settings."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cache import (
    MODES,
    CacheConfigError,
    CacheSettings,
    convert_caches,
    make_caches,
    model_geometry,
    total_usage,
)
from tests.conftest import tiny_llama

# Small windows so eviction and quantisation happen within a few hundred tokens.
SMALL = dict(sinks=4, window=48, evict_chunk=16, max_kv_tokens=96, quant_start=40)
TOL = {"full": 2e-4, 8: 3e-2, 4: 0.35}  # max |logit error|, logits are O(3)


def tol(mode: str, bits: int = 8) -> float:
    return TOL[bits] if mode in ("quantized", "window-quant", "scored-quant") else TOL["full"]


def kept_tokens(ids: list[int], sinks: int, evicted: int) -> list[int]:
    """Evicting caches drop the oldest non-sink tokens, so the kept ones are these."""
    return ids[:sinks] + ids[sinks + evicted :] if evicted else list(ids)


def drop(kept: list[int], cache, dropped: int) -> list[int]:
    """The tokens still held after ``cache`` dropped ``dropped`` of ``kept``: the oldest non-sink
    ones, or for the scored mode the ones its last eviction names."""
    if not dropped:
        return kept
    if cache.mode in ("scored", "scored-quant"):
        gone = set(cache.last_dropped)
        assert len(gone) == dropped
        return [t for i, t in enumerate(kept) if i not in gone]
    return kept[: cache.sinks] + kept[cache.sinks + dropped :]


def decode(model, caches, ids: list[int], prefill: int) -> mx.array:
    """Prefill ``prefill`` tokens, then one token per step; logits of every position."""
    out = [model(mx.array([ids[:prefill]]), cache=caches)[0]]
    for t in ids[prefill:]:
        out.append(model(mx.array([[t]]), cache=caches)[0])
    return mx.concatenate(out, axis=0)


def random_ids(n: int, vocab: int = 512, seed: int = 1) -> list[int]:
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist()


# ---- settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(chunk_size=300), "chunk_size"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(window=2, sinks=4), "window"),
        (dict(kv_bits=3), "kv_bits"),
        (dict(kv_group_size=48), "kv_group_size"),
        (dict(sinks=-1), "sinks"),
        (dict(window=-5), "window"),
        (dict(evict_chunk=0), "evict_chunk"),
        (dict(max_kv_tokens=10), "max_kv_tokens"),
        (dict(mode="ring"), "mode"),
    ],
)
def test_bad_settings_name_the_setting(bad, name):
    with pytest.raises(CacheConfigError) as e:
        CacheSettings(**bad)
    assert str(e.value).startswith(name + ":")


def test_fitted_keeps_positions_inside_trained_context():
    s, notes = CacheSettings(mode="window", window=1024).fitted(512)
    assert s.budget + 2 * s.evict_chunk <= 512 and notes
    s, notes = CacheSettings(mode="window-quant", max_kv_tokens=4096).fitted(512)
    assert s.budget + 2 * s.evict_chunk <= 512 and s.window + s.sinks <= s.max_kv_tokens
    same, notes = CacheSettings(mode="prealloc").fitted(512)
    assert notes == [] and same.mode == "prealloc"


def test_head_dim_smaller_than_group_is_refused_clearly():
    model = tiny_llama(layers=1, head_dim=16, kv_heads=2, heads=4)
    for mode in ("quantized", "window-quant"):
        with pytest.raises(CacheConfigError, match=r"head_dim \(16\).*prealloc or window"):
            make_caches(model, CacheSettings(mode=mode))
    model = tiny_llama(layers=1, head_dim=96, kv_heads=2, heads=4)
    with pytest.raises(CacheConfigError, match="use kv_group_size 32"):
        make_caches(model, CacheSettings(mode="quantized", kv_group_size=64))


# ---- every mode against a full forward pass --------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_decoding_matches_full_forward_before_eviction(mode):
    """Multi-layer GQA model, head_dim 64: nothing evicted yet, so logits must equal a full pass."""
    model = tiny_llama(layers=2)
    ids = random_ids(120)
    s = CacheSettings(mode=mode, **{**SMALL, "window": 200, "max_kv_tokens": 400})
    caches = make_caches(model, s)
    got = decode(model, caches, ids, prefill=17)
    want = model(mx.array([ids]))[0]
    assert mx.abs(got - want).max().item() < tol(mode)
    if mode == "quantized":
        assert total_usage(caches).quant_tokens > 0  # the quantised path really ran


@pytest.mark.parametrize("mode", ["window", "window-quant"])
@pytest.mark.parametrize("bits", [8, 4])
def test_window_modes_match_full_pass_over_kept_tokens(mode, bits):
    """One layer: after evictions, logits equal a full pass over exactly the kept tokens."""
    if mode == "window" and bits == 4:
        pytest.skip("window mode does not quantise")
    model = tiny_llama(layers=1)
    ids = random_ids(400)
    s = CacheSettings(mode=mode, kv_bits=bits, **SMALL)
    caches = make_caches(model, s)
    decode(model, caches, ids, prefill=9)
    for extra in random_ids(5, seed=9):  # a few more steps, each compared
        ids.append(extra)
        got = model(mx.array([[extra]]), cache=caches)[0, -1]
        evicted = caches[0].evicted  # read after the step: maintenance is deferred
        kept = kept_tokens(ids, s.sinks, evicted)
        want = model(mx.array([kept]))[0, -1]
        assert mx.abs(got - want).max().item() < tol(mode, bits)
    u = total_usage(caches)
    assert u.evicted > 0 and u.tokens <= s.budget + s.evict_chunk
    if mode == "window-quant":
        assert u.quant_tokens > 0 and caches[0].delta_q > 0


@pytest.mark.parametrize("mode", ["window", "window-quant"])
def test_multilayer_window_keeps_repositioned_keys(mode):
    """Deeper layers' keys depend on evicted context, but layer 0's must equal a fresh
    computation over the kept tokens at compacted positions: that is what re-positioning means."""
    model = tiny_llama(layers=2)
    ids = random_ids(300)
    s = CacheSettings(mode=mode, kv_bits=8, **SMALL)
    caches = make_caches(model, s)
    decode(model, caches, ids, prefill=30)
    kept = kept_tokens(ids, s.sinks, caches[0].evicted)
    fresh = make_caches(model, CacheSettings(mode="prealloc"))
    model(mx.array([kept]), cache=fresh)
    k, v = caches[0].content()
    k2, v2 = fresh[0].content()
    assert k.shape == k2.shape
    assert mx.abs(k - k2).max().item() < tol(mode)
    assert mx.abs(v - v2).max().item() < tol(mode)


# ---- the real model -----------------------------------------------------------------------
def greedy(model, tokenizer, prompt: str, n: int, caches) -> str:
    ids = tokenizer.encode(prompt)
    logits = model(mx.array([ids]), cache=caches)[0, -1]
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=caches)[0, -1]
    return tokenizer.decode(out)


def test_stories_greedy_through_prealloc(stories):
    model, tokenizer = stories
    text = greedy(model, tokenizer, "Once upon a time,", 12, make_caches(model, CacheSettings(mode="prealloc")))
    assert text.strip().startswith("there was a little girl named Lily.")


@pytest.mark.parametrize("mode", ["concat", "prealloc", "window"])
def test_stories_modes_match_full_forward(stories, mode):
    model, tokenizer = stories
    ids = tokenizer.encode("Once upon a time, there was a little girl named Lily. She loved to play")
    s, _ = CacheSettings(mode=mode).fitted(model_geometry(model).max_positions)
    caches = make_caches(model, s)
    got = decode(model, caches, ids, prefill=5)
    want = model(mx.array([ids]))[0]
    assert mx.abs(got - want).max().item() < 1e-3


def test_stories_window_evicts_and_repositions(stories):
    model, _ = stories
    ids = random_ids(700, vocab=512, seed=3)
    s = CacheSettings(mode="window", sinks=4, window=200, evict_chunk=64)
    caches = make_caches(model, s)
    decode(model, caches, ids, prefill=64)
    assert caches[0].evicted > 0 and caches[0].offset <= 512  # never past the trained context
    kept = kept_tokens(ids, 4, caches[0].evicted)
    fresh = make_caches(model, CacheSettings(mode="prealloc"))
    model(mx.array([kept]), cache=fresh)
    assert mx.abs(caches[0].content()[0] - fresh[0].content()[0]).max().item() < 1e-4


def test_stories_quantized_kv_is_refused(stories):
    model, _ = stories
    with pytest.raises(CacheConfigError, match=r"head_dim \(8\)"):
        make_caches(model, CacheSettings(mode="window-quant"))


# ---- accounting -----------------------------------------------------------------------------
def expected_bytes(u, n_kv: int, head_dim: int, itemsize: int, bits: int, group: int) -> tuple[int, int]:
    full = 2 * n_kv * u.full_tokens * head_dim * itemsize
    per_quant_token = n_kv * (head_dim * bits // 8 + 2 * (head_dim // group) * itemsize)
    return full, 2 * per_quant_token * u.quant_tokens


@pytest.mark.parametrize("mode", MODES)
def test_usage_is_exact(mode):
    model = tiny_llama(layers=2)
    s = CacheSettings(mode=mode, **SMALL)
    caches = make_caches(model, s)
    decode(model, caches, random_ids(300), prefill=50)
    for c in caches:
        u = c.usage()
        full, quant = expected_bytes(u, 2, 64, 4, s.kv_bits, s.kv_group_size)
        assert (u.full_bytes, u.quant_bytes) == (full, quant)
        assert c.nbytes == full + quant
        assert u.bytes_allocated >= u.bytes_held
        if mode != "concat":
            assert u.full_slots % s.chunk_size == 0
    total = total_usage(caches)
    assert total.tokens == caches[0].offset
    assert total.bytes_held == sum(c.nbytes for c in caches)


def test_prealloc_grows_by_whole_chunks():
    model = tiny_llama(layers=1)
    caches = make_caches(model, CacheSettings(mode="prealloc", chunk_size=512))
    model(mx.array([random_ids(10)]), cache=caches)
    assert caches[0].usage().full_slots == 512
    model(mx.array([random_ids(600)]), cache=caches)
    assert caches[0].usage().full_slots == 1024 and caches[0].offset == 610


@pytest.mark.parametrize("mode", ["prealloc", "window"])
def test_an_unbounded_buffer_grows_by_half_its_capacity_a_bounded_one_by_chunks(mode):
    """Growing copies every held row into new memory: prealloc (every token kept) grows by half
    its capacity at least, so 3,000 tokens one at a time see 6 buffers, not 12; a window's buffer
    (capped by its budget) keeps whole chunks. Either way no row is lost on the way."""
    import mlx.nn as nn

    from cache import CACHE_CLASSES
    from cache.rope import Repositioner

    s = CacheSettings(mode=mode, chunk_size=256, sinks=4, window=512, evict_chunk=256)
    c = CACHE_CLASSES[mode](s, repositioner=Repositioner(nn.RoPE(4)))
    rows = mx.random.normal((1, 1, 3000, 4), key=mx.random.key(0))
    caps = []
    for i in range(rows.shape[2]):
        c.update_and_fetch(rows[:, :, i:i + 1], rows[:, :, i:i + 1] + 1)
        if not caps or c.full.capacity != caps[-1]:
            caps.append(c.full.capacity)
    assert all(cap % 256 == 0 for cap in caps)
    if mode == "prealloc":
        assert caps == [256, 512, 768, 1280, 2048, 3072]
        k, v = c.content()
        assert mx.array_equal(k, rows) and mx.array_equal(v, rows + 1)
    else:
        assert all(b - a == 256 for a, b in zip(caps, caps[1:])) and caps[-1] <= 4 + 512 + 2 * 256


# ---- attention routes -------------------------------------------------------------------------
def test_dispatched_attention_equals_dequantised_route():
    model = tiny_llama(layers=1)
    caches = make_caches(model, CacheSettings(mode="window-quant", **SMALL))
    decode(model, caches, random_ids(200), prefill=20)
    c = caches[0]
    c.offset  # run deferred maintenance
    assert c.delta_q > 0 and c.usage().quant_tokens > 0
    q = mx.random.normal((1, 8, 3, 64), key=mx.random.key(4))
    c.update_and_fetch(mx.random.normal((1, 2, 3, 64)), mx.random.normal((1, 2, 3, 64)))
    k, v = c.content()
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = c.attend(q, scale=0.125, mask="causal")
    assert mx.abs(got - want).max().item() < 1e-4


# ---- conversion -------------------------------------------------------------------------------
def test_convert_prealloc_to_window_evicts_and_matches():
    model = tiny_llama(layers=1)
    ids = random_ids(200)
    caches = make_caches(model, CacheSettings(mode="prealloc"))
    model(mx.array([ids]), cache=caches)
    s = CacheSettings(mode="window", **SMALL)
    conv = convert_caches(caches, model, s)
    assert conv.action == "converted" and conv.lossy and "evicted" in conv.reason
    nxt = 7
    got = model(mx.array([[nxt]]), cache=conv.caches)[0, -1]
    kept = kept_tokens(ids, s.sinks, conv.caches[0].evicted) + [nxt]
    assert mx.abs(got - model(mx.array([kept]))[0, -1]).max().item() < 1e-3


def test_convert_window_back_to_full_history_needs_reprefill():
    model = tiny_llama(layers=1)
    caches = make_caches(model, CacheSettings(mode="window", **SMALL))
    decode(model, caches, random_ids(150), prefill=100)
    conv = convert_caches(caches, model, CacheSettings(mode="prealloc"))
    assert conv.action == "reprefill" and "dropped" in conv.reason
    assert all(c.offset == 0 for c in conv.caches)


def test_convert_unchanged_and_quantized_roundtrip():
    model = tiny_llama(layers=1)
    ids = random_ids(120)
    s = CacheSettings(mode="quantized", **SMALL)
    caches = make_caches(model, s)
    model(mx.array([ids]), cache=caches)
    assert convert_caches(caches, model, s).action == "unchanged"
    to_wq = convert_caches(caches, model, CacheSettings(mode="window-quant", **SMALL))
    model(mx.array([[3]]), cache=to_wq.caches)
    assert to_wq.caches[0]._dispatched is True  # conversion does not hide the dispatch
    conv = convert_caches(caches, model, CacheSettings(mode="prealloc"))
    assert conv.action == "converted" and "dequantised" in conv.reason
    got = model(mx.array([[5]]), cache=conv.caches)[0, -1]
    assert mx.abs(got - model(mx.array([ids + [5]]))[0, -1]).max().item() < TOL[8]


# ---- property: any sequence of operations ----------------------------------------------------
PROP = dict(sinks=2, window=16, evict_chunk=8, max_kv_tokens=40, quant_start=12)
op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 24)),
    st.tuples(st.just("trim"), st.integers(1, 20)),
    st.tuples(st.just("convert"), st.sampled_from(MODES)),
)


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.sampled_from(MODES), ops=st.lists(op, min_size=1, max_size=12), seed=st.integers(0, 10_000))
def test_any_sequence_of_operations_matches_recompute(start, ops, seed):
    """Appends (single and multi-token), trims and live mode conversions keep the logits equal
    to a full forward pass over the tokens the cache holds, and keep the accounting exact."""
    model = tiny_llama(layers=1)
    s = CacheSettings(mode=start, **PROP)
    caches = make_caches(model, s)
    history: list[int] = []  # every token of the conversation still in it (after trims)
    kept: list[int] = []  # the tokens the cache holds, in order
    lossy = False
    stream = iter(random_ids(400, seed=seed))
    for kind, arg in ops:
        mode = caches[0].mode
        if kind == "append":
            new = [next(stream) for _ in range(arg)]
            before = caches[0].evicted
            got = model(mx.array([new]), cache=caches)[0]
            want = model(mx.array([kept + new]))[0, -arg:]
            limit = TOL[8] * 2 if (lossy or mode in ("quantized", "window-quant", "scored-quant")) else TOL["full"]
            assert mx.abs(got - want).max().item() < limit, (kind, arg, mode)
            history += new
            kept += new
            dropped = (caches[0].offset, caches[0].evicted - before)[1]  # offset settles the policy
            kept = drop(kept, caches[0], dropped)
        elif kind == "trim":
            n = min(arg, len(kept))
            assert all(c.trim(n) == n for c in caches)
            kept, history = kept[: len(kept) - n], history[: len(history) - n]
        else:
            before = caches[0].evicted
            conv = convert_caches(caches, model, CacheSettings(mode=arg, **PROP))
            caches = conv.caches
            if conv.action == "reprefill":
                kept, lossy = list(history), False
                if history:
                    model(mx.array([history]), cache=caches)
                    if caches[0].evicted:
                        kept = drop(kept, caches[0], caches[0].evicted)
            elif conv.action == "converted":
                lossy = lossy or conv.lossy
                kept = drop(kept, caches[0], caches[0].evicted - before)
        u = total_usage(caches)
        assert u.tokens == len(kept) == caches[0].offset
        for c in caches:
            cu = c.usage()
            full, quant = expected_bytes(cu, 2, 64, 4, 8, 64)
            assert (cu.full_bytes, cu.quant_bytes) == (full, quant)


def test_cache_learns_whether_attention_is_dispatched():
    """Only after attend() has followed an update may update_and_fetch skip the dequantised
    history; a caller that never calls attend() always gets the whole history."""
    model = tiny_llama(layers=1)
    s = CacheSettings(mode="quantized", **SMALL)
    caches = make_caches(model, s)
    ids = random_ids(80)
    decode(model, caches, ids, prefill=60)
    c = caches[0]
    assert c.usage().quant_tokens > 0 and c._dispatched is True
    k, _ = c.update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
    assert k.shape[2] == c.usage().full_tokens  # attention runs through attend(), not these
    # A fresh cache driven without attend(): every call returns the full history.
    bare = make_caches(model, s)[0]
    bare.update_and_fetch(*c.content())
    for _ in range(3):
        k, v = bare.update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
        assert k.shape[2] == bare.offset and bare._dispatched is False


def test_mixed_attention_keeps_the_query_dtype():
    model = tiny_llama(layers=1)
    caches = make_caches(model, CacheSettings(mode="window-quant", **SMALL))
    decode(model, caches, random_ids(150), prefill=20)
    c = caches[0]
    c.update_and_fetch(mx.random.normal((1, 2, 1, 64)), mx.random.normal((1, 2, 1, 64)))
    q = mx.random.normal((1, 8, 1, 64))
    out16 = c.attend(q.astype(mx.bfloat16), scale=0.125, mask=None)
    out32 = c.attend(q, scale=0.125, mask=None)
    assert out16.dtype == mx.bfloat16
    assert mx.abs(out16.astype(mx.float32) - out32).max().item() < 0.05
