"""PersistentChat: saving as it goes, resuming from snapshots, and every fallback."""

from __future__ import annotations

import shutil

import pytest

from cache import CacheSettings
from chatapp.engine.events import TokenEvent, TurnDone
from chatapp.engine.generate import GenerationSettings, run_turn
from chatapp.engine.session import Session
from chatapp.store import ChatStore
from chatapp.store.chat import PARTIAL_TOKENS, ModelIdentity, PersistentChat, open_chat
from chatapp.store.paths import snapshot_dir, snapshot_files, snapshot_path
from chatapp.store.textio import clean_text
from tests.conftest import tiny_llama

GREEDY = GenerationSettings(temp=0.0, max_tokens=24)
QUESTIONS = ["Tell me about a cat.", "What did the cat eat?", "Where did it sleep?", "Who was its friend?"]
SMALL = dict(sinks=4, window=48, evict_chunk=16, max_kv_tokens=96, quant_start=40)


run = run_turn  # drain a turn, return its TurnDone


@pytest.fixture(scope="module")
def stories_loaded(stories_path):
    from chatapp.model.loader import load_model

    return load_model(str(stories_path))


@pytest.fixture(scope="module")
def stories_id(stories_loaded, stories_path):
    return ModelIdentity.from_loaded(stories_loaded, str(stories_path))


def stories_session(loaded, generation=GREEDY, **kw) -> Session:
    return Session(loaded.model, loaded.tokenizer, generation=generation, **kw)


def contents(data_dir, cid=None) -> list[tuple[str, str, str]]:
    with ChatStore.open(data_dir, write=False) as st:
        cid = cid if cid is not None else st.latest_id()
        return [(m.role, m.content, m.status) for m in st.messages(cid)]


# ---- saving and resuming ---------------------------------------------------------------------------
def test_every_message_saved_and_resume_needs_no_prefill(stories_loaded, stories_id, tmp_path):
    lm = stories_loaded
    with open_chat(stories_session(lm), stories_id, tmp_path) as chat:
        for q in QUESTIONS[:3]:
            done = run(chat.send(q))
            assert contents(tmp_path)[-1] == ("assistant", done.text, "complete")
            assert chat.save_snapshot()
            assert not chat.save_snapshot()  # nothing changed: not written again
        cid = chat.conversation_id
        saved_tokens = list(chat.session.cached)
    assert [r for r, _, _ in contents(tmp_path)] == ["user", "assistant"] * 3
    assert snapshot_path(tmp_path, cid).exists()

    continuous = stories_session(lm)  # the same conversation without a restart
    for q in QUESTIONS[:3]:
        run(continuous.send(q))
    assert continuous.cached == saved_tokens
    expected = run(continuous.send(QUESTIONS[3]))

    resumed = open_chat(stories_session(lm), stories_id, tmp_path, resume="latest")
    info = resumed.resume_info
    assert info.source == "snapshot" and info.snapshot_tokens == len(saved_tokens) and info.messages == 6
    assert "no re-prefill" in info.line() and resumed.take_notes() == []
    done = run(resumed.send(QUESTIONS[3]))
    assert done.text == expected.text
    assert done.stats.reused_tokens == expected.stats.reused_tokens >= len(saved_tokens) - 2
    assert done.stats.prefill_tokens == expected.stats.prefill_tokens
    resumed.close()
    assert len(contents(tmp_path)) == 8


