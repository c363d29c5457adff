"""The session manager: cache reuse across turns, regenerate, edit, cancel, mode switches."""

from __future__ import annotations

import pytest

from cache import CacheSettings
from chatapp.engine.compare import compare_modes
from chatapp.engine.events import TokenEvent, TurnDone
from chatapp.engine.generate import GenerationSettings, StopMatcher, run_turn
from chatapp.engine.session import Session
from chatapp.prompt.conversation import Conversation
from chatapp.prompt.formats import PromptFormat

GREEDY = GenerationSettings(temp=0.0, max_tokens=24)
QUESTIONS = [
    "Tell me about a cat.", "What did the cat eat?", "Where did it sleep?", "Who was its friend?",
    "What colour was the ball?", "Why was Lily sad?", "What happened next?", "Did they play?",
    "Was it sunny?", "How did it end?",
]


run = run_turn  # drain a turn, return its TurnDone


def fresh_reply(model, tokenizer, conv: Conversation, generation=GREEDY, **kw) -> TurnDone:
    s = Session(model, tokenizer, generation=generation, **kw)
    s.conversation = conv.copy()
    return run(s.reply())


@pytest.mark.parametrize("turns", [2, 10])
def test_turns_prefill_only_new_tokens_and_match_fresh_runs(stories, turns):
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="prealloc")
    for n, q in enumerate(QUESTIONS[:turns]):
        before = len(s.cached)
        done = run(s.send(q))
        st = done.stats
        # Everything the cache held is reused (but a token fed after the reply ended, when the
        # re-rendered text tokenises differently), and only the tokens not in it are prefilled.
        assert st.reused_tokens >= before - 2
        assert st.prefill_tokens == st.prompt_tokens - st.reused_tokens
        assert st.prefill_tokens <= st.prompt_tokens - before + 2
        conv = s.conversation.copy()
        conv.messages.pop()
        assert fresh_reply(model, tok, conv, mode="prealloc").text == done.text


def regenerate_and_edit(s: Session) -> TurnDone:
    """Two turns, a regenerate, then an edit of the last message; returns the edited turn.

    Regenerating re-runs only the last prompt token; the edit reuses everything before the
    edited message and prefills only from there on."""
    run(s.send(QUESTIONS[0]))
    first = run(s.send(QUESTIONS[1]))
    again = run(s.regenerate())
    assert again.text == first.text
    assert again.stats.reused_tokens == again.stats.prompt_tokens - 1
    head = s.conversation.copy()
    del head.messages[head.last_index("user"):]
    unchanged = len(s.format.tokens(head, generation_prompt=False))
    edited = run(s.edit_last("Where did the dog go?"))
    assert edited.stats.reused_tokens >= unchanged
    assert edited.stats.prefill_tokens == edited.stats.prompt_tokens - edited.stats.reused_tokens
    return edited


def test_regenerate_and_edit_reuse_the_prefix(stories):
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="prealloc")
    edited = regenerate_and_edit(s)
    assert fresh_reply(model, tok, _without_last(s.conversation), mode="prealloc").text == edited.text


def test_cancel_keeps_cache_and_conversation_in_step(stories):
    model, tok = stories
    s = Session(model, tok, generation=GenerationSettings(temp=0.0, max_tokens=40), mode="prealloc")
    seen = 0
    done = None
    for ev in s.send(QUESTIONS[0]):
        if isinstance(ev, TokenEvent):
            seen += 1
            if seen == 5:
                s.cancel()
        if isinstance(ev, TurnDone):
            done = ev
    assert done.stats.finish == "cancelled" and done.stats.generated_tokens == 5
    assert s.conversation.last.role == "assistant" and s.conversation.last.interrupted
    assert len(s.cached) == s.caches[0].offset
    nxt = run(s.send(QUESTIONS[1]))
    conv = s.conversation.copy()
    conv.messages.pop()
    assert fresh_reply(model, tok, conv, s.generation, mode="prealloc").text == nxt.text


def test_mode_switch_mid_conversation_matches_fresh_run(stories):
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="prealloc")
    run(s.send(QUESTIONS[0]))
    run(s.send(QUESTIONS[1]))
    held = s.caches[0].offset
    report = s.switch_mode("window")
    assert report.action == "converted" and report.seconds >= 0
    assert s.caches[0].offset == held and s.mode == "window"
    done = run(s.send(QUESTIONS[2]))
    assert done.stats.mode == "window" and done.stats.reused_tokens >= held - 2
    conv = s.conversation.copy()
    conv.messages.pop()
    assert fresh_reply(model, tok, conv, mode="window").text == done.text


def test_switch_back_from_an_evicted_window_reprefills(stories):
    model, tok = stories
    settings = CacheSettings(sinks=4, window=64, evict_chunk=32)
    s = Session(model, tok, generation=GREEDY, mode="window", cache_settings=settings)
    for q in QUESTIONS[:4]:
        run(s.send(q))
    assert s.caches[0].evicted > 0
    report = s.switch_mode("prealloc")
    assert report.action == "reprefilled" and "dropped" in report.reason
    assert s.caches[0].offset == len(s.cached) and s.caches[0].evicted == 0


