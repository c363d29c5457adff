"""The Textual chat app: streaming replies, live speed and cache gauges, cache modes.

Threading: every model operation runs on the engine worker's thread
(:class:`chatapp.engine.worker.EngineWorker`, owned by :class:`chatapp.ui.bridge.EngineBridge`),
which takes the typed requests of :mod:`chatapp.engine.requests`. Its events arrive here, in
order, on the UI thread, one Textual message per kind (:mod:`chatapp.ui.messages`); the app's one
``@on(EngineMessage)`` handler (:func:`~chatapp.ui.engine_link.deliver`) runs each kind's handler on
its part :class:`~chatapp.ui.engine_link.EngineClient` (``self.engine``: the bridge, the requests in
flight, the streaming reply, the status bar and the side panel). The
messages on screen are the transcript mirror's (``self.transcript``, ui/transcript.py) and the
comforts a third part (``self.comforts``, ui/comforts.py). This module holds the layout, the
input, the actions and the command palette, and wires the parts.

While a reply streams, messages are queued: Enter shows the message marked "queued" and it is
sent when the engine is free; Esc stops the reply and puts queued messages back into the input
box. Cache-mode switches asked for during a reply are queued on the engine thread and apply
when the reply ends. Regenerate, edit, new chat and compare wait for an idle engine.

Every conversation is saved as it goes (docs/persistence.md): the bridge's engine thread runs
the turns through a :class:`~chatapp.store.chat.PersistentChat`. The sessions screen (F7) lists
the saved conversations and opens (resumes), renames or deletes them.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from cache.settings import DIALOG_KNOBS, knob_values
from chatapp.engine.requests import (
    Compare,
    DeleteConversation,
    EditLast,
    NewChat,
    OpenConversation,
    Regenerate,
    RenameConversation,
    Send,
    SwitchMode,
)

from . import start_probe
from .comforts import COMFORT_ACTIONS, COMFORT_BINDINGS, Comforts
from .engine_link import INPUT_TITLE, EngineClient, deliver
from .format import MODES
from .messages import EngineMessage
from .screens import CompareScreen, ConfigScreen, HelpScreen, LoadingScreen, ModeDialog, SessionsScreen
from .transcript import Transcript
from .widgets import ChatInput, ChatView, SidePanel, StatusBar, UserMessage


class ChatApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "chatapp"
    ENABLE_COMMAND_PALETTE = True

    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit"),
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("escape", "cancel", "Stop"),
        Binding("f2", "toggle_panel", "Panel"),
        Binding("f3", "cache_mode", "Mode"),
        Binding("f5", "compare", "Compare"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+o", "edit_last", "Edit"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("f4", "mode_dialog", "Mode…"),
        Binding("f6", "show_config", "Config"),
        Binding("f7", "sessions", "Sessions", show=False),
        Binding("ctrl+p", "command_palette", "Palette", show=False),
        *COMFORT_BINDINGS,  # copy, export, system prompt, switch model (ui/comforts.py)
    ]

    def __init__(self, config, *, blas=None, verbose: bool = False, freeze_stats: bool = False,
                 resume: int | str | None = None, save: bool = True) -> None:
        super().__init__()
        self.config = config
        self.blas = blas
        self.freeze_stats = freeze_stats
        # the messages on screen, mirrored: the conversation's, the queue, the cache markers (ui/transcript.py)
        self.transcript = Transcript(lambda: self.query_one(ChatView))
        # the engine's messages, the streaming reply, the status bar and the side panel (ui/engine_link.py)
        self.engine = EngineClient(self, config, self.transcript, blas=blas, verbose=verbose,
                                   freeze_stats=freeze_stats, resume=resume, save=save)
        # copy, export, themes, system prompt, model switch: a part with its own state (ui/comforts.py)
        self.comforts = Comforts(self, self.engine.bridge.data_dir)

    # ---- the engine's messages: every one (its message subclasses EngineMessage) goes to its kind's
    # handler on the engine client, through the one dispatcher (engine_link.deliver)
    _on_engine = on(EngineMessage)(deliver)

    # ---- layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield ChatView(id="chat")
                yield ChatInput(id="input", placeholder="Write a message…")
            yield SidePanel(id="panel")
        yield StatusBar(id="status")
        yield Footer(compact=True, show_command_palette=False)

    async def on_mount(self) -> None:
        self.engine.mounted()
        try:
            self.theme = self.config.ui.theme
        except Exception:  # noqa: BLE001 - an unknown theme name is not fatal
            self.notify(f"unknown theme {self.config.ui.theme!r}; using the default", severity="warning",
                        markup=False)
        panel = self.query_one(SidePanel)
        panel.display = bool(self.config.ui.show_panel)
        chat_input = self.query_one(ChatInput)
        chat_input.border_title = INPUT_TITLE
        if self.freeze_stats:
            chat_input.cursor_blink = False
        chat_input.focus()
        self.engine.update_input_state()
        self.engine.update_status()
        self.set_interval(max(self.config.ui.render_interval_ms, 10) / 1000, self.engine.flush_stream)
        # The model loads on the engine thread under the chat: the input box takes messages at
        # once (queued until the model is ready); only a download gets the loading screen.
        self.engine.bridge.start()
        self.call_after_refresh(start_probe.reached, "input")

    def _current_conversation(self) -> int | None:
        # The UI's own copy (TurnDone, TranscriptLoaded, a new chat): never the engine thread's chat.
        return self.engine.conversation_id

    def list_conversations(self) -> tuple[list[Any], str]:
        """The saved conversations (read on the UI thread: SQLite readers never block the writer)."""
        from chatapp.store import ChatStore, StoreError

        data_dir = self.engine.bridge.data_dir()
        try:
            with ChatStore.open(data_dir, write=False) as store:
                rows = store.list_conversations()
        except (StoreError, OSError) as e:
            return [], f"cannot read the saved conversations in {data_dir}: {e}"
        if not rows:
            return [], f"no saved conversations in {data_dir}"
        return rows, ""

    def action_sessions(self) -> None:
        if isinstance(self.screen, SessionsScreen):
            return
        self.engine.sessions_screen = SessionsScreen(self.list_conversations, self.open_conversation,
                                              self.rename_conversation, self.delete_conversation,
                                              current=self._current_conversation())
        self.push_screen(self.engine.sessions_screen)

    def open_conversation(self, conversation_id: int) -> None:
        """Show a saved conversation and continue it (its KV snapshot is restored when it fits)."""
        if self.refuse_busy("open"):
            return
        self.engine.submit(OpenConversation(conversation_id))  # TranscriptLoaded brings the session's description

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        if not self.engine.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        self.engine.submit(RenameConversation(conversation_id, title))

    def delete_conversation(self, conversation_id: int) -> None:
        if self.refuse_busy("delete"):
            return
        self.engine.submit(DeleteConversation(conversation_id))

    def refuse_busy(self, what: str) -> bool:
        if not self.engine.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return True
        if self.engine.busy:
            self.notify(f"{what}: wait for the reply to finish (Esc stops it)", severity="warning", markup=False)
            return True
        return False

    # ---- input ------------------------------------------------------------------------------------------
    async def on_chat_input_submitted(self, message: ChatInput.Submitted) -> None:
        text = message.text.strip()
        if not text:
            return  # empty and whitespace-only messages are ignored
        if not self.engine.loaded:
            if self.engine.load_error:
                self.notify("the model could not be loaded", severity="error", markup=False)
                return
            message.chat_input.clear()
            await self.transcript.queue(text)  # sent once the model is loaded
            return
        if self.engine.editing:
            if self.refuse_busy("not resent"):
                return
            message.chat_input.clear()
            await self._resend_edited(text)
            return
        message.chat_input.clear()
        if self.engine.busy or self.transcript.queued:
            await self.transcript.queue(text)
        else:
            await self.send(text)

    async def _unqueue(self) -> None:
        """Esc: queued messages go back into the input box instead of being sent."""
        if not self.transcript.queued:
            return
        texts = await self.transcript.take_queued()
        box = self.query_one(ChatInput)
        box.text = "\n\n".join(texts + ([box.text] if box.text.strip() else []))
        box.move_cursor(box.document.end)
        self.notify("queued messages are back in the input box", markup=False, timeout=3)

    async def send(self, text: str) -> None:
        """Send ``text`` as the user's next message (what Enter does)."""
        await self.transcript.add_message(UserMessage(text), "user")
        await self.engine.start_reply(Send(text))

    async def _resend_edited(self, text: str) -> None:
        self.engine.editing = False
        i = self.transcript.last_user()
        if i is None:
            return
        entry = self.transcript.entries[i]
        chat = self.query_one(ChatView)
        if entry.widget is not None and entry.widget.parent is chat:
            later = chat.children[chat.children.index(entry.widget) + 1:]
            await chat.remove_children(list(later))
            entry.widget.set_text(text)
            entry.widget.set_tag("edited")
        else:
            entry.widget = UserMessage(text, i)
            await self.transcript.mount_message(entry.widget)
        for e in self.transcript.entries[i + 1:]:
            if e.widget is not None and e.widget.is_attached:
                await e.widget.remove()
        del self.transcript.entries[i + 1:]
        entry.text = text
        await self.engine.start_reply(EditLast(text))

    # ---- actions ----------------------------------------------------------------------------------------
    async def action_cancel(self) -> None:
        if self.engine.reply is not None:
            self.engine.bridge.cancel()
            await self._unqueue()
        elif self.transcript.queued:
            await self._unqueue()
        elif self.engine.editing:
            self.engine.editing = False
            self.query_one(ChatInput).clear()
            self.engine.update_input_state()

    async def action_new_chat(self) -> None:
        if self.refuse_busy("new chat"):
            return
        await self.engine.clear_conversation()
        self.engine.submit(NewChat())  # the engine answers with the new session's description
        self.engine.update_panel()
        self.notify("new chat", markup=False, timeout=2)

    async def action_regenerate(self) -> None:
        if self.refuse_busy("regenerate"):
            return
        if self.transcript.last_user() is None:
            self.notify("nothing to regenerate yet", markup=False)
            return
        if self.transcript.entries[-1].role == "assistant":
            entry = self.transcript.entries.pop()
            if entry.widget is not None and entry.widget.is_attached:
                await entry.widget.remove()
        await self.engine.start_reply(Regenerate())

    def action_edit_last(self) -> None:
        if self.refuse_busy("edit"):
            return
        i = self.transcript.last_user()
        if i is None:
            self.notify("there is no message to edit yet", markup=False)
            return
        chat_input = self.query_one(ChatInput)
        self.engine.editing = True
        chat_input.text = self.transcript.entries[i].text
        chat_input.move_cursor(chat_input.document.end)
        chat_input.focus()
        self.engine.update_input_state()

    async def action_clear(self) -> None:
        await self.query_one(ChatView).remove_children()
        for entry in self.transcript.entries:
            entry.widget = None
        if self.engine.reply is not None:  # keep the streaming reply and the queue on screen
            await self.transcript.mount_message(self.engine.reply)
        for widget in self.transcript.queued:
            await self.transcript.mount_message(widget)
        self.notify("screen cleared; the model still has the conversation (Ctrl+N starts over)",
                    markup=False, timeout=3)

    def action_toggle_panel(self) -> None:
        panel = self.query_one(SidePanel)
        panel.display = not panel.display
        self.engine.update_panel()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_show_config(self) -> None:
        extra = [("model", self.engine.model_id)]
        if self.engine.info is not None:
            extra.append(("prompt format", self.engine.info.fmt))
            extra.append(("cache mode in use", self.engine.mode_label()))
        if self.blas is not None:
            extra.append(("BLAS", self.blas.summary() if hasattr(self.blas, "summary") else str(self.blas)))
        self.push_screen(ConfigScreen(self.config, extra))

    def action_cache_mode(self, mode: str | None = None, changes: dict | None = None) -> None:
        """Ask the engine to switch the cache mode (F3, no ``mode``: the next of ``MODES`` after the
        one asked for last; the mode dialog and the palette name it); during a reply it applies
        when the reply ends."""
        if mode is None:
            current = self.engine.requested_mode
            mode = MODES[(MODES.index(current) + 1) % len(MODES)] if current in MODES else MODES[0]
        if not self.engine.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        if self.engine.reply is not None:
            self.notify(f"cache mode {mode}: applies when this reply ends", markup=False, timeout=4)
        self.engine.requested_mode = mode
        self.engine.submit(SwitchMode(mode, dict(changes or {})))
        if self.engine.reply is None:
            self.engine.phase = f"switching to {mode}"
        self.engine.update_status()

    def action_mode_dialog(self) -> None:
        if not self.engine.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        settings = self.engine.info.settings if self.engine.info else knob_values(self.config.cache, DIALOG_KNOBS)
        effective = self.engine.info.effective if self.engine.info else {}

        def done(result) -> None:
            if result is not None:
                mode, changes = result
                self.action_cache_mode(mode, changes)

        dialog = ModeDialog(self.engine.requested_mode, settings, effective, busy=self.engine.busy)
        self.push_screen(dialog, done)

    def action_compare(self) -> None:
        if self.refuse_busy("compare"):
            return
        if self.transcript.last_user() is None:
            self.notify("send a message first: compare replays the last turn", markup=False)
            return
        self.engine.compare_rows = []
        max_tokens = min(self.config.sampling.max_tokens, 128)
        self.engine.compare_screen = CompareScreen(MODES)
        self.push_screen(self.engine.compare_screen)
        self.engine.submit(Compare(tuple(MODES), max_tokens))
        self.engine.phase = "comparing"
        self.engine.update_status()

    # ---- the comforts (ui/comforts.py): Textual finds actions on the app, the part does the work ----
    def action_copy_last_reply(self) -> None:
        self.comforts.copy_last_reply()

    def action_copy_code(self) -> None:
        self.comforts.copy_code()

    def action_copy_dialog(self) -> None:
        self.comforts.copy_dialog()

    def action_export(self) -> None:
        self.comforts.export()

    def action_system_prompt(self) -> None:
        self.comforts.system_prompt()

    def action_switch_model(self) -> None:
        self.comforts.open_model_dialog()

    def watch_theme(self, name: str) -> None:
        self.comforts.theme_changed(name)

    async def action_quit(self) -> None:
        self.engine.bridge.stop(timeout=1.0)
        self.exit(0)

    def on_unmount(self) -> None:
        self.engine.bridge.stop(timeout=1.0)

    # Actions of the main screen: off while a dialog (or the loading screen) is on top, so that,
    # say, Ctrl+N in the mode dialog does not start a new chat behind it.
    MAIN_ACTIONS = frozenset({"cancel", "new_chat", "regenerate", "edit_last", "clear", "toggle_panel",
                              "cache_mode", "mode_dialog", "compare", "show_config", "sessions"}) | COMFORT_ACTIONS

    # ...and those that need no model: the ones open while it loads under the chat
    LOADING_ACTIONS = frozenset({"cancel", "toggle_panel", "show_config"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.MAIN_ACTIONS and len(self.screen_stack) > 1:
            return action == "show_config" and isinstance(self.screen, LoadingScreen)
        if action in self.MAIN_ACTIONS and not self.engine.loaded:
            return action in self.LOADING_ACTIONS
        return True

    # ---- command palette -----------------------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Stop the reply", "Esc: stop generating (the partial reply is kept)", self.action_cancel)
        yield SystemCommand("New chat", "Ctrl+N: forget the conversation and start over", self.action_new_chat)
        yield SystemCommand("Regenerate", "Ctrl+R: generate the last reply again", self.action_regenerate)
        yield SystemCommand("Edit last message", "Ctrl+O: edit and resend your last message",
                            self.action_edit_last)
        yield SystemCommand("Clear screen", "Ctrl+L: clear the transcript (the model keeps it)", self.action_clear)
        yield SystemCommand("Toggle side panel", "F2: step-time chart, per-layer cache, mode table",
                            self.action_toggle_panel)
        yield SystemCommand("Next cache mode",
                            "F3: cycle auto, concat, prealloc, quantized, window, window-quant, scored, scored-quant",
                            self.action_cache_mode)
        yield SystemCommand("Cache mode…", "F4: choose the cache mode and its settings", self.action_mode_dialog)
        for mode in MODES:
            yield SystemCommand(f"Cache mode: {mode}", f"switch the KV cache to {mode}",
                                lambda m=mode: self.action_cache_mode(m), discover=False)
        yield SystemCommand("Compare modes", "F5: replay the last turn in every cache mode", self.action_compare)
        yield SystemCommand("Show configuration", "F6: effective settings and where each came from",
                            self.action_show_config)
        yield SystemCommand("Saved conversations", "F7: open (resume), rename or delete a saved conversation",
                            self.action_sessions)
        yield from self.comforts.commands()
        yield SystemCommand("Help", "F1: keys and gauges", self.action_help)


def run_tui(config, blas=None, verbose: bool = False, resume: int | str | None = None, save: bool = True) -> int:
    """Run the terminal UI until the user quits; returns the process exit code.

    ``resume`` (a conversation id or "latest") continues a saved conversation; ``save=False``
    keeps the chat in memory only (``--no-save``)."""
    app = ChatApp(config, blas=blas, verbose=verbose, resume=resume, save=save)
    result = app.run(headless=start_probe.active())
    if verbose:
        for message, detail in app.engine.failures:
            print(f"chatapp: {message}", file=sys.stderr)
            if detail:
                print(detail, file=sys.stderr)
    if app.engine.load_error:
        print(f"chatapp: error: {app.engine.load_error}", file=sys.stderr)
        return 2
    if app.return_code not in (None, 0):
        return app.return_code
    return result if isinstance(result, int) else 0
