"""KIVI's layout for the quantised middle (keys per channel, values per token): the buffer keeps
the tokens it is told to, attention over it equals dequantise-then-attend, and the caches that use
it (window-quant, scored-quant) match a full pass over what they hold up to quantisation."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cache import CacheSettings, make_caches
from cache.attention import attend_mixed
from cache.factory import restore_caches
from cache.quant_channel import ChannelQuantBuffer
from tests.conftest import tiny_llama
from tests.test_cache import TOL, decode, drop, random_ids

FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
G = 32


def _kv(n: int, seed: int) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed))
    k = k * mx.where(mx.arange(64) < 3, 8.0, 1.0)  # outlier channels, as real keys have
    return k, mx.random.normal((1, 2, n, 64), key=mx.random.key(seed + 1))


def _attend_reference(q, k, v, scale):
    """Dequantise-then-attend: plain float32 softmax attention, queries the last positions."""
    B, n_q, L, D = q.shape
    n_kv = k.shape[1]
    g = (q * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    s = g @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    N = k.shape[2]
    mask = mx.arange(N - L, N)[:, None] >= mx.arange(N)[None]
    p = mx.softmax(mx.where(mask, s, -1e30), axis=-1)
    return (p @ mx.expand_dims(v, 2)).reshape(B, n_q, L, D)


op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 70)),
    st.tuples(st.just("trim"), st.integers(1, 40)),
    st.tuples(st.just("front"), st.integers(1, 70)),
    st.tuples(st.just("select"), st.integers(0, 10_000)),
)


@hsettings(max_examples=12, **FAST)
@given(ops=st.lists(op, min_size=1, max_size=8), bits=st.sampled_from([4, 8]), seed=st.integers(0, 1000))
@example(ops=[("append", 3), ("select", 0)], bits=4, seed=0)  # keeps every token, moves some (CI, stop 27)
def test_buffer_holds_the_right_tokens_and_attention_equals_dequantise_then_attend(ops, bits, seed):
    buf = ChannelQuantBuffer(256, bits, G)
    ref_k, ref_v = [], []  # per token [1, 2, 1, 64]: what the buffer should hold (keys to rounding)
    seen = []  # every key appended: no group's range is wider than theirs (moves add at most 3)
    for i, (kind, n) in enumerate(ops):
        if kind == "append":
            k, v = _kv(n, seed + 7 * i)
            buf.append(k, v)
            seen.append(k)
            ref_k += [k[:, :, j : j + 1] for j in range(n)]
            ref_v += [v[:, :, j : j + 1] for j in range(n)]
        elif kind == "trim" and buf.length:
            n = min(n, buf.length)
            buf.trim(n)
            ref_k, ref_v = ref_k[: len(ref_k) - n], ref_v[: len(ref_v) - n]
        elif kind == "front" and buf.length:
            n = buf.front_cut(n)
            buf.remove_front(n)
            ref_k, ref_v = ref_k[n:], ref_v[n:]
        elif kind == "select" and buf.length:
            import random

            rng = random.Random(n)
            keep = sorted(rng.sample(range(buf.length), rng.randint(0, buf.length)))
            deltas = [-rng.randint(0, 3) for _ in keep]
            moved = lambda x, d: x + d.astype(x.dtype)[:, None]  # a stand-in move: adds the delta
            buf.select(keep, deltas, moved)
            ref_k = [ref_k[j] + d for j, d in zip(keep, deltas)]
            ref_v = [ref_v[j] for j in keep]
        assert buf.length == len(ref_k) == len(ref_v)
        assert buf.capacity >= buf.length and buf.capacity % G == 0
    if not buf.length:
        return
    k, v = buf.dequantized()
    want_k, want_v = mx.concatenate(ref_k, axis=2), mx.concatenate(ref_v, axis=2)
    # values are quantised once per token, and only moved: exactly what one quantisation gives
    assert mx.array_equal(v, mx.dequantize(*mx.quantize(want_v, group_size=G, bits=bits),
                                           group_size=G, bits=bits)).item()
    # keys: each quantisation is off by at most half a step of its group's channel range, and a
    # key is quantised at most once per operation (re-grouped keys again from their dequantised
    # values)
    every = mx.concatenate(seen, axis=2)
    step = (mx.max(every, axis=2) - mx.min(every, axis=2) + 3 * len(ops)) / (2**bits - 1)
    assert (mx.abs(k - want_k) <= 0.5 * (len(ops) + 1) * mx.expand_dims(step, 2) + 1e-4).all().item()
    # attention over the packed parts equals attention over the dequantised tokens
    sink_k, sink_v = _kv(3, seed + 99)
    rec_k, rec_v = _kv(5, seed + 98)
    q = mx.random.normal((1, 8, 2, 64), key=mx.random.key(seed + 3))
    qk, qv = buf.packed()
    parts = [("full", sink_k, sink_v), ("quant-channel", qk, qv), ("full", rec_k, rec_v)]
    got = attend_mixed(q, parts, 0.125, "causal", bits, G)
    want = _attend_reference(q, mx.concatenate([sink_k, k, rec_k], axis=2),
                             mx.concatenate([sink_v, v, rec_v], axis=2), 0.125)
    assert mx.abs(got - want).max().item() < 1e-4


def test_per_channel_keys_are_closer_than_per_token_keys_with_outlier_channels():
    """Why the layout exists: with a few large channels, per-token groups spend their range on
    them; per-channel groups give each channel its own (4-bit keys)."""
    k, v = _kv(128, seed=4)
    chan = ChannelQuantBuffer(256, 4, 64)
    chan.append(k, v)
    per_token = mx.dequantize(*mx.quantize(k, group_size=64, bits=4), group_size=64, bits=4)
    err_chan = mx.abs(chan.dequantized()[0] - k).mean().item()
    err_tok = mx.abs(per_token - k).mean().item()
    assert err_chan < 0.6 * err_tok


@pytest.mark.parametrize("mode, bits", [("window-quant", 4), ("scored-quant", 8)])
def test_channel_caches_equal_a_full_pass_over_what_they_hold(mode, bits):
    """One layer, per-channel keys: after flushes in whole groups and evictions (from the front
    for window-quant, scattered for scored-quant), logits equal a full-precision pass over the
    kept tokens up to the quantisation of the middle."""
    model = tiny_llama(layers=1)
    s = CacheSettings(mode=mode, sinks=4, window=16, evict_chunk=8, max_kv_tokens=64, kv_bits=bits,
                      kv_group_size=G, kv_key_layout="channel")
    caches = make_caches(model, s)
    c = caches[0]
    ids = random_ids(110, seed=6)
    kept = list(ids[:10])
    model(mx.array([kept]), cache=caches)
    quantised = False
    for t in ids[10:]:
        before = c.evicted
        got = model(mx.array([[t]]), cache=caches)[0, -1]
        want = model(mx.array([kept + [t]]))[0, -1]
        assert mx.abs(got - want).max().item() < TOL[bits]
        kept.append(t)
        if c.offset:  # settles the policy
            kept = drop(kept, c, c.evicted - before)
            quantised = quantised or c.usage().quant_tokens > 0
            if mode == "window-quant":  # flushed and evicted in whole groups
                assert c.usage().quant_tokens % G == 0
    assert c.evicted > 0 and quantised  # it evicted, and attended over a quantised middle
    assert c.offset <= s.max_kv_tokens + s.evict_chunk + G


@pytest.mark.parametrize("mode", ["window-quant", "scored-quant"])
def test_channel_state_round_trip_decodes_alike(mode):
    model = tiny_llama(layers=2)
    s = CacheSettings(mode=mode, sinks=4, window=16, evict_chunk=8, max_kv_tokens=64,
                      kv_group_size=G, kv_key_layout="channel")
    live = make_caches(model, s)
    decode(model, live, random_ids(110, seed=3), prefill=40)
    assert live[0].evicted > 0
    restored = restore_caches(model, s, [c.state for c in live], [c.meta_state for c in live])
    more = random_ids(40, seed=9)
    assert mx.array_equal(decode(model, live, more, 1), decode(model, restored, more, 1)).item()


def test_trim_into_the_middle_then_grow_again():
    """The engine trims a reply it re-generates: a trim that cuts a key group re-packs it, and
    the cache goes on equal to a full pass over what it holds."""
    model = tiny_llama(layers=1)
    s = CacheSettings(mode="window-quant", sinks=4, window=16, evict_chunk=8, max_kv_tokens=400,
                      kv_group_size=G, kv_key_layout="channel")
    caches = make_caches(model, s)
    ids = random_ids(130, seed=11)
    decode(model, caches, ids[:120], prefill=100)
    c = caches[0]
    assert c.usage().quant_tokens >= 2 * G
    c.trim(30)  # all of the recent window and part of a key group
    kept = ids[:90]
    assert c.offset == 90 and c.usage().quant_tokens % G
    for t in ids[120:]:
        got = model(mx.array([[t]]), cache=caches)[0, -1]
        want = model(mx.array([kept + [t]]))[0, -1]
        assert mx.abs(got - want).max().item() < TOL[8]
        kept.append(t)