def test_a_switch_after_a_cancelled_reply_reprefills_everything(stories, monkeypatch):
    """Esc stops a reply; F3, pressed during it, switches once the reply ends. The cancel was meant
    for the reply alone: the switch's re-prefill runs to the end (issue 38: it stopped after its first
    chunk yet reported that it re-prefilled)."""
    import chatapp.engine.session as session_module

    monkeypatch.setattr(session_module, "FULL_PREFILL_STEP", 32)  # several chunks for prealloc
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="window",
                cache_settings=CacheSettings(sinks=4, window=64, evict_chunk=32))
    for q in QUESTIONS[:4]:
        run(s.send(q))
    for n, ev in enumerate(s.send(QUESTIONS[4])):
        if isinstance(ev, TokenEvent) and n == 3:
            s.cancel()
    assert s.history[-1].finish == "cancelled" and s.caches[0].evicted > 0
    held = len(s.cached)
    assert held > 3 * 32
    report = s.switch_mode("prealloc")
    assert report.action == "reprefilled", report.line()
    assert len(s.cached) == held and s.caches[0].offset == held and s.caches[0].evicted == 0
    assert s.cache_consistent()


def test_a_switch_cancelled_while_it_reprefills_says_so(stories, monkeypatch):
    """A cancel that does land during a re-prefill leaves the caches consistent and the report honest:
    how much was prefilled, and that the next turn prefills the rest."""
    import chatapp.engine.session as session_module

    monkeypatch.setattr(session_module, "FULL_PREFILL_STEP", 32)
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="window",
                cache_settings=CacheSettings(sinks=4, window=64, evict_chunk=32))
    for q in QUESTIONS[:4]:
        run(s.send(q))
    held = len(s.cached)
    real_prefill = s._prefill

    def cancel_after_first_chunk(tokens, stats, step):
        for item in real_prefill(tokens, stats, step):
            s.cancel()
            yield item

    monkeypatch.setattr(s, "_prefill", cancel_after_first_chunk)
    report = s.switch_mode("prealloc")
    assert report.action == "stopped", report.line()
    assert f"32 of {held}" in report.line() and "next turn" in report.line()
    assert s.cache_consistent() and len(s.cached) == 32
    monkeypatch.undo()
    done = run(s.send(QUESTIONS[4]))  # the next turn starts clear and prefills the rest
    assert done.stats.finish != "cancelled" and done.stats.reused_tokens >= 32
    assert s.cache_consistent()


def test_auto_policy_switches_to_window_when_long(stories):
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="auto", long_after=100,
                cache_settings=CacheSettings(sinks=4, window=128, evict_chunk=32, max_kv_tokens=256))
    assert s.mode == "prealloc"
    for q in QUESTIONS[:5]:
        done = run(s.send(q))
    # stories260K has head_dim 8, too small to quantise: the policy falls back to window.
    assert s.mode == "window"
    assert any("window instead of window-quant" in n for n in s.notices)
    assert done.stats.cache.tokens <= 256 + 32


def test_eviction_tracks_what_the_model_still_sees(stories):
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="window",
                cache_settings=CacheSettings(sinks=4, window=48, evict_chunk=16))
    for q in QUESTIONS[:5]:
        done = run(s.send(q))
    view = done.stats.cache
    assert view.evicted > 0 and view.in_view < 1.0
    assert view.first_visible_message >= 1
    assert len(s.conversation.messages) == 10  # the transcript keeps everything


def test_plain_transcript_format_for_models_without_template(stories):
    model, tok = stories
    fmt = PromptFormat.for_tokenizer(tok)
    assert fmt.name == "plain"
    conv = Conversation.start("Be kind.")
    conv.add("user", "Hi")
    conv.add("assistant", "Hello")
    conv.add("user", "Bye")
    assert fmt.text(conv) == "Be kind.\n\nUser: Hi\nAssistant: Hello\n\nUser: Bye\nAssistant:"
    assert PromptFormat.for_tokenizer(tok, raw=True).text(conv) == "Be kind.HiHelloBye"


def test_raw_mode_continues_the_story(stories):
    model, tok = stories
    s = Session(model, tok, generation=GenerationSettings(temp=0.0, max_tokens=12), raw=True)
    done = run(s.send("Once upon a time,"))
    assert done.text.strip().startswith("there was a little girl named Lily.")


def test_stop_matcher_never_shows_a_stop_string():
    m = StopMatcher(["\nUser:"])
    shown = ""
    for seg in ["Hello", " there", "\n", "Us", "er", ": more"]:
        out, stopped = m.feed(seg)
        shown += out
        if stopped:
            break
    assert stopped and shown == "Hello there" and m.text == "Hello there"
    m = StopMatcher(["\nUser:"])
    out, _ = m.feed("a\nU")
    assert out == "a" and m.flush() == "\nU"