@pytest.mark.parametrize("mode", ["concat", "prealloc", "quantized", "window", "window-quant"])
def test_resume_continues_exactly_in_every_mode(mode, tmp_path):
    from chatapp.model.synthetic import byte_tokenizer

    model, tok = tiny_llama(layers=2), byte_tokenizer()
    ident = ModelIdentity("tiny", "tiny", "fp")
    gen = GenerationSettings(temp=0.0, max_tokens=24)

    def session():
        return Session(model, tok, generation=gen, mode=mode, cache_settings=CacheSettings(**SMALL))

    lines = ["hello there, model", "another line of text", "and a third one", "the fourth"]
    with open_chat(session(), ident, tmp_path) as chat:
        for q in lines[:3]:
            run(chat.send(q))
        caches = chat.session.caches
    if mode == "window-quant":
        assert caches[0].delta_q > 0 and caches[0].evicted > 0 and caches[0].usage().quant_tokens > 0
    continuous = session()
    for q in lines[:3]:
        run(continuous.send(q))
    expected = run(continuous.send(lines[3]))
    with open_chat(session(), ident, tmp_path, resume="latest") as chat:
        assert chat.resume_info.source == "snapshot", chat.resume_info.reason
        assert chat.session.mode == mode
        done = run(chat.send(lines[3]))
    assert done.text == expected.text and done.stats.reused_tokens == expected.stats.reused_tokens


def _damage(data_dir, cid, how: str, stories_id):
    path = snapshot_path(data_dir, cid)
    ident = stories_id
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x55
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    elif how == "other model":
        ident = ModelIdentity("stories260K-4bit", stories_id.model_spec, stories_id.weights_fingerprint)
    elif how == "other weights":
        ident = ModelIdentity(stories_id.model_id, stories_id.model_spec, "0" * 64)
    elif how == "transcript edited":
        with ChatStore.open(data_dir) as st:
            msgs = st.messages(cid)
            st.replace_messages(cid, 1, [("assistant", msgs[1].content + " And then?", "complete")]
                                + [(m.role, m.content, m.status) for m in msgs[2:]])
    return ident


@pytest.mark.parametrize("how, reason", [
    ("truncated", "damaged"),
    ("corrupt", "checksum"),
    ("missing", "no snapshot was saved"),
    ("other model", "made with model stories260K, not stories260K-4bit"),
    ("other weights", "weights of stories260K have changed"),
    ("transcript edited", "renders to other tokens"),
])
def test_unusable_snapshot_is_detected_and_the_transcript_reprefilled(
        stories_loaded, stories_id, tmp_path, how, reason):
    lm = stories_loaded
    with open_chat(stories_session(lm), stories_id, tmp_path) as chat:
        for q in QUESTIONS[:2]:
            run(chat.send(q))
        cid = chat.conversation_id
    ident = _damage(tmp_path, cid, how, stories_id)
    chat = open_chat(stories_session(lm), ident, tmp_path, resume=cid)
    info = chat.resume_info
    assert info.source == "transcript" and reason in info.reason
    notes = chat.take_notes()
    assert len(notes) == 1 and "re-prefilling its 4 messages" in notes[0].text and reason in notes[0].text
    done = run(chat.send(QUESTIONS[2]))
    assert done.stats.reused_tokens == 0 and done.stats.prefill_tokens == done.stats.prompt_tokens
    # the re-prefilled conversation answers as a fresh session given the same transcript does
    fresh = stories_session(lm)
    fresh.conversation = chat.session.conversation.copy()
    fresh.conversation.messages.pop()
    assert run(fresh.reply()).text == done.text
    chat.close()
    # the next resume uses the fresh snapshot again
    with open_chat(stories_session(lm), ident, tmp_path, resume=cid) as again:
        assert again.resume_info.source == "snapshot"


# ---- replies cut short ---------------------------------------------------------------------------------
def test_partial_reply_written_while_streaming_then_marked_interrupted(stories_loaded, stories_id, tmp_path):
    lm = stories_loaded
    chat = open_chat(stories_session(lm, GenerationSettings(temp=0.0, max_tokens=400)), stories_id, tmp_path)
    shown, n, seen_partial = "", 0, None
    for ev in chat.send(QUESTIONS[0]):
        if isinstance(ev, TokenEvent):
            shown += ev.text
            n += 1
            if n == PARTIAL_TOKENS + 6:
                seen_partial = contents(tmp_path)[-1]
            if n == PARTIAL_TOKENS + 30:
                chat.session.cancel()
        elif isinstance(ev, TurnDone):
            done = ev
    role, text, status = seen_partial
    assert role == "assistant" and status == "in_progress" and text and shown.startswith(text)
    assert done.stats.finish == "cancelled"
    last = chat.session.conversation.last
    assert last.interrupted and contents(tmp_path)[-1] == ("assistant", last.content, "interrupted")
    assert chat.session.cache_consistent()
    chat.session.generation = GREEDY  # a short next reply
    nxt = run(chat.send(QUESTIONS[1]))
    assert nxt.stats.generated_tokens > 0 and nxt.stats.reused_tokens > 0
    chat.close()
    statuses = [s for _, _, s in contents(tmp_path)]
    assert statuses == ["complete", "interrupted", "complete", "complete"]
    with open_chat(stories_session(lm), stories_id, tmp_path, resume="latest") as again:
        assert again.resume_info.source == "snapshot"
        assert again.session.conversation.messages[1].interrupted


