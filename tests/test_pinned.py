"""The system prompt is pinned: no evicting mode ever evicts its tokens (CacheSettings.pinning,
Session.pin_system_prompt), and the per-policy evicted / quantised tallies the stats expose."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache import CacheSettings, make_caches
from cache.settings import MODES
from chatapp.engine.generate import GenerationSettings, run_turn
from chatapp.engine.session import Session
from chatapp.model.synthetic import byte_tokenizer
from chatapp.prompt.conversation import Conversation
from tests.conftest import tiny_llama

EVICTING = [m for m in MODES if CacheSettings(mode=m).evicts]
SMALL = dict(sinks=4, window=128, evict_chunk=16, max_kv_tokens=200)
SYSTEM = "You are a terse assistant. Always answer in one line."


@pytest.mark.parametrize("mode", MODES)
def test_pinning_raises_sinks_within_the_same_budget(mode):
    s = CacheSettings(mode=mode, **SMALL)
    p = s.pinning(50)
    if not s.evicts:
        assert p == s
        return
    assert p.sinks == 50 and p.budget == s.budget
    assert p.sinks + p.window <= p.budget
    assert s.pinning(3) == s  # already covered by the sinks
    huge = s.pinning(10_000)  # capped: half the budget at most (and no more than the window)
    assert huge.sinks <= s.budget // 2 and huge.budget == s.budget and huge.window >= huge.sinks


def test_evicting_modes_are_the_four_policies():
    assert set(EVICTING) == {"window", "window-quant", "scored", "scored-quant"}


@pytest.mark.parametrize("mode", EVICTING)
def test_the_system_prompt_is_never_evicted(mode):
    """Several turns push the conversation well past the budget; every layer's first tokens are
    still the system prompt's K/V, exactly as a prefill of the system prompt alone makes them
    (the first tokens' K/V depend on nothing after them), and the tally names the policy."""
    model = tiny_llama(layers=2)
    tok = byte_tokenizer()
    gen = GenerationSettings(temp=0.0, max_tokens=6)
    s = Session(model, tok, generation=gen, mode=mode, cache_settings=CacheSettings(**SMALL), system=SYSTEM)
    n = s._system_tokens()
    assert n > SMALL["sinks"] and s.pinned == n and s.settings.sinks == n
    sys_ids = s.format.tokens(Conversation(s.conversation.messages[:1]), generation_prompt=False)
    ref = make_caches(model, CacheSettings(mode="prealloc"))
    model(mx.array([sys_ids]), cache=ref)
    for i in range(4):
        done = run_turn(s.send(f"Question {i}: please tell me something about the number {i} and its friends."))
        for c, r in zip(s.caches, ref):
            k, v = c.content()
            rk, rv = r.content()
            assert mx.array_equal(k[:, :, :n], rk).item() and mx.array_equal(v[:, :, :n], rv).item()
    view = s.cache_view()
    assert view.evicted > 0 and view.evicted_by_policy == {mode: view.evicted}
    js = done.stats.to_json(with_steps=False)["cache"]  # what --stats-json writes
    assert js["evicted_by_policy"] == {mode: view.evicted} and "quantised_by_policy" in js
    if "quant" in mode:
        assert view.quantised_by_policy.get(mode, 0) >= view.quant_tokens > 0


def test_new_chat_pins_the_new_system_prompt_and_switches_keep_the_pin():
    model = tiny_llama(layers=1)
    tok = byte_tokenizer()
    s = Session(model, tok, generation=GenerationSettings(temp=0.0, max_tokens=4), mode="window",
                cache_settings=CacheSettings(**SMALL), system="")
    assert s.settings.sinks == SMALL["sinks"] and s.pinned == 0  # no system prompt: nothing pinned
    s.new_chat(system=SYSTEM)
    assert s.settings.sinks == s.pinned == s._system_tokens() > SMALL["sinks"]
    run_turn(s.send("hello there, how are you doing today my friend?"))
    report = s.switch_mode("scored-quant")
    assert report.action == "converted" and s.settings.sinks == s.pinned


def test_tallies_follow_the_policy_across_a_switch():
    from cache import convert_caches

    model = tiny_llama(layers=1)
    ids = mx.random.randint(0, 500, (300,), key=mx.random.key(3)).tolist()
    caches = make_caches(model, CacheSettings(mode="window", **SMALL))
    model(mx.array([ids[:120]]), cache=caches)
    for t in ids[120:200]:
        model(mx.array([[t]]), cache=caches)
    first = caches[0].evicted
    assert caches[0].offset and caches[0].evicted_by == {"window": first} and first > 0
    caches = convert_caches(caches, model, CacheSettings(mode="scored-quant", **SMALL)).caches
    for t in ids[200:]:
        model(mx.array([[t]]), cache=caches)
    c = caches[0]
    assert c.offset and c.evicted_by["window"] == first and c.evicted == sum(c.evicted_by.values())
    assert c.evicted_by.get("scored-quant", 0) > 0 and c.quantised_by["scored-quant"] > 0
