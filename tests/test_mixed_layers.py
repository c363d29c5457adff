"""The chat on models whose layers are not all full attention (tiny random ones): a hybrid with
recurrent state (qwen3_next: gated-delta layers in ArraysCache) and a sliding-window model
(gemma3_text: its RotatingKVCache layers become chatapp's SlidingKVCache, the same window held
contiguously for the fused CPU steps). Replies equal a fresh session's on the same conversation;
turns reuse the caches, or say why they re-prefill; regenerate and edit-last work; the cache
figures count every layer."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from cache import CacheConfigError, CacheSettings, make_caches, total_usage
from cache.layers import is_policy
from cache.sliding import SlidingKVCache
from chatapp.engine.events import TurnDone
from chatapp.engine.generate import GenerationSettings
from chatapp.engine.reuse import common_prefix
from chatapp.engine.session import Session
from chatapp.model.synthetic import byte_tokenizer
from tests.tiny_archs import build

GREEDY = GenerationSettings(temp=0.0, max_tokens=10)
SETTINGS = CacheSettings(quant_start=16, evict_chunk=16, kv_group_size=32)


def run(events) -> TurnDone:
    done = None
    for e in events:
        if isinstance(e, TurnDone):
            done = e
    return done


def model_of(name: str, **changes):
    arch = build(name, vocab_size=258, **changes)
    assert arch.model is not None, arch.skipped
    return arch.model


def fresh(model, conversation, mode):
    s = Session(model, byte_tokenizer(), mode=mode, cache_settings=SETTINGS, generation=GREEDY)
    s.load_conversation(conversation.copy())
    return run(s.reply())


@pytest.mark.parametrize("name,changes,kind", [
    ("qwen3_next", {}, ArraysCache),
    ("gemma3_text", {"sliding_window": 8}, SlidingKVCache),
])
@pytest.mark.parametrize("mode", ["prealloc", "quantized"])
def test_chat_on_mixed_layers_matches_fresh_runs(name, changes, kind, mode):
    model = model_of(name, **changes)
    s = Session(model, byte_tokenizer(), mode=mode, cache_settings=SETTINGS, generation=GREEDY)
    assert any(isinstance(c, kind) for c in s.caches) and any(is_policy(c) for c in s.caches)
    for q in ("hello there, model", "a second, longer line of text"):
        cached = list(s.cached)
        done = run(s.send(q))
        base = s.conversation.copy()
        base.messages.pop()
        reprefilled = any("re-prefilled" in n for n in done.stats.notices)
        # the turn reused what the caches held (up to where the new prompt's tokens part from
        # them: the byte tokenizer does not re-encode the reply's invalid bytes as they came),
        # or said why it could not
        prompt = s.cached[:done.stats.prompt_tokens]
        assert done.stats.reused_tokens >= common_prefix(cached, prompt) - 1 or reprefilled
        if mode == "prealloc" or reprefilled:
            # (a quantised history reused is quantised before the new message's prefill attends
            # to it, where a fresh prefill attends to the whole prompt at full precision)
            assert done.text == fresh(model, base, mode).text
    view = s.cache_view()
    assert view.conversation_tokens == len(s.cached)
    assert view.tokens == len(s.cached)  # the full-attention layers hold the whole conversation
    assert view.bytes_held == sum(c.nbytes for c in s.caches) > 0  # every layer's bytes, mlx-lm's own too
    assert s.cache_consistent() and not s.stores_kv  # snapshots / prefix store: off, said in the README

    first = s.conversation.messages[-1].content
    again = run(s.regenerate())
    assert again.text == first  # greedy: the same reply from the same conversation
    if kind is ArraysCache:
        # the caches had to drop the reply: recurrent state cannot, and the turn says so
        assert any("re-prefilled" in n and kind.__name__ in n for n in again.stats.notices)
    else:
        # a sliding window keeps a chunk of slack past its window: the reply is trimmed
        assert not again.stats.notices and again.stats.reused_tokens > 0
    edited = run(s.edit_last("something else entirely"))
    base = s.conversation.copy()
    base.messages.pop()
    if mode == "prealloc" or any("re-prefilled" in n for n in edited.stats.notices):
        assert edited.text == fresh(model, base, mode).text


def test_a_sliding_window_trims_within_its_slack_and_refuses_past_it():
    """SlidingKVCache keeps a chunk past the window: a trim that leaves the next token's window
    held is done; one that would not is refused and the session says why, in one line."""
    from cache.layers import trim_reason

    model = model_of("gemma3_text", sliding_window=8)
    caches = make_caches(model, SETTINGS.with_(mode="prealloc"))
    seq = [(5 * i + 1) % 250 + 1 for i in range(70)]
    model(mx.array([seq]), cache=caches)
    for c in caches:
        c.settle()  # (what reading offset does: the window's drop is due)
    sliding = [c for c in caches if isinstance(c, SlidingKVCache)]
    held = sliding[0].full.length
    assert sliding[0].dropped and held >= 8 - 1 + SETTINGS.evict_chunk
    slack = held - (8 - 1)
    assert trim_reason(caches, slack) == ""
    why = trim_reason(caches, slack + 1)
    assert "SlidingKVCache" in why and "\n" not in why
    assert sliding[0].trim(slack + 1) == 0 and sliding[0].full.length == held  # refused: nothing lost
    assert all(c.trim(slack) == slack for c in caches)
    assert all(c.offset == 70 - slack for c in caches)


def test_a_sliding_window_that_has_not_wrapped_is_trimmed_not_reprefilled():
    model = model_of("gemma3_text", sliding_window=512)
    s = Session(model, byte_tokenizer(), mode="prealloc", generation=GREEDY)
    run(s.send("hello"))
    first = s.conversation.messages[-1].content
    again = run(s.regenerate())
    assert again.text == first and again.stats.reused_tokens > 0 and not again.stats.notices


@pytest.mark.parametrize("mode", ["window", "window-quant", "scored", "scored-quant"])
def test_evicting_modes_are_refused_at_start_on_mixed_layers(mode):
    model = model_of("qwen3_next")
    with pytest.raises(CacheConfigError) as e:
        make_caches(model, CacheSettings(mode=mode))
    assert "\n" not in str(e.value) and "ArraysCache" in str(e.value)


def test_policy_caches_replace_only_the_full_attention_slots():
    model = model_of("gemma3_text")
    own = model.make_cache()
    ours = make_caches(model, CacheSettings(mode="prealloc"))
    assert len(ours) == len(own)
    for a, b in zip(own, ours):
        if type(a) is KVCache:
            assert is_policy(b)
        else:  # a sliding window: the same window, chatapp's contiguous cache
            assert type(a) is RotatingKVCache and type(b) is SlidingKVCache and b.window_size == a.max_size
    assert total_usage(ours).tokens == 0


@pytest.mark.parametrize("mode", ["concat", "prealloc"])
def test_gemma3_sliding_layers_give_mlx_lms_logits_past_their_512_token_window(mode):
    """Gemma 3's real window (512): the full-precision modes match mlx-lm's own caches past it."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = model_of("gemma3_text", sliding_window=512, sliding_window_pattern=2, num_hidden_layers=2)
    seq = [(5 * i + 1) % 250 + 1 for i in range(530)]

    def logits(caches):
        out = [model(mx.array([seq[:256]]), cache=caches)[0, -1:], model(mx.array([seq[256:520]]), cache=caches)[0]]
        out += [model(mx.array([[t]]), cache=caches)[0] for t in seq[520:]]
        return mx.concatenate(out, axis=0)

    ref = logits(make_prompt_cache(model))
    got = logits(make_caches(model, CacheSettings(mode=mode)))
    assert float(mx.abs(got - ref).max()) <= 1e-4 * float(mx.abs(ref).max())