def test_reply_abandoned_mid_stream_is_kept_interrupted(stories_loaded, stories_id, tmp_path):
    """What a forced quit (a second Ctrl-C raising mid-reply) leaves: the shown text, interrupted."""
    lm = stories_loaded
    chat = open_chat(stories_session(lm, GenerationSettings(temp=0.0, max_tokens=200)), stories_id, tmp_path)
    shown = ""
    events = chat.send(QUESTIONS[0])
    for i, ev in enumerate(events):
        if isinstance(ev, TokenEvent):
            shown += ev.text
        if i == 20:
            break
    chat.close()  # the turn is still open: close keeps what was shown
    assert contents(tmp_path) == [("user", QUESTIONS[0], "complete"), ("assistant", shown, "interrupted")]


# ---- failures ------------------------------------------------------------------------------------------
def test_a_reply_that_fails_part_way_still_ends_with_a_turn_done_marked_failed(stories_loaded, stories_id, tmp_path):
    """The turn driver ends a reply that raises part-way with a TurnDone (``error`` set, finish
    "error", the text shown, the conversation it went into), then lets the exception go on."""
    from chatapp.engine.requests import Send

    chat = open_chat(stories_session(stories_loaded, GenerationSettings(temp=0.0, max_tokens=200)), stories_id,
                     tmp_path)
    real = chat.session.decode

    def failing(*args, **kwargs):
        for i, ev in enumerate(real(*args, **kwargs)):
            if i == 12:
                raise RuntimeError("the device went away")
            yield ev

    chat.session.decode = failing
    seen: list = []
    with pytest.raises(RuntimeError, match="the device went away"):
        chat.turn(Send(QUESTIONS[0]), seen.append, lambda notes: None)
    done = seen[-1]
    assert isinstance(done, TurnDone), [type(ev).__name__ for ev in seen[-3:]]
    assert done.error == "the device went away" and done.stats.finish == "error"
    shown = "".join(ev.text for ev in seen if isinstance(ev, TokenEvent))
    assert shown and done.text == shown
    assert done.conversation_id is not None and done.conversation_id == chat.conversation_id
    chat.close()
    assert contents(tmp_path) == [("user", QUESTIONS[0], "complete"), ("assistant", shown, "interrupted")]


def test_database_full_goes_on_in_memory_and_keeps_what_was_saved(stories_loaded, stories_id, tmp_path):
    lm = stories_loaded
    chat = open_chat(stories_session(lm), stories_id, tmp_path)
    first = run(chat.send(QUESTIONS[0]))
    assert chat.save_snapshot()
    snap_before = snapshot_path(tmp_path, chat.conversation_id).read_bytes()
    conn = chat.store._conn  # SQLite's own size limit: writes that need a new page fail with SQLITE_FULL
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages}")
    long_text = "the " * 1100  # more than a 4 KiB page, and few tokens
    done = run(chat.send(long_text))  # the chat goes on
    assert done.stats.generated_tokens > 0
    notes = chat.take_notes()
    assert len(notes) == 1 and notes[0].level == "error"
    assert "database or disk is full" in notes[0].text and "goes on in memory" in notes[0].text
    assert not chat.saving and not chat.save_snapshot()
    again = run(chat.send(QUESTIONS[1]))
    assert again.stats.reused_tokens > 0 and chat.take_notes() == []  # said once
    chat.close()
    with ChatStore.open(tmp_path) as st:
        assert st.integrity_ok()
    assert contents(tmp_path) == [("user", QUESTIONS[0], "complete"), ("assistant", first.text, "complete")]
    assert snapshot_path(tmp_path, 1).read_bytes() == snap_before


