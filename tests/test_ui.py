"""Pilot tests of the Textual TUI on the real stories260K-4bit model (skipped without ../shared).

Every test drives the app as a user would (keys, the input box) and waits for the engine's
events by polling with ``pilot.pause()`` until a condition holds, with a timeout.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import io
import shutil
import tempfile
import time

import pytest

pytest.importorskip("textual")

from rich.console import Console  # noqa: E402
from textual import events  # noqa: E402

from chatapp.config import load_config  # noqa: E402
from chatapp.ui.app import ChatApp  # noqa: E402
from chatapp.ui.format import MODES  # noqa: E402
from chatapp.ui.screens import CompareScreen, ConfigScreen, HelpScreen, LoadingScreen, ModeDialog  # noqa: E402
from chatapp.ui.widgets import (  # noqa: E402
    EVICTED_TAG,
    AssistantMessage,
    ChatInput,
    ChatView,
    SidePanel,
    StatusBar,
    UserMessage,
)

pytestmark = pytest.mark.shared


def async_test(fn):
    """Run an async test on a fresh event loop (no pytest async plugin needed)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run


@functools.cache
def compile_reply_kernels() -> None:
    """Compile (or load from numba's disk cache) the decode attention kernels the apps' replies
    run, once a session, before any app starts: the load of a stories260K model warms nothing
    (its layers stay on MLX), so on a fresh clone the first reply that reached them compiled
    attend_full and the window-quant attend_parts inside a timed wait (4 s idle, measured; 0.3 s
    from the cache), and longer on a loaded machine."""
    from chatapp.kernels import kernel_info

    if kernel_info().ok:
        from chatapp.backend.warmup import warm_up_kernels

        warm_up_kernels([])


def make_config(model_path, **overrides):
    compile_reply_kernels()
    # Each app gets its own data directory, so what one test saved (conversations, the prefix
    # store) never changes what another one sees.
    data_dir = tempfile.mkdtemp(prefix="chatapp-ui-test-")
    atexit.register(shutil.rmtree, data_dir, True)
    values = {
        "model.id": str(model_path), "sampling.temp": 0.0, "sampling.seed": 0, "sampling.max_tokens": 24,
        "ui.render_interval_ms": 20, "data.dir": data_dir,
    }
    values.update(overrides)
    return load_config(overrides=values)


def make_app(model_path, freeze_stats: bool = True, **overrides) -> ChatApp:
    return ChatApp(make_config(model_path, **overrides), freeze_stats=freeze_stats)


async def wait_until(pilot, cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.engine.loaded and app.engine.info is not None and not app.engine.busy,
                     what="the model to load")


def press_nowait(pilot, key: str, character: str | None = None) -> None:
    """Press a key without waiting for the app to go idle (``pilot.press`` waits until every
    message is handled, which lasts until a streaming reply has ended)."""
    pilot.app.post_message(events.Key(key, character))


async def type_and_send(pilot, text: str, wait: bool = True) -> None:
    box = pilot.app.query_one(ChatInput)
    box.focus()
    box.text = text
    if wait:
        await pilot.press("enter")
    else:
        # Wait only until Enter was handled: the box is emptied (sent) or a notice says why not.
        notes = len(pilot.app._notifications)
        press_nowait(pilot, "enter", "\r")
        await wait_until(pilot, lambda: box.text == "" or len(pilot.app._notifications) > notes,
                         what="Enter to be handled")


async def turn(pilot, text: str) -> None:
    """Send a message and wait for its reply to finish."""
    app = pilot.app
    before = len(app.engine.history)
    await type_and_send(pilot, text)
    await wait_until(pilot, lambda: len(app.engine.history) > before and not app.engine.busy, what="the reply")


async def screen_text(pilot) -> str:
    """The screen as plain text, dialogs over their background included (as a screenshot shows it)."""
    await pilot.pause()
    app = pilot.app
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, color_system="truecolor")
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


