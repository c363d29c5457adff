"""The typed engine boundary and the Session's seams: requests dispatched by type, one message per
event kind, the token-level decode under the text-level one, admission, the turn driver and the
--stats-json writer."""

from __future__ import annotations

import dataclasses
import json

import pytest

from chatapp.engine import events as engine_events
from chatapp.engine.events import Failed, Idle, Loaded, PrefillProgress, SessionInfo, TokenEvent, TurnDone
from chatapp.engine.requests import Describe, NewChat, Regenerate, Send
from chatapp.engine.stats import TurnStats
from chatapp.store.statslog import StatsLog

GREEDY_KW = dict(temp=0.0, max_tokens=12)


class _FakeSession:
    model_id = "fake"

    def __init__(self):
        import threading
        from types import SimpleNamespace

        self.calls = []
        self.flag = threading.Event()  # the worker's cancel flag once made (``_maker``)
        self.conversation = SimpleNamespace(messages=[])

    def load_lines(self):
        return ["loaded"]

    def send(self, text):
        self.calls.append(("send", text, "cancelled" if self.flag.is_set() else "clear"))
        yield TokenEvent(text, 1, TurnStats())
        yield TurnDone(text, TurnStats())

    def switch(self, mode, **changes):  # the worker's SwitchMode: within the request it began
        from chatapp.engine.events import Switched

        self.calls.append(("switch_mode", mode, "cancelled" if self.flag.is_set() else "clear"))
        return Switched(mode, "converted", "", 0.0)

    def new_chat(self):
        self.calls.append(("new_chat",))

    def describe(self):
        raise RuntimeError("no cache here")



def _maker(session):
    """The worker's ``make_session``: the fake session on the worker's cancel flag."""

    def make(emit, cancel):
        session.flag = cancel
        return session

    return make


def _run_worker(requests, cancel_after=(), session=None):
    """Run ``requests`` through an EngineWorker over a fake session; a cancel is set as each event
    of a type in ``cancel_after`` is emitted (as Esc arriving while it reaches the screen)."""
    from chatapp.engine.worker import EngineWorker

    got = []
    session = session or _FakeSession()

    def on_event(ev):
        got.append(ev)
        if isinstance(ev, cancel_after):
            worker.cancel()  # Esc: EngineBridge.cancel -> EngineWorker.cancel

    worker = EngineWorker(_maker(session), on_event)
    worker.start()
    for r in requests:
        worker.submit(r)
    worker.stop()
    worker.join(10)
    return session, got


def test_worker_dispatches_on_the_request_type_and_says_what_failed():
    session, got = _run_worker([Send("hi"), NewChat(), Describe(), Regenerate()])
    assert isinstance(got[0], Loaded) and got[0].model_id == "fake" and got[0].notes == ["loaded"]
    assert session.calls == [("send", "hi", "clear"), ("new_chat",)]
    kinds = [type(e) for e in got[1:]]
    assert kinds == [TokenEvent, TurnDone, Idle, Idle, Failed, Idle, Failed, Idle]
    describe_failure, regenerate_failure = [e for e in got if isinstance(e, Failed)]
    assert describe_failure.message == "describe failed: no cache here"
    assert regenerate_failure.message.startswith("regenerate failed:")  # the fake has no regenerate


def test_the_workers_own_turn_that_fails_part_way_still_ends_with_a_turn_done():
    """With no store part attached the worker runs a Send itself: a reply that raises part-way
    ends, as the store's turn driver ends it, with a TurnDone marked failed (the text shown, which
    the conversation keeps as an interrupted reply), then Failed and Idle."""

    class Breaks(_FakeSession):
        def send(self, text):
            self.conversation.messages.append(("user", text))
            return self._reply()

        def _reply(self):
            yield TokenEvent("half a ", 1, TurnStats(generated_tokens=1))
            yield TokenEvent("reply", 2, TurnStats(generated_tokens=2))
            raise RuntimeError("the device went away\nsecond line")

        def keep_interrupted(self, text, seq):
            self.calls.append(("kept", text, seq))

    session, got = _run_worker([Send("hi")], session=Breaks())
    assert [type(e) for e in got[1:]] == [TokenEvent, TokenEvent, TurnDone, Failed, Idle]
    done = got[3]
    assert done.error == "the device went away" and done.text == "half a reply"
    assert done.stats.finish == "error" and done.stats.generated_tokens == 2
    assert session.calls == [("kept", "half a reply", 1)]
    assert got[4].message == "send failed: the device went away\nsecond line"


def test_a_part_takes_request_kinds_through_the_one_dispatcher():
    """A layer above (the store's ChatRequests) takes a request kind with ``handle``: the worker's
    one dispatcher hands it over (the engine's own handling never runs for it), every other kind
    stays the engine's, and ``on_stop`` hooks run on the engine thread as it ends."""
    import threading

    from chatapp.engine.worker import EngineWorker

    got, taken, stopped = [], [], []
    session = _FakeSession()
    worker = EngineWorker(_maker(session), got.append)
    worker.handle(NewChat, lambda request: taken.append(request))
    worker.on_stop(lambda: stopped.append(threading.current_thread().name))
    worker.start()
    worker.submit(NewChat())
    worker.submit(Send("hi"))
    worker.stop()
    worker.join(10)
    assert taken == [NewChat()] and session.calls == [("send", "hi", "clear")]
    assert stopped == ["chatapp-engine"]