def test_snapshot_write_failure_is_reported_and_messages_still_saved(stories_loaded, stories_id, tmp_path):
    snapshot_dir(tmp_path).parent.mkdir(exist_ok=True)
    snapshot_dir(tmp_path).write_text("a file where the snapshot folder should be")
    with open_chat(stories_session(stories_loaded), stories_id, tmp_path) as chat:
        run(chat.send(QUESTIONS[0]))
        assert not chat.save_snapshot()
        notes = chat.take_notes()
        assert len(notes) == 1 and "could not save the KV snapshot" in notes[0].text
        run(chat.send(QUESTIONS[1]))
        assert chat.saving
    assert len(contents(tmp_path)) == 4


def test_unwritable_data_dir_runs_in_memory(stories_loaded, stories_id, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with open_chat(stories_session(stories_loaded), stories_id, not_a_dir / "data") as chat:
        notes = chat.take_notes()
        assert len(notes) == 1 and notes[0].level == "error" and "kept in memory only" in notes[0].text
        assert run(chat.send(QUESTIONS[0])).stats.generated_tokens > 0
        assert not chat.saving


def test_second_chat_on_the_same_dir_is_told_and_not_saved(stories_loaded, stories_id, tmp_path):
    lm = stories_loaded
    a = open_chat(stories_session(lm), stories_id, tmp_path)
    run(a.send(QUESTIONS[0]))
    b = open_chat(stories_session(lm), stories_id, tmp_path)
    notes = b.take_notes()
    assert len(notes) == 1 and "another chatapp" in notes[0].text and "will not be saved" in notes[0].text
    run(b.send("A different conversation."))
    assert not b.saving and b.conversation_id is None
    b.close()
    # a busy store can still be resumed from, read-only
    c = open_chat(stories_session(lm), stories_id, tmp_path, resume="latest")
    assert [m.content for m in c.session.conversation.messages][:1] == [QUESTIONS[0]] and not c.saving
    c.close()
    run(a.send(QUESTIONS[1]))
    a.close()
    with ChatStore.open(tmp_path) as st:
        assert len(st.list_conversations()) == 1 and st.integrity_ok()
    assert len(contents(tmp_path)) == 4


def test_snapshot_cap_prunes_oldest_and_skips_oversized(stories_loaded, stories_id, tmp_path):
    lm = stories_loaded
    with open_chat(stories_session(lm), stories_id, tmp_path, snapshot_cap_mb=0) as chat:
        run(chat.send(QUESTIONS[0]))
        assert not chat.save_snapshot()
    assert snapshot_files(tmp_path) == []
    sizes = []
    for q in QUESTIONS[:3]:
        with open_chat(stories_session(lm), stories_id, tmp_path) as chat:
            chat.cap_bytes = 200_000
            run(chat.send(q))
            run(chat.send(q))
            assert chat.save_snapshot()
            sizes.append(snapshot_path(tmp_path, chat.conversation_id).stat().st_size)
    kept = snapshot_files(tmp_path)
    assert sum(p.stat().st_size for p in kept) <= 200_000 and kept[-1] == snapshot_path(tmp_path, 4)
    assert snapshot_path(tmp_path, 2) not in kept  # the oldest went first
    with open_chat(stories_session(lm), stories_id, tmp_path) as chat:
        chat.cap_bytes = 1000
        run(chat.send(QUESTIONS[0]))
        assert not chat.save_snapshot() and not chat.save_snapshot()
        notes = chat.take_notes()
        assert len(notes) == 1 and "larger than data.snapshot_cap_mb" in notes[0].text


# ---- what is sent ------------------------------------------------------------------------------------
def test_long_messages_follow_the_policy_or_are_refused(stories_loaded, stories_id, tmp_path):
    lm = stories_loaded  # trained context: 512 positions
    long_text = " ".join(f"The cat number {i} sat on the mat." for i in range(120))
    blank = PersistentChat(stories_session(lm), stories_id).prepare("  \t ")
    assert not blank.send and blank.refusal == ""

    chat = open_chat(stories_session(lm, mode="prealloc"), stories_id, tmp_path / "a")
    p = chat.prepare(long_text)
    assert not p.send and "more than the model's context of 512" in p.refusal and "prealloc" in p.refusal
    assert chat.session.conversation.messages == []
    chat.close()

    chat = open_chat(stories_session(lm, mode="auto"), stories_id, tmp_path / "b")
    p = chat.prepare(long_text)
    assert p.send and chat.session.mode == "window" and any("longer than the model's context" in n for n in p.notes)
    done = run(chat.send(p.text))
    assert done.stats.mode == "window" and done.stats.cache.evicted > 0 and done.stats.generated_tokens > 0
    assert contents(tmp_path / "b")[0] == ("user", long_text, "complete")  # stored whole
    chat.close()

    chat = PersistentChat(stories_session(lm, mode="window", cache_settings=CacheSettings(window=128, sinks=4)),
                          stories_id)
    p = chat.prepare(long_text)
    assert p.send and any("more than the" in n and "the whole message is kept" in n for n in p.notes)


def test_control_characters_and_invalid_utf8_are_stored_intact(tmp_path):
    from chatapp.model.synthetic import byte_tokenizer

    model, tok = tiny_llama(layers=2), byte_tokenizer()
    s = Session(model, tok, generation=GenerationSettings(temp=1.0, seed=3, max_tokens=60))
    nasty = "esc \x1b[31mred\x1b[0m bell \x07 nul \x00 " + b"bad \xff\xfe".decode("utf-8", "surrogateescape")
    with open_chat(s, ModelIdentity("tiny", "tiny", "fp"), tmp_path) as chat:
        done = run(chat.send(nasty))
        sent = s.conversation.messages[0].content
    assert sent == clean_text(nasty) and "\ufffd\ufffd" in sent and "\x1b[31m" in sent
    stored = contents(tmp_path)
    assert stored == [("user", sent, "complete"), ("assistant", done.text, "complete")]
    # the random byte model produced raw bytes: whatever the reply holds is kept as decoded
    assert any(ord(c) < 32 or c == "\ufffd" for c in done.text)


def test_resume_unknown_id_is_refused(stories_loaded, stories_id, tmp_path):
    from chatapp.store import NotFound

    with pytest.raises(NotFound):
        open_chat(stories_session(stories_loaded), stories_id, tmp_path, resume="latest")
    with open_chat(stories_session(stories_loaded), stories_id, tmp_path) as chat:
        run(chat.send(QUESTIONS[0]))
    with pytest.raises(NotFound):
        open_chat(stories_session(stories_loaded), stories_id, tmp_path, resume=42)
    shutil.rmtree(tmp_path)


def test_a_chat_template_that_refuses_the_conversation_is_a_clear_refusal():
    """A transcript ending with an unanswered user message (a kill before the first token),
    resumed with a template that insists on alternating roles: refused, never a crash."""
    from chatapp.model.synthetic import byte_tokenizer
    from chatapp.prompt.conversation import Conversation

    tok = byte_tokenizer()
    tok._tokenizer.chat_template = (
        "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    s = Session(tiny_llama(layers=2), tok, generation=GREEDY)
    assert s.format.name == "template"
    s.conversation = Conversation()
    s.conversation.add("user", "a question left without a reply")
    p = PersistentChat(s, ModelIdentity("tiny", "tiny", "fp")).prepare("another one")
    assert not p.send and "chat template refuses the conversation" in p.refusal
    assert "roles must alternate" in p.refusal and len(s.conversation.messages) == 1