def replies(app) -> list[AssistantMessage]:
    return list(app.query(AssistantMessage))


# ---- chat ---------------------------------------------------------------------------------------------
def test_every_engine_event_has_one_handler_behind_the_one_dispatcher():
    """Each event kind that becomes a message (ui/messages.MESSAGES) is shown by a handler of the
    app's one ``@on(EngineMessage)`` dispatcher, and that dispatcher is the only engine ``@on``."""
    from chatapp.ui.engine_link import HANDLERS, EngineClient
    from chatapp.ui.messages import MESSAGES, EngineMessage

    assert set(HANDLERS) == set(MESSAGES)
    handled = {kind for cls in ChatApp.__mro__ for kind in cls.__dict__.get("_decorated_handlers", {})}
    assert {k for k in handled if issubclass(k, EngineMessage)} == {EngineMessage}
    assert all(getattr(EngineClient, m.__name__) is m for m in HANDLERS.values())


def test_the_engine_client_is_a_part_of_the_app_not_a_base_class():
    """ChatApp holds its engine client (``app.engine``) and the transcript mirror (``app.transcript``)
    rather than inheriting them, and the client reaches the app only through its public face
    (EngineHost): no private name of the app."""
    import inspect
    import re

    from chatapp.ui import engine_link
    from chatapp.ui.engine_link import EngineHost

    assert not any(cls.__module__ == engine_link.__name__ for cls in ChatApp.__mro__)
    source = inspect.getsource(engine_link)
    assert not re.search(r"\bhost\._", source), "the engine client reads a private name of the app"
    host_names = {n for n in dir(EngineHost) if not n.startswith("_")} | set(EngineHost.__annotations__)
    used = set(re.findall(r"\bself\.host\.(\w+)", source))
    assert used <= host_names, used - host_names
    assert not re.search(r"\bengine\._", inspect.getsource(ChatApp)), "the app reads a private name of the client"
    assert "self.engine = EngineClient(self, config, self.transcript" in inspect.getsource(ChatApp.__init__)
    assert "self.transcript = Transcript(" in inspect.getsource(ChatApp.__init__)  # the mirror, a part too


@async_test
async def test_send_streams_reply_and_updates_gauges(stories4_path):
    app = make_app(stories4_path, freeze_stats=False, **{"sampling.max_tokens": 120})
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        status = app.query_one(StatusBar)
        assert "stories260K-4bit" in status.plain and "auto→prealloc" in status.plain
        seen_live = []
        await type_and_send(pilot, "Tell me a story about a cat.", wait=False)
        assert app.transcript.entries[0].role == "user" and app.query_one(ChatInput).text == ""

        def streaming_seen():
            engine = app.engine
            if engine.reply is not None and engine.live_stats is not None and engine.live_stats.generated_tokens:
                seen_live.append(status.plain)
            return len(app.engine.history) == 1 and not app.engine.busy

        await wait_until(pilot, streaming_seen, what="the reply")
        reply = replies(app)[-1]
        stats = app.engine.last_stats
        # Text arrived in batches while streaming, and the widget ends with the reply exactly.
        assert app.engine.event_log.count("TokenEvent") >= stats.generated_tokens > 20
        assert reply.appends >= 1 and reply.finished
        assert reply.markdown.source.strip() == reply.text.strip() and reply.text
        assert app.transcript.entries[-1].role == "assistant" and app.transcript.entries[-1].text == reply.text
        # The status bar was live during the turn (estimated cache marked "~") and exact after it.
        assert seen_live and any("~" in s for s in seen_live)
        final = status.plain
        assert f"cache {stats.cache.tokens}/{stats.cache.capacity} tok" in final
        assert "decode — tok/s" not in final and "TTFT —" not in final
        assert stats.cache.tokens > 0 and stats.decode_tps > 0
        assert reply.text[:20] in await screen_text(pilot)