def test_compare_modes_replays_last_turn(stories):
    model, tok = stories
    s = Session(model, tok, generation=GREEDY, mode="prealloc")
    run(s.send(QUESTIONS[0]))
    run(s.send(QUESTIONS[1]))
    rows = list(compare_modes(s, ["concat", "prealloc", "window", "window-quant"], max_tokens=8))
    assert [r.mode for r in rows] == ["concat", "prealloc", "window", "window-quant"]
    ok = [r for r in rows if not r.error]
    assert len(ok) == 3 and all(r.ttft > 0 and r.generated == 8 for r in ok)
    assert ok[0].reply == ok[1].reply  # same cache contents, same greedy reply
    assert "head_dim" in rows[3].error
    # beside the speed, what each mode holds and on which route it decoded
    assert all(0 < r.kv_held <= r.kv_allocated for r in ok)
    assert all(r.route == "fused" or r.route.startswith("mlx (") for r in ok)


def test_random_model_all_modes_multi_turn():
    """A random-weight model with head_dim 64: every mode runs several turns without error,
    and the quantised modes really hold quantised tokens."""
    from chatapp.model.synthetic import byte_tokenizer
    from tests.conftest import tiny_llama

    tok = byte_tokenizer()
    model = tiny_llama(layers=2)
    settings = CacheSettings(sinks=4, window=64, evict_chunk=32, max_kv_tokens=160, quant_start=64)
    for mode in ["concat", "prealloc", "quantized", "window", "window-quant"]:
        s = Session(model, tok, generation=GenerationSettings(temp=0.0, max_tokens=20), mode=mode,
                    cache_settings=settings)
        for q in ["hello there, model", "another line of text", "and a third one"]:
            done = run(s.send(q))
            assert done.stats.generated_tokens > 0
        view = s.cache_view()
        assert view.tokens == s.caches[0].offset == len(s.cached) - view.evicted
        if mode in ("quantized", "window-quant"):
            assert view.quant_tokens > 0


def test_a_turn_reserves_its_reply_before_it_starts_so_the_cache_never_grows_mid_reply():
    """prealloc grows by copying every row held (a stall in the middle of a stream): a turn makes
    room for its prefill and max_tokens before its prefill, so the buffers stay the same for
    every token of a 300-token reply that crosses chunk boundaries (256)."""
    from chatapp.model.synthetic import byte_tokenizer
    from tests.conftest import tiny_llama

    s = Session(tiny_llama(layers=1), byte_tokenizer(), mode="prealloc",
                generation=GenerationSettings(temp=0.0, max_tokens=300, ignore_eos=True))
    for text in ("hello", "and a longer reply, please"):  # a first turn (no rows before it), a second
        caps = {s.caches[0].full.capacity for e in s.send(text) if isinstance(e, TokenEvent)}
        assert len(caps) == 1 and caps.pop() >= len(s.cached) > 300


def test_ignore_eos_runs_to_max_tokens_without_showing_the_end_token(stories):
    model, tok = stories
    settings = GenerationSettings(temp=0.0, max_tokens=400)
    ended = run(Session(model, tok, generation=settings, raw=True).send("Once upon a time,"))
    assert ended.stats.finish == "eos" and ended.stats.generated_tokens < 400
    s = Session(model, tok, generation=GenerationSettings(temp=0.0, max_tokens=400, ignore_eos=True), raw=True)
    events = list(s.send("Once upon a time,"))
    done = events[-1]
    assert done.stats.finish == "length" and done.stats.generated_tokens == 400
    assert done.text.startswith(ended.text) and len(done.text) > len(ended.text)
    assert "<s>" not in done.text and "</s>" not in done.text
    # the end tokens are banned, not generated and hidden: the cache holds exactly the reply's
    # tokens, so the next turn reuses all of it
    assert not any(e.token in s.eos_ids for e in events if isinstance(e, TokenEvent))
    before = len(s.cached)
    s.set_generation(max_tokens=8)  # the next turn is about its prefill; its length does not matter
    nxt = run(s.send("And then?"))
    assert nxt.stats.reused_tokens >= before - 1


def test_replies_without_a_leading_space_are_reused_next_turn():
    """A byte-level model's reply starts with whatever byte it picked (no SentencePiece "▁"):
    the transcript renders it exactly as generated, so the next turn prefills only its own text."""
    from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

    tok = byte_tokenizer()
    ascii_only = tuple(i for i in range(256) if not tok.decode([i]).isascii())
    shape = LlamaShape(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=32, intermediate_size=128, vocab_size=258)
    model, _ = build_random_llama(shape, seed=1, silent_tokens=ascii_only)
    s = Session(model, tok, generation=GenerationSettings(temp=0.0, max_tokens=12))
    done = run(s.send("Hi there."))
    assert done.text and not done.text[0].isspace()  # the case this is about
    for q in ("And then?", "Why?"):
        before = len(s.cached)
        nxt = run(s.send(q))
        assert nxt.stats.reused_tokens >= before - 1  # at most the stop-string tokens differ
        fresh = fresh_reply(model, tok, _without_last(s.conversation),
                            generation=GenerationSettings(temp=0.0, max_tokens=12))
        assert fresh.text == nxt.text


def _without_last(conv: Conversation) -> Conversation:
    c = conv.copy()
    c.messages.pop()
    return c
