"""Streamed tokens and prefill progress batched at the bridge: a token that arrives while the
message of the tokens before it still waits in the app's queue joins it, so a burst within one
frame is one message; the UI gets the same text, in order, and the newest statistics, and every
token is recorded. A prefill's progress batches by the same rule (one ``BatchMessage``), the
newest report replacing the one waiting."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("textual")

from chatapp.config import Config  # noqa: E402
from chatapp.engine.events import Idle, PrefillProgress, TokenEvent, TurnDone  # noqa: E402
from chatapp.engine.stats import TurnStats  # noqa: E402
from chatapp.ui.bridge import EngineBridge  # noqa: E402
from chatapp.ui.engine_link import EngineClient, deliver  # noqa: E402
from chatapp.ui.transcript import Transcript  # noqa: E402


def _token(text: str, n: int) -> TokenEvent:
    return TokenEvent(text, n, TurnStats(generated_tokens=n))


def test_tokens_waiting_in_the_queue_are_one_message():
    posted = []
    bridge = EngineBridge(None, posted.append)
    live = TurnStats(generated_tokens=1)
    bridge.on_event(TokenEvent("Hel", 1, live))
    live.generated_tokens = 99  # the engine goes on mutating its live stats: the message keeps a copy
    for n, text in enumerate(["lo", " wor", "ld"], start=2):
        bridge.on_event(_token(text, n))
    assert len(posted) == 1 and posted[0].kind == "TokenEvent"
    event, count = posted[0].take()
    assert (event.text, event.token, event.stats.generated_tokens, count) == ("Hello world", 4, 4, 4)

    # The UI took the batch: the next token is a message of its own, and nothing joins the taken one.
    bridge.on_event(_token("!", 5))
    assert len(posted) == 2 and posted[0].take() == (event, 4)
    assert posted[1].take()[0].text == "!"


def test_nothing_joins_a_batch_across_another_event():
    """A reply's end (or any other event) closes the batch: the next reply's tokens come after it."""
    posted = []
    bridge = EngineBridge(None, posted.append)
    bridge.on_event(_token("one", 1))
    bridge.on_event(TurnDone("one", TurnStats()))
    bridge.on_event(Idle())
    bridge.on_event(_token("two", 1))
    bridge.on_event(_token(" more", 2))
    assert [m.kind for m in posted] == ["TokenEvent", "TurnDone", "Idle", "TokenEvent"]
    assert posted[0].take()[0].text == "one" and posted[3].take()[0].text == "two more"


def test_a_batch_reaches_the_client_as_its_tokens_would():
    """The client handles a batch once: the pending text is all of it, the statistics the newest,
    the event log has one entry per token (tests count tokens there)."""
    posted = []
    host = SimpleNamespace(post_message=posted.append, is_mounted=False)
    client = EngineClient(host, Config(), Transcript(lambda: None))
    for n, text in enumerate(["a", "b", "c"], start=1):
        client.bridge.on_event(_token(text, n))
    asyncio.run(deliver(SimpleNamespace(engine=client), posted[0]))
    assert client._pending_text == "abc" and client.live_stats.generated_tokens == 3
    assert list(client.event_log) == ["TokenEvent"] * 3
    assert client.status_rate.runs == 1  # one status request for the batch


def test_no_token_is_lost_while_the_engine_and_the_ui_race():
    """Tokens posted on one thread while another takes the messages as they come: every token's
    text arrives once, in order, and the messages never outnumber the tokens."""
    posted, taken, lock = [], [], threading.Lock()

    def post(message):
        with lock:
            posted.append(message)

    bridge = EngineBridge(None, post)
    done = threading.Event()

    def engine():
        for n in range(2000):
            bridge.on_event(_token(f"{n},", n))
        done.set()

    thread = threading.Thread(target=engine)
    thread.start()
    while not done.is_set() or len(taken) < len(posted):
        with lock:
            ready = posted[len(taken):]
        taken.extend(m.take() for m in ready)
    thread.join()
    assert "".join(event.text for event, _ in taken) == "".join(f"{n}," for n in range(2000))
    assert sum(count for _, count in taken) == 2000 and len(taken) <= 2000


def _progress(done: int, total: int = 4096) -> PrefillProgress:
    return PrefillProgress(done, total, TurnStats(prompt_tokens=done))


def test_prefill_progress_waiting_in_the_queue_is_replaced_by_the_newest():
    """A long prefill reports each chunk: while the last report waits in the app's queue, a newer
    one takes its place (only the newest matters); once the UI took it, the next is its own."""
    posted = []
    bridge = EngineBridge(None, posted.append)
    live = TurnStats(prompt_tokens=512)
    bridge.on_event(PrefillProgress(512, 4096, live))
    live.prompt_tokens = 99  # the engine goes on mutating its live stats: the message keeps a copy
    for done in (1024, 1536, 2048):
        bridge.on_event(_progress(done))
    assert len(posted) == 1 and posted[0].kind == "PrefillProgress"
    event, count = posted[0].take()
    assert (event.done, event.total, event.stats.prompt_tokens, count) == (2048, 4096, 2048, 4)

    bridge.on_event(_progress(2560))
    assert len(posted) == 2 and posted[0].take() == (event, 4)
    assert posted[1].take()[0].done == 2560


def test_any_other_event_closes_a_prefill_batch():
    """The first token after a prefill is its own message (and the tokens after it join that one),
    a later prefill does not join the tokens, and nothing joins across a reply's end."""
    posted = []
    bridge = EngineBridge(None, posted.append)
    bridge.on_event(_progress(512))
    bridge.on_event(_progress(1024))
    bridge.on_event(_token("a", 1))
    bridge.on_event(_token("b", 2))
    bridge.on_event(_progress(2048))
    bridge.on_event(TurnDone("ab", TurnStats()))
    bridge.on_event(_progress(64, 128))
    bridge.on_event(_progress(128, 128))
    kinds = [m.kind for m in posted]
    assert kinds == ["PrefillProgress", "TokenEvent", "PrefillProgress", "TurnDone", "PrefillProgress"]
    assert posted[0].take()[0].done == 1024 and posted[1].take()[0].text == "ab"
    assert posted[2].take() == (_progress(2048), 1)
    assert posted[4].take()[0].done == 128


def test_a_prefill_batch_reaches_the_client_as_its_reports_would():
    """The client handles a batch once, with the newest progress on its status line; the event log
    has one entry per report."""
    posted = []
    host = SimpleNamespace(post_message=posted.append, is_mounted=False)
    client = EngineClient(host, Config(), Transcript(lambda: None))
    for done in (100, 200, 300):
        client.bridge.on_event(_progress(done, 400))
    asyncio.run(deliver(SimpleNamespace(engine=client), posted[0]))
    assert len(posted) == 1 and client.phase == "prefill 75%" and client.live_stats.prompt_tokens == 300
    assert list(client.event_log) == ["PrefillProgress"] * 3
    assert client.status_rate.runs == 1