@async_test
async def test_transcript_follows_the_bottom_unless_scrolled_up(stories4_path):
    app = make_app(stories4_path, **{"sampling.max_tokens": 40})
    async with app.run_test(size=(80, 18)) as pilot:
        await ready(pilot)
        chat = app.query_one(ChatView)
        for text in ("Tell me about a cat.", "What did the cat eat?", "Where did it sleep?"):
            await turn(pilot, text)
        await pilot.pause()
        assert chat.max_scroll_y > 0 and chat.scroll_y == chat.max_scroll_y
        chat.focus()
        await pilot.press("pageup")
        await pilot.pause()
        held = chat.scroll_y
        assert held < chat.max_scroll_y
        await turn(pilot, "Who was its friend?")
        await pilot.pause()
        assert chat.scroll_y == held < chat.max_scroll_y  # it stayed where the user put it
        chat.focus()
        await pilot.press("end")
        await turn(pilot, "What colour was the ball?")
        await pilot.pause()
        assert chat.scroll_y == chat.max_scroll_y  # back at the bottom, it follows again


@async_test
async def test_empty_and_whitespace_messages_are_ignored(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "")
        await type_and_send(pilot, "   \n\t ")
        await pilot.pause()
        assert app.transcript.entries == [] and not app.engine.busy and not list(app.query(UserMessage))


@async_test
async def test_newline_key_inserts_line_and_enter_sends(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test() as pilot:
        await ready(pilot)
        app.query_one(ChatInput).focus()
        await pilot.press("H", "i", "ctrl+j", "y", "o")
        assert app.query_one(ChatInput).text == "Hi\nyo"
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.engine.history) == 1 and not app.engine.busy, what="the reply")
        assert app.transcript.entries[0].text == "Hi\nyo"


@async_test
async def test_escape_cancels_a_reply(stories4_path):
    app = make_app(stories4_path, **{"sampling.max_tokens": 450, "ui.render_interval_ms": 50})
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "Once upon a time", wait=False)
        await wait_until(pilot, lambda: app.engine.event_log.count("TokenEvent") >= 5, what="some tokens")
        await pilot.press("escape")
        await wait_until(pilot, lambda: len(app.engine.history) == 1 and not app.engine.busy, what="the cancel")
        stats = app.engine.last_stats
        assert stats.finish == "cancelled" and stats.generated_tokens < 450
        reply = replies(app)[-1]
        assert "interrupted" in reply.tags and reply.has_class("interrupted")
        assert "interrupted" in await screen_text(pilot)
        # The partial reply is kept in the conversation (and in the cache), and the chat goes on.
        assert app.transcript.entries[-1].role == "assistant" and app.transcript.entries[-1].text == reply.text
        await type_and_send(pilot, "What next?", wait=False)
        await wait_until(pilot, lambda: app.engine.event_log.count("TokenEvent") >= stats.generated_tokens + 3,
                         what="the next reply")
        await pilot.press("escape")
        await wait_until(pilot, lambda: len(app.engine.history) == 2 and not app.engine.busy, what="the second cancel")
        assert app.engine.last_stats.reused_tokens >= app.engine.history[0].prompt_tokens + stats.generated_tokens - 2


