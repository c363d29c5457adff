"""The TUI saves its conversations, and the sessions screen (F7) opens, renames and deletes them.

Pilot tests on the real stories260K-4bit model (skipped without ../shared), each with its own
temporary data directory (``data.dir``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from test_ui import (  # noqa: E402
    async_test,
    make_config,
    press_nowait,
    ready,
    replies,
    screen_text,
    turn,
    wait_until,
)

from chatapp.store import ChatStore  # noqa: E402
from chatapp.store.paths import snapshot_path  # noqa: E402
from chatapp.ui.app import ChatApp  # noqa: E402
from chatapp.ui.screens import ConfirmDialog, RenameDialog, SessionsScreen  # noqa: E402
from chatapp.ui.widgets import AssistantMessage, ChatInput, UserMessage  # noqa: E402

pytestmark = pytest.mark.shared


def config_for(model, data_dir, **overrides):
    return make_config(model, **{"data.dir": str(data_dir), **overrides})


async def run_and_quit(app, pilot_fn, size=(100, 30)) -> None:
    async with app.run_test(size=size) as pilot:
        await ready(pilot)
        await pilot_fn(pilot)
        await pilot.press("ctrl+q")
    # The engine thread closes the chat (snapshot saved, lock released) after the quit command.
    app.engine.bridge.worker.join(30)
    assert not app.engine.bridge.worker._thread.is_alive()


def stored(data_dir):
    with ChatStore.open(data_dir, write=False) as store:
        return [(c, store.messages(c.id)) for c in store.list_conversations()]


@async_test
async def test_sessions_screen_opens_renames_and_deletes(stories4_path, tmp_path):
    config = config_for(stories4_path, tmp_path)

    # 1. A first run: one turn, saved with its KV snapshot.
    first = ChatApp(config, freeze_stats=True)

    async def chat(pilot):
        await turn(pilot, "Once upon a time")

    await run_and_quit(first, chat)
    [(conv, msgs)] = stored(tmp_path)
    reply_text = first.transcript.entries[-1].text
    assert [(m.role, m.content, m.status) for m in msgs] == [
        ("user", "Once upon a time", "complete"), ("assistant", reply_text, "complete")]
    assert conv.title == "Once upon a time" and conv.snapshot_bytes > 0
    assert snapshot_path(tmp_path, conv.id).exists()

    # 2. A new app: F7 lists it; Enter opens it and the next reply reuses its restored cache.
    app = ChatApp(config, freeze_stats=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("f7")
        screen = app.screen
        assert isinstance(screen, SessionsScreen)
        assert [c.id for c in screen.rows] == [conv.id]
        text = await screen_text(pilot)
        assert "Once upon a time" in text and "stories260K-4bit" in text and "Saved conversations" in text
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.engine.conversation_id == conv.id and not app.engine.busy,
                         what="the conversation to open")
        assert not isinstance(app.screen, SessionsScreen)
        entries = app.transcript.entries
        assert [(e.role, e.text) for e in entries] == [("user", "Once upon a time"), ("assistant", reply_text)]
        assert isinstance(entries[0].widget, UserMessage) and isinstance(entries[1].widget, AssistantMessage)
        assert "from its KV snapshot" in app.engine.resume_line and "no re-prefill" in app.engine.resume_line
        assert any("from its KV snapshot" in str(n.message) for n in app._notifications)
        restored = app.engine.bridge.chat.resume_info.snapshot_tokens
        assert restored > 0 and app.engine.info is not None and app.engine.info.messages == 2
        await turn(pilot, "The cat")
        stats = app.engine.last_stats
        # Everything the snapshot held was reused; only the new message was prefilled.
        assert stats.reused_tokens >= restored
        assert stats.prefill_tokens == stats.prompt_tokens - stats.reused_tokens < 25 < restored
        assert [e.role for e in app.transcript.entries] == ["user", "assistant", "user", "assistant"]

        # 3. Rename it (r, a dialog) ...
        await pilot.press("f7")
        assert isinstance(app.screen, SessionsScreen)
        await pilot.press("r")
        assert isinstance(app.screen, RenameDialog)
        box = app.screen.query_one("#rename-input")
        box.value = "Cats"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.engine.conversation_title == "Cats" and not app.engine.busy,
                         what="the rename")
        assert isinstance(app.screen, SessionsScreen)
        assert app.screen.rows[0].title == "Cats" and app.screen.rows[0].messages == 4
        assert "Cats" in await screen_text(pilot)

        # 4. ... and delete it (d, confirmed): it is gone from the store and from the screen.
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("n")  # cancel first: nothing happens
        assert isinstance(app.screen, SessionsScreen) and len(stored(tmp_path)) == 1
        await pilot.press("d")
        await pilot.press("y")
        await wait_until(pilot, lambda: not app.engine.busy and app.transcript.entries == [], what="the delete")
        assert stored(tmp_path) == [] and not snapshot_path(tmp_path, conv.id).exists()
        assert isinstance(app.screen, SessionsScreen) and app.screen.rows == []
        assert "no saved conversations" in await screen_text(pilot)
        await pilot.press("escape")
        # The chat goes on, as a new conversation.
        await turn(pilot, "A dog")
        assert app.engine.last_stats.reused_tokens == 0
        await pilot.press("ctrl+q")
    app.engine.bridge.worker.join(30)
    [(conv2, msgs2)] = stored(tmp_path)
    assert conv2.id != conv.id and conv2.title == "A dog" and len(msgs2) == 2


@async_test
async def test_resume_at_start_regenerate_edit_and_cancel_are_saved(stories4_path, tmp_path):
    config = config_for(stories4_path, tmp_path, **{"sampling.max_tokens": 400, "ui.render_interval_ms": 50})
    first = ChatApp(config, freeze_stats=True)

    async def chat(pilot):
        app = pilot.app
        await turn(pilot, "Once upon a time")
        await pilot.press("ctrl+r")  # regenerate: the stored reply is replaced
        await wait_until(pilot, lambda: len(app.engine.history) == 2 and not app.engine.busy, what="the regenerate")
        await pilot.press("ctrl+o")  # edit the last message and resend it
        app.query_one(ChatInput).text = "The dog"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.engine.history) == 3 and not app.engine.busy, what="the edit")
        # A reply stopped with Esc is saved, marked interrupted.
        before = app.engine.event_log.count("TokenEvent")
        await turn_nowait(pilot, "And then")
        await wait_until(pilot, lambda: app.engine.event_log.count("TokenEvent") >= before + 5, what="some tokens")
        await pilot.press("escape")
        await wait_until(pilot, lambda: len(app.engine.history) == 4 and not app.engine.busy, what="the cancel")
        assert app.engine.last_stats.finish == "cancelled"

    await run_and_quit(first, chat)
    [(conv, msgs)] = stored(tmp_path)
    assert [(m.role, m.status) for m in msgs] == [
        ("user", "complete"), ("assistant", "complete"), ("user", "complete"), ("assistant", "interrupted")]
    assert msgs[0].content == "The dog" and msgs[1].content == first.transcript.entries[1].text
    assert msgs[3].content == first.transcript.entries[3].text

    # run_tui(resume="latest"): the transcript is on screen once the model has loaded.
    app = ChatApp(config, freeze_stats=True, resume="latest")
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        assert app.engine.conversation_id == conv.id and "from its KV snapshot" in app.engine.resume_line
        assert [e.text for e in app.transcript.entries] == [m.content for m in msgs]
        assert "interrupted" in replies(app)[-1].tags
        await pilot.press("ctrl+q")
    app.engine.bridge.worker.join(30)


async def turn_nowait(pilot, text: str) -> None:
    box = pilot.app.query_one(ChatInput)
    box.focus()
    box.text = text
    press_nowait(pilot, "enter", "\r")
    await wait_until(pilot, lambda: box.text == "", what="Enter to be handled")


@async_test
async def test_busy_data_dir_runs_in_memory_with_one_note(stories4_path, tmp_path):
    holder = ChatStore.open(tmp_path, write=True)  # another chatapp holds the data directory
    try:
        app = ChatApp(config_for(stories4_path, tmp_path), freeze_stats=True)
        async with app.run_test(size=(100, 30)) as pilot:
            await ready(pilot)
            await wait_until(pilot, lambda: app.engine.store_notes, what="the note")
            [(level, text)] = app.engine.store_notes
            assert level == "note" and "this conversation will not be saved" in text and "another chatapp" in text
            await turn(pilot, "Once upon a time")
            assert app.transcript.entries[-1].role == "assistant"
            # The sessions screen still reads the store; rename and delete say why they cannot.
            await pilot.press("f7")
            assert isinstance(app.screen, SessionsScreen) and app.screen.rows == []
            await pilot.press("escape")
            app.delete_conversation(1)
            await wait_until(pilot, lambda: len(app.engine.store_notes) == 2 and not app.engine.busy,
                             what="the refusal")
            assert app.engine.store_notes[-1][0] == "error" and "not saving" in app.engine.store_notes[-1][1]
            await pilot.press("ctrl+q")
        app.engine.bridge.worker.join(30)
        assert holder.list_conversations() == []
    finally:
        holder.close()


class EngineThreadOnly:
    """Stands in for the engine thread's chat object: any attribute read from another thread (the
    UI's) fails the test, so the UI must take what it shows from the events."""

    def __init__(self, chat) -> None:
        object.__setattr__(self, "_chat", chat)

    def __getattr__(self, name: str):
        import threading

        assert threading.current_thread().name == "chatapp-engine", f"the UI thread read chat.{name}"
        return getattr(object.__getattribute__(self, "_chat"), name)

    def __setattr__(self, name: str, value) -> None:
        setattr(object.__getattribute__(self, "_chat"), name, value)


@async_test
async def test_a_first_turn_brings_its_conversation_id_to_the_ui(stories4_path, tmp_path):
    """The conversation a first turn creates comes to the UI on its TurnDone: F7 marks it as the
    current one without the UI reading the engine thread's chat."""
    app = ChatApp(config_for(stories4_path, tmp_path), freeze_stats=True)

    async def chat(pilot):
        assert app.engine.conversation_id is None
        app.engine.bridge.requests.chat = EngineThreadOnly(app.engine.bridge.requests.chat)
        await turn(pilot, "Once upon a time")
        [(conv, _)] = stored(tmp_path)
        assert app.engine.conversation_id == conv.id
        await pilot.press("f7")
        assert isinstance(app.screen, SessionsScreen) and app.screen.current == conv.id
        await pilot.press("escape")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.engine.busy, what="the new chat")
        assert app.engine.conversation_id is None

    await run_and_quit(app, chat)