def test_each_request_starts_with_a_clear_cancel_flag():
    """Esc as a reply ends (its TurnDone) sets the cancel flag after the reply checked it last; the
    mode switch queued behind the reply (F3 during it) and the next message must not see it."""
    from chatapp.engine.requests import SwitchMode

    session, got = _run_worker([Send("one"), SwitchMode("window"), Send("two")], cancel_after=(TurnDone,))
    assert session.calls == [("send", "one", "clear"), ("switch_mode", "window", "clear"),
                             ("send", "two", "clear")]


def test_a_switch_whose_description_fails_still_reports_the_switch():
    """The switch is its own event (``Switched``, the report with the session it produced); when
    only the description fails after a switch that happened, the report still goes out (no
    ``info``), then a Failed that says the switch happened, not "switch_mode failed"."""
    from chatapp.engine.requests import SwitchMode

    _, got = _run_worker([SwitchMode("window")])  # the fake session cannot describe itself
    kinds = [type(e) for e in got[1:]]
    assert kinds == [engine_events.Switched, Failed, Idle]
    switched, failed = got[1], got[2]
    assert switched.mode == "window" and switched.action == "converted" and switched.info is None
    assert failed.message == ("cache mode window: switched, but the session could not describe itself: "
                              "no cache here")
    assert "switch_mode failed" not in failed.message


def test_state_changes_carry_the_session_they_produce():
    """Loaded, Switched, a new chat and a failure each come with the session's description: the
    front end never sends Describe to learn what a request it made did."""
    from chatapp.engine.requests import SwitchMode
    from chatapp.engine.stats import CacheView

    class Described(_FakeSession):
        mode = "prealloc"

        def describe(self):
            return SessionInfo("fake", self.mode, self.mode, CacheView(mode=self.mode))

        def switch(self, mode, **changes):
            self.mode = mode
            return super().switch(mode, **changes)

    _, got = _run_worker([SwitchMode("window"), NewChat(), Regenerate()], session=Described())
    loaded, switched = got[0], next(e for e in got if isinstance(e, engine_events.Switched))
    assert loaded.info.mode == "prealloc" and switched.info.mode == "window"
    assert switched.info.cache.mode == "window"
    after_new_chat = got[got.index(switched) + 2]  # Switched, Idle, then the new chat's description
    assert isinstance(after_new_chat, SessionInfo)
    failed = next(e for e in got if isinstance(e, Failed))
    assert failed.info is not None and failed.info.mode == "window"


def test_every_event_kind_has_its_message():
    pytest.importorskip("textual")
    from chatapp.ui.bridge import EngineBridge
    from chatapp.ui.messages import MESSAGES

    travelling = [engine_events.LoadProgress, engine_events.Loaded, engine_events.SessionInfo,
                  engine_events.PrefillProgress, engine_events.TokenEvent, engine_events.TurnDone,
                  engine_events.Idle, engine_events.Switched, engine_events.CompareResult, engine_events.Failed,
                  engine_events.SystemChange, engine_events.ModelSwitch, engine_events.ModelReleased,
                  engine_events.ChatNotes, engine_events.TranscriptLoaded, engine_events.ConversationChanged,
                  engine_events.StartupFailed]
    for cls in travelling:
        assert cls in MESSAGES, cls
    kinds = [m.kind for m in MESSAGES.values()]
    assert len(set(kinds)) == len(kinds) and all(kinds)
    posted = []
    bridge = EngineBridge(None, posted.append)  # what the engine thread's events go through
    bridge.on_event(Idle())
    assert posted[0].kind == "Idle" and isinstance(posted[0].event, Idle)
    with pytest.raises(KeyError):
        bridge.on_event(object())


def test_stats_log_appends_one_row_per_turn(tmp_path):
    path = tmp_path / "stats.jsonl"
    for n in (1, 2):
        log = StatsLog(str(path))
        log.write(TurnStats(prompt_tokens=n, finish="eos"), conversation_id=n)
        log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["prompt_tokens"], r["conversation_id"]) for r in rows] == [(1, 1), (2, 2)]
    StatsLog(None).write(TurnStats())  # no file: writes nothing, fails nothing