@async_test
async def test_messages_sent_during_a_reply_are_queued(stories4_path):
    app = make_app(stories4_path, **{"sampling.max_tokens": 100})
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "Once upon a time", wait=False)
        await wait_until(pilot, lambda: app.engine.event_log.count("TokenEvent") >= 3, what="some tokens")
        await type_and_send(pilot, "second", wait=False)
        assert [e.role for e in app.transcript.entries] == ["user"]  # not sent yet
        queued = app.transcript.queued[0]
        assert queued.text == "second" and "queued" in queued.tags
        assert app.query_one(ChatInput).has_class("busy")
        # Esc stops the reply and gives the queued message back to the box instead of sending it.
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.engine.busy, what="the cancel")
        assert app.transcript.queued == [] and not queued.is_attached
        assert app.query_one(ChatInput).text == "second"
        # Queued messages are sent in order once the reply ends.
        app.query_one(ChatInput).text = ""
        await type_and_send(pilot, "third", wait=False)
        await wait_until(pilot, lambda: app.engine.reply is not None and app.engine.live_stats is not None,
                         what="streaming")
        await type_and_send(pilot, "fourth", wait=False)
        await type_and_send(pilot, "fifth", wait=False)
        assert [w.text for w in app.transcript.queued] == ["fourth", "fifth"]
        await wait_until(pilot, lambda: len(app.engine.history) == 4 and not app.engine.busy
                         and not app.transcript.queued,
                         timeout=60, what="the queued replies")
        roles = [e.role for e in app.transcript.entries]
        assert roles == ["user", "assistant"] * 4
        assert [e.text for e in app.transcript.entries if e.role == "user"] == ["Once upon a time", "third", "fourth",
                                                                            "fifth"]
        # The transcript shows them in the same order, each followed by its reply.
        shown = [w for w in app.query_one(ChatView).children]
        assert shown == [e.widget for e in app.transcript.entries]
        assert all("queued" not in w.tags for w in shown)


@async_test
async def test_regenerate_replaces_the_last_reply(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test() as pilot:
        await ready(pilot)
        await turn(pilot, "Tell me about a dog.")
        first = app.transcript.entries[-1].text
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: len(app.engine.history) == 2 and not app.engine.busy, what="regenerate")
        assert [e.role for e in app.transcript.entries] == ["user", "assistant"]
        assert len(replies(app)) == 1
        assert app.transcript.entries[-1].text == first  # greedy: the same reply again
        # Only the last prompt token ran again: the rest came from the cache.
        assert app.engine.last_stats.reused_tokens == app.engine.last_stats.prompt_tokens - 1


@async_test
async def test_edit_last_message(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test() as pilot:
        await ready(pilot)
        await turn(pilot, "Tell me about a dog.")
        await pilot.press("ctrl+o")
        box = app.query_one(ChatInput)
        assert app.engine.editing and box.text == "Tell me about a dog." and box.has_class("editing")
        box.text = "Tell me about a bird."
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.engine.history) == 2 and not app.engine.busy, what="the edit")
        assert [e.role for e in app.transcript.entries] == ["user", "assistant"]
        users = list(app.query(UserMessage))
        assert len(users) == 1 and users[0].text == "Tell me about a bird." and "edited" in users[0].tags
        assert len(replies(app)) == 1 and not app.engine.editing
        # Esc leaves editing without sending.
        await pilot.press("ctrl+o")
        await pilot.press("escape")
        assert not app.engine.editing and box.text == ""


@async_test
async def test_new_chat_and_clear(stories4_path):
    app = make_app(stories4_path, **{"chat.system": "Be [bold]nice[/]."})
    async with app.run_test() as pilot:
        await ready(pilot)
        assert [e.role for e in app.transcript.entries] == ["system"]
        await turn(pilot, "Hello")
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert not list(app.query(UserMessage)) and len(app.transcript.entries) == 3
        await turn(pilot, "More")  # the model kept the conversation
        assert app.engine.last_stats.reused_tokens > 20
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.engine.busy, what="new chat")
        assert [e.role for e in app.transcript.entries] == ["system"] and app.engine.conv_steps == []
        assert "Be [bold]nice[/]." in await screen_text(pilot)
        await turn(pilot, "Hello")
        # The new chat starts warm: the first one's prompt came from the prefix store.
        stats = app.engine.last_stats
        assert stats.prefix_tokens == stats.reused_tokens == stats.prompt_tokens - 1 > 20
        assert any(n.title == "prefix store" and n.message.startswith(f"reused {stats.prefix_tokens} prefix tokens")
                   for n in app._notifications)
        assert app.engine.store_notes[-1] == ("note", stats.prefix_line())


# ---- cache modes --------------------------------------------------------------------------------------------
@async_test
async def test_cycle_mode_mid_conversation(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test() as pilot:
        await ready(pilot)
        await turn(pilot, "Tell me about a cat.")
        await pilot.press("f3")  # auto -> concat
        await wait_until(pilot, lambda: app.engine.info.requested_mode == "concat" and not app.engine.busy,
                         what="the switch")
        assert app.engine.mode == "concat" and "mode concat" in app.query_one(StatusBar).plain
        # Loaded and Switched describe the session
        assert "Switched" in app.engine.event_log and "SessionInfo" not in app.engine.event_log
        await turn(pilot, "What did the cat eat?")
        assert app.engine.last_stats.mode == "concat" and app.transcript.entries[-1].text
        assert app.engine.last_stats.reused_tokens > 0  # the converted cache was kept


@async_test
async def test_switch_during_a_reply_applies_when_it_ends(stories4_path):
    app = make_app(stories4_path, **{"sampling.max_tokens": 100})
    async with app.run_test() as pilot:
        await ready(pilot)
        await type_and_send(pilot, "Once upon a time", wait=False)
        await wait_until(pilot, lambda: app.engine.event_log.count("TokenEvent") >= 3, what="some tokens")
        app.action_cache_mode("window", {})
        await wait_until(pilot, lambda: app.engine.info.mode == "window" and not app.engine.busy, what="the switch")
        log = list(app.engine.event_log)
        assert log.index("TurnDone") < log.index("Switched")
        # Switched carried the new session's description: no Describe round-trip after it.
        assert "SessionInfo" not in log[log.index("Switched"):]
        assert app.engine.info.effective and app.engine.cache_view.mode == "window"
        assert app.engine.history[0].mode == "prealloc"
        await turn(pilot, "And then?")
        assert app.engine.last_stats.mode == "window"


@async_test
async def test_mode_dialog_validates_and_switches_and_marks_evicted_messages(stories4_path):
    app = make_app(stories4_path, **{"sampling.max_tokens": 40})
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await wait_until(pilot, lambda: isinstance(app.screen, ModeDialog), what="the dialog")
        dialog = app.screen
        dialog.query_one("#mode-select").value = "window"
        await pilot.pause()
        dialog.query_one("#f-window").value = "2"
        dialog.query_one("#f-sinks").value = "4"
        await pilot.pause()
        dialog.action_apply()
        await pilot.pause()
        assert isinstance(app.screen, ModeDialog)  # refused
        assert "must be >= sinks (4)" in str(dialog.query_one("#e-window").render())
        dialog.query_one("#f-window").value = "48"
        await pilot.pause()
        dialog.action_apply()
        await wait_until(pilot, lambda: app.engine.info.mode == "window" and app.engine.info.settings["window"] == 48
                         and not app.engine.busy, what="the switch")
        for text in ("Tell me about a cat.", "What did the cat eat?", "Where did it sleep?", "Who was its friend?"):
            await turn(pilot, text)
        first_visible = app.engine.cache_view.first_visible_message
        assert first_visible >= 1 and app.engine.cache_view.evicted > 0
        widgets = [e.widget for e in app.transcript.entries]
        assert all(w.has_class("evicted") and EVICTED_TAG in w.tags for w in widgets[:first_visible])
        assert not any(w.has_class("evicted") for w in widgets[first_visible:])
        bar = app.query_one(StatusBar).plain
        assert f"/{app.engine.cache_view.evicted:,} | " in bar  # the full/quant/evicted item
        # window shows the share of the last turn's attention on its next eviction's tokens
        assert bar.endswith(f"attn on evictable {app.engine.cache_view.attention_sparsity:.0%}")


@async_test
async def test_notes_and_config_show_the_prompt_format(tmp_path):
    """A template-less Llama-2-chat repo: the notes say which prompt format and why."""
    from tests.chat_folders import EOS, legacy_chat_folder, script_after, sp_ids

    folder = legacy_chat_folder(tmp_path / "Llama-2-7b-chat-4-bit",
                                script_after(sp_ids("[/INST]")[-1], "Hi there", EOS))
    app = make_app(folder, **{"data.dir": str(tmp_path / "data")})
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        line = "prompt format llama-2 (no chat template; the model id Llama-2-7b-chat-4-bit matches *llama-2*chat*)"
        assert line in [str(n.message) for n in app._notifications]
        await turn(pilot, "Hello")
        assert replies(app)[-1].text == "Hi there"
        await pilot.press("f6")
        assert isinstance(app.screen, ConfigScreen)
        assert "prompt format: llama-2 (no chat template;" in await screen_text(pilot)


@async_test
async def test_a_reply_that_fails_part_way_ends_its_turn(stories4_path, monkeypatch):
    """An exception in the engine mid-reply: a TurnDone marked failed comes before the Failed, so
    the UI leaves its streaming state, keeps the conversation it went into and mirrors the kept text."""
    from chatapp.engine.session import Session

    real = Session.decode

    def failing(self, *args, **kwargs):
        for i, ev in enumerate(real(self, *args, **kwargs)):
            if i == 6:
                raise RuntimeError("the device went away")
            yield ev

    monkeypatch.setattr(Session, "decode", failing)
    app = make_app(stories4_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await type_and_send(pilot, "Hello")
        await wait_until(pilot, lambda: "Failed" in app.engine.event_log and not app.engine.busy, what="the failure")
        kinds = list(app.engine.event_log)
        assert "TurnDone" in kinds and kinds.index("TurnDone") < kinds.index("Failed"), kinds
        assert app.engine.failures[-1][0] == "send failed: the device went away"
        assert app.engine.reply is None and app.engine.live_stats is None and not app.engine.history
        assert app.engine.conversation_id is not None  # the first turn's conversation, known at once
        reply = replies(app)[-1]
        assert reply.has_class("failed") and "streaming" not in reply.tags
        assert app.transcript.entries[-1].role == "assistant" and app.transcript.entries[-1].widget is reply
        last = app.transcript.entries[-1]
        assert last.text and reply.streamed == last.text  # all that was shown
        assert "streaming" not in app.query_one(StatusBar).plain


@async_test
async def test_failed_switch_shows_the_message_not_a_traceback(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await turn(pilot, "Hello")
        app.action_cache_mode("quantized", {})
        await wait_until(pilot, lambda: "Failed" in app.engine.event_log and not app.engine.busy, what="the failure")
        message, detail = app.engine.failures[-1]
        assert "head_dim" in message and "Traceback" in detail
        notes = [n.message for n in app._notifications]
        assert any("head_dim" in n for n in notes) and not any("Traceback" in n for n in notes)
        assert app.engine.mode == "prealloc"
        assert "Traceback" not in await screen_text(pilot)
        await turn(pilot, "Still there?")  # the session still works
        assert app.engine.last_stats.mode == "prealloc"


@async_test
async def test_compare_modes(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await turn(pilot, "Tell me about a cat.")
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(app.screen, CompareScreen) and app.screen.done
                         and not app.engine.busy, what="the comparison")
        screen = app.screen
        assert [r.mode for r in screen.rows] == MODES
        ok = [r for r in screen.rows if not r.error]
        failed = [r for r in screen.rows if r.error]
        assert {r.mode for r in failed} == {"quantized", "window-quant", "scored-quant"}  # head_dim 8: no quantising
        assert all(r.decode_tps > 0 and r.ttft > 0 for r in ok)
        assert len({r.reply for r in ok}) == 1  # greedy on the same context: the same reply
        assert screen.query_one("#compare-table").row_count == len(MODES)
        text = await screen_text(pilot)
        assert "decode tok/s" in text and "█" in text and "head_dim" in text
        assert "KV held" in text and "route" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, CompareScreen)


@async_test
async def test_side_panel_shows_steps_layers_and_modes(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        panel = app.query_one(SidePanel)
        assert not panel.display
        await turn(pilot, "Tell me about a cat.")
        await pilot.press("f3")
        await wait_until(pilot, lambda: app.engine.info.requested_mode == "concat" and not app.engine.busy,
                         what="switch")
        await turn(pilot, "What did the cat eat?")
        await pilot.press("f2")
        await pilot.pause()
        assert panel.display
        chart = panel.query_one("#steps-chart")
        assert len(chart.data) > 5 and all(v > 0 for v in chart.data)
        assert len(app.query_one("#layers").per_layer) == 5
        assert {row.mode for row in panel.mode_rows} == {"prealloc", "concat"}
        assert all(row.decode_tps > 0 and row.turns == 1 for row in panel.mode_rows)
        assert "Decode step time vs context" in await screen_text(pilot)
        await pilot.press("f2")
        assert not panel.display


@async_test
async def test_memory_gauges_in_the_status_bar_and_the_side_panel(stories4_path):
    from chatapp.engine.stats import fmt_bytes
    from chatapp.ui.widgets import MemoryChart

    app = make_app(stories4_path, freeze_stats=False)
    async with app.run_test(size=(140, 40)) as pilot:
        await ready(pilot)
        status = app.query_one(StatusBar)
        assert app.engine.memory is not None and app.engine.memory.active > 0  # read when the session was described
        await turn(pilot, "Tell me about a cat.")
        await turn(pilot, "What did the cat eat?")
        g = app.engine.last_stats.memory
        assert 0 < g.active <= g.peak < g.total and g.kv_held == app.engine.last_stats.cache.bytes_held
        plain = status.plain
        assert f"MLX {fmt_bytes(g.active)} act · {fmt_bytes(g.cache)} cache · {fmt_bytes(g.peak)} peak" in plain
        assert "mem KV " in plain and " · act " in plain and " · peak " in plain
        await pilot.press("f2")
        await pilot.pause()
        chart = app.query_one(MemoryChart)
        # two turns, 2+ readings each
        assert chart.now == g and len(chart.trace) == len(app.engine.conv_memory) >= 2 * 2
        assert [r.tokens for r in chart.trace] == sorted(r.tokens for r in chart.trace)
        text = await screen_text(pilot)
        assert "MLX memory over the conversation" in text and "MLX active" in text and "buffer cache" in text
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.engine.busy, what="new chat")
        assert app.engine.conv_memory == []


# ---- screens ----------------------------------------------------------------------------------------------
@async_test
async def test_help_config_and_palette(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        text = await screen_text(pilot)
        for key in ("Esc", "Ctrl+N", "Ctrl+R", "Ctrl+O", "Ctrl+L", "F2", "F3", "F4", "F5", "F6", "Ctrl+Q"):
            assert key in text
        await pilot.press("escape")
        await pilot.press("f6")
        assert isinstance(app.screen, ConfigScreen)
        table = app.screen.query_one("#config-table")
        assert table.row_count == len(app.config.describe())
        row = [str(c) for c in table.get_row_at(0)]
        assert row[0] == "model.id" and row[2] == "command line"
        await pilot.press("escape")
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("Compare modes", "Cache mode…", "Next cache mode", "Toggle side panel", "New chat",
                      "Regenerate", "Edit last message", "Show configuration", "Stop the reply"):
            assert title in titles
        assert all(f"Cache mode: {m}" in titles for m in MODES)


def gate_load(app, before=None):
    """Hold the app's model load on the engine thread until the returned event is set (``before``
    runs first there, with the bridge's emit)."""
    import threading

    gate = threading.Event()
    load = app.engine.bridge.make_session

    def held(emit, cancel):
        if before is not None:
            before(emit)
        assert gate.wait(60), "the test never released the load"
        return load(emit, cancel)

    app.engine.bridge.make_session = held
    return gate


@async_test
async def test_the_input_box_takes_messages_while_the_model_loads(stories4_path):
    """A later start shows the chat at once: the input box is focused under a loading title, a
    message typed meanwhile is queued, and it is sent, in its place, once the model is ready."""
    app = make_app(stories4_path)
    gate = gate_load(app)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        assert not app.engine.loaded and not isinstance(app.screen, LoadingScreen)
        box = app.query_one(ChatInput)
        assert box.has_focus and "loading" in str(box.border_title)
        assert "loading" in app.query_one(StatusBar).plain
        assert not app.check_action("new_chat", ()) and app.check_action("show_config", ())
        await type_and_send(pilot, "Once upon a time")
        queued = [w for w in app.query(UserMessage) if "queued" in w.tags]
        assert [w.text for w in queued] == ["Once upon a time"] and box.text == ""
        gate.set()
        await wait_until(pilot, lambda: len(app.engine.history) == 1 and not app.engine.busy, what="the queued reply")
        assert not app.transcript.queued and [w.text for w in app.query(UserMessage)] == ["Once upon a time"]
        assert not any("queued" in w.tags for w in app.query(UserMessage))
        assert len(replies(app)) == 1 and replies(app)[0].text
        assert app.check_action("new_chat", ()) and "Enter sends" in str(box.border_title)


@async_test
async def test_a_download_gets_the_loading_screen(stories4_path):
    """Only a download (minutes, on a first run) covers the chat with the progress screen."""
    from chatapp.engine.events import LoadProgress

    app = make_app(stories4_path)
    gate = gate_load(app, lambda emit: emit(LoadProgress("download", "downloading model.safetensors: file 1 of 2",
                                                         42.0)))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen), what="the loading screen")
        assert "file 1 of 2" in await screen_text(pilot)
        gate.set()
        await ready(pilot)
        assert not isinstance(app.screen, LoadingScreen) and app.query_one(ChatInput).has_focus


@async_test
async def test_load_failure_is_a_message_not_a_traceback(tmp_path):
    app = ChatApp(load_config(overrides={"model.id": str(tmp_path)}))
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: app.engine.load_error, what="the load failure")
        await pilot.pause()
        assert isinstance(app.screen, LoadingScreen) and app.screen.failed
        text = await screen_text(pilot)
        assert "could not be loaded" in text and "press q to quit" in text
        assert "Traceback" not in text and "Traceback" not in app.engine.load_error
        await pilot.press("q")
    assert app.return_code == 0


# ---- safety -----------------------------------------------------------------------------------------------
EVIL = "[bold red]x[/] \x1b[2J \x07 a\rb [link=https://example.com]y[/link]"


@async_test
async def test_markup_and_escape_sequences_are_shown_literally(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        await turn(pilot, EVIL)
        user = list(app.query(UserMessage))[-1]
        assert user.text == EVIL.strip()
        text = await screen_text(pilot)
        assert "[bold red]x[/] ␛[2J ␇ a␍b [link=https://example.com]y[/link]" in text
        # A reply with the same content (as a model might write it), streamed in pieces.
        reply = AssistantMessage()
        await app.query_one(ChatView).mount(reply)
        for piece in ("[bold", " red]x[/] \x1b", "[2J \x07 a\r", "b <b>z</b>"):
            await reply.append(piece)
        await reply.finish("[bold red]x[/] \x1b[2J \x07 a\rb <b>z</b>", "eos")
        await pilot.pause()
        text = await screen_text(pilot)
        assert text.count("[bold red]x[/] ␛[2J ␇ a␍b") == 2 and "<b>z</b>" in text
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text