def test_bench_cache_flags_default_to_the_config():
    import argparse

    from chatapp.bench.report import add_cache_arguments, cache_knobs
    from chatapp.config import CacheConfig

    p = argparse.ArgumentParser()
    add_cache_arguments(p, max_kv_tokens=2048)
    knobs = cache_knobs(p.parse_args(["--window", "64"]))
    base = CacheConfig()
    assert knobs == dict(window=64, sinks=base.sinks, max_kv_tokens=2048, evict_chunk=base.evict_chunk,
                         quant_start=base.quant_start, kv_bits=base.kv_bits, kv_group_size=base.kv_group_size,
                         chunk_size=base.chunk_size)
    # every number knob of CacheSettings has its flag (cache.settings.KNOBS, declared once)
    from cache.settings import SETTINGS_KNOBS

    assert set(knobs) == {k.name for k in SETTINGS_KNOBS if k.type is int}


# ---- with a model ------------------------------------------------------------------------------------
def test_decode_tokens_is_the_token_stream_under_the_reply(stories):
    import mlx.core as mx

    from chatapp.engine.generate import GenerationSettings, decode_tokens
    from chatapp.engine.session import Session

    model, tok = stories
    s = Session(model, tok, generation=GenerationSettings(**GREEDY_KW), eos_ids=set())
    s.conversation.add("user", "Once upon a time")
    reply = [ev.token for ev in s.reply() if isinstance(ev, TokenEvent) and ev.token >= 0]
    assert len(reply) == GREEDY_KW["max_tokens"]

    fresh = Session(model, tok)
    prompt = fresh.format.tokens(_conv("Once upon a time"))
    logits = fresh.prefill(prompt)  # the last position's logits; the caches now hold the prompt
    assert logits is not None and fresh.cached == prompt and fresh.prefill([]) is None
    steps = list(decode_tokens(model, fresh.caches, logits, lambda lg: mx.argmax(lg, axis=-1), 12))
    assert [t for t, _, _ in steps] == reply
    assert [fed for _, fed, _ in steps] == [True] * 11 + [False]  # the last one never goes back in
    assert [c for _, _, c in steps[:3]] == [len(prompt) + 1, len(prompt) + 2, len(prompt) + 3]

    stop = {"n": 0}

    def cancelled():
        stop["n"] += 1
        return stop["n"] > 3

    fresh2 = Session(model, tok)
    short = list(decode_tokens(model, fresh2.caches, fresh2.prefill(prompt), lambda lg: mx.argmax(lg, axis=-1),
                               12, cancelled=cancelled))
    assert [t for t, _, _ in short] == reply[:3]


def _conv(text):
    from chatapp.prompt.conversation import Conversation

    c = Conversation.start("")
    c.add("user", text)
    return c


def test_admit_refuses_past_the_context_in_a_keep_everything_mode(stories):
    from cache import CacheSettings
    from chatapp.engine.session import Session

    model, tok = stories
    s = Session(model, tok, mode="prealloc", cache_settings=CacheSettings(mode="prealloc"))
    ok = s.admit("Once upon a time")
    assert ok.send and ok.refusal == "" and ok.notes == []
    assert s.conversation.messages == []  # admission adds nothing
    long = " ".join(["the cat sat on the mat"] * 400)
    refused = s.admit(long)
    assert not refused.send and "more than the model's context" in refused.refusal and "prealloc" in refused.refusal
    auto = Session(model, tok, mode="auto")
    taken = auto.admit(long)
    assert taken.send and "longer than the model's context" in taken.notes[0] and auto.settings.evicts


def test_turn_driver_admits_streams_and_reports(stories, tmp_path):
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session
    from chatapp.store.chat import ModelIdentity, PersistentChat

    model, tok = stories
    s = Session(model, tok, mode="prealloc", generation=GenerationSettings(**GREEDY_KW))
    chat = PersistentChat(s, ModelIdentity("stories", "stories", ""), None)
    seen, notes, started = [], [], []
    result = chat.turn(Send("Once upon a time"), seen.append, notes.append, started=lambda: started.append(1))
    assert result.refusal == "" and isinstance(result.done, TurnDone) and seen[-1] is result.done
    assert started == [1] and [m.role for m in s.conversation.messages] == ["user", "assistant"]
    assert all(isinstance(ev, (PrefillProgress, TokenEvent, TurnDone)) for ev in seen)
    refused = chat.turn(Send(" ".join(["the cat sat on the mat"] * 400)), seen.append, notes.append,
                        started=lambda: started.append(2))
    assert refused.done is None and "message not sent" in refused.refusal and started == [1]
    again = chat.turn(Regenerate(), seen.append, notes.append)
    assert again.done is not None and len(s.conversation.messages) == 2
    with pytest.raises(ValueError):
        chat.turn(NewChat(), seen.append, notes.append)


def test_describe_reads_the_session(stories):
    from chatapp.engine.session import Session

    model, tok = stories
    s = Session(model, tok, mode="window", model_id="stories", system="Be brief.")
    info = s.describe()
    assert isinstance(info, SessionInfo) and info.model_id == "stories" and info.mode == "window"
    assert info.requested_mode == "window" and info.has_system and info.messages == 1
    assert set(info.settings) == {"window", "sinks", "kv_bits", "kv_group_size", "max_kv_tokens", "kv_key_layout"}
    assert dataclasses.asdict(info)["cache"]["mode"] == "window"
