"""The Textual chat app: streaming replies, live speed and cache gauges, cache modes.

Threading: every model operation runs on the engine worker's thread
(:class:`chatapp.engine.worker.EngineWorker`, owned by :class:`chatapp.ui.bridge.EngineBridge`).
Its events arrive here as :class:`~chatapp.ui.bridge.EngineEvent` messages, in order, on the
UI thread. The UI keeps a mirror of the session's conversation (``entries``) so that message
indexes reported by the engine (``CacheView.first_visible_message``) map to transcript widgets.

While a reply streams, messages are queued: Enter shows the message marked "queued" and it is
sent when the engine is free; Esc stops the reply and puts queued messages back into the input
box. Cache-mode switches asked for during a reply are queued on the engine thread and apply
when the reply ends. Regenerate, edit, new chat and compare wait for an idle engine.

Every conversation is saved as it goes (docs/persistence.md): the bridge's engine thread runs
the turns through a :class:`~chatapp.store.chat.PersistentChat`. The sessions screen (F7) lists
the saved conversations and opens (resumes), renames or deletes them.
"""

from __future__ import annotations

import re
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from chatapp.engine.events import CompareResult, Failed, Idle, Loaded, PrefillProgress, Switched, TokenEvent, TurnDone
from chatapp.engine.stats import CacheView, MemoryGauges, StepStat, TurnStats

from .bridge import (
    ChatNotes,
    ConversationChanged,
    EngineBridge,
    EngineEvent,
    LoadProgress,
    SessionInfo,
    StartupFailed,
    TranscriptLoaded,
)
from .format import MODES, freeze, freeze_cache, freeze_memory, live_cache, next_mode, status_items
from .screens import CompareScreen, ConfigScreen, HelpScreen, LoadingScreen, ModeDialog, SessionsScreen
from .widgets import (
    AssistantMessage,
    ChatInput,
    ChatMessage,
    ChatView,
    SidePanel,
    StatusBar,
    SystemMessage,
    UserMessage,
)

REPLY_COMMANDS = ("send", "regenerate", "edit_last")
INPUT_TITLE = "message · Enter sends · Ctrl+J new line"
BUSY_TITLE = "reply streaming · Enter queues your message · Esc stops"
EDIT_TITLE = "editing your last message · Enter resends · Esc cancels"


@dataclass
class Entry:
    """One message of the session's conversation, as the UI mirrors it."""

    role: str
    text: str
    widget: ChatMessage | None = None


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
        Binding("f3", "cycle_mode", "Mode"),
        Binding("f5", "compare", "Compare"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+o", "edit_last", "Edit"),
        Binding("ctrl+l", "clear", "Clear"),
        Binding("f4", "mode_dialog", "Mode…"),
        Binding("f6", "show_config", "Config"),
        Binding("f7", "sessions", "Sessions", show=False),
        Binding("ctrl+p", "command_palette", "Palette", show=False),
    ]

    def __init__(self, config, *, blas=None, verbose: bool = False, freeze_stats: bool = False,
                 resume: int | str | None = None, save: bool = True) -> None:
        super().__init__()
        self.config = config
        self.blas = blas
        self.verbose = verbose
        self.freeze_stats = freeze_stats
        self.bridge = EngineBridge(config, self.post_message, save=save, resume=resume)
        self.conversation_id: int | None = None  # the saved conversation on screen, once opened / resumed
        self.conversation_title = ""
        self.resume_line = ""  # how the last opened conversation was resumed
        self.store_notes: list[tuple[str, str]] = []  # every note / error of the conversation store
        self.sessions_screen: SessionsScreen | None = None
        self._pending_transcript: TranscriptLoaded | None = None  # --resume: shown once loaded
        self.loaded = False
        self.load_error = ""
        self.failures: list[tuple[str, str]] = []  # (message, traceback) of every Failed event
        self.model_id = config.model.id
        self.info: SessionInfo | None = None
        self.mode = config.cache.mode if config.cache.mode != "auto" else "prealloc"
        self.requested_mode = config.cache.mode
        self.entries: list[Entry] = []
        self.commands: deque[str] = deque()  # submitted commands, oldest first
        self.last_stats: TurnStats | None = None
        self.live_stats: TurnStats | None = None
        self.cache_view: CacheView | None = None
        self.history: list[TurnStats] = []  # every finished turn of this app session, all modes
        self.conv_steps: list[StepStat] = []  # decode steps of this conversation
        self.memory: MemoryGauges | None = None  # MLX's allocator gauges, latest reading
        self.conv_memory: list[MemoryGauges] = []  # every reading of this conversation's turns
        self.compare_rows: list[Any] = []
        self.compare_screen: CompareScreen | None = None
        self.loading_screen: LoadingScreen | None = None
        self.editing = False
        self.phase = "loading"
        self._reply: AssistantMessage | None = None
        self.queued: list[UserMessage] = []  # messages sent during a reply, waiting their turn
        self._pending_text = ""
        self._stream_lock = None
        self._seen_notices: set[str] = set()
        self.event_log: deque[str] = deque(maxlen=2000)  # engine event names, newest last (tests, debugging)

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
        import asyncio

        self._stream_lock = asyncio.Lock()
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
        self._update_status()
        self.set_interval(max(self.config.ui.render_interval_ms, 10) / 1000, self._flush_stream)
        self.loading_screen = LoadingScreen(self.model_id)
        await self.push_screen(self.loading_screen)
        self.bridge.start()

    # ---- engine events ----------------------------------------------------------------------------
    async def on_engine_event(self, message: EngineEvent) -> None:
        ev = message.event
        self.event_log.append(type(ev).__name__)
        if isinstance(ev, LoadProgress):
            if self.loading_screen is not None:
                self.loading_screen.progress(ev.phase, ev.detail, ev.percent)
            return
        if isinstance(ev, SessionInfo):
            self._session_info(ev)
            return
        if isinstance(ev, StartupFailed):
            self._failed(ev)
            return
        if isinstance(ev, ChatNotes):
            self._store_notes(ev.notes)
            return
        if isinstance(ev, TranscriptLoaded):
            if self.loaded:
                await self._show_transcript(ev)
            else:
                self._pending_transcript = ev
            return
        if isinstance(ev, ConversationChanged):
            await self._conversation_changed(ev)
            return
        if isinstance(ev, TokenEvent):
            self.live_stats = self._fz(ev.stats)
            self._pending_text += ev.text
            self._update_status()
        elif isinstance(ev, PrefillProgress):
            self.live_stats = self._fz(ev.stats)
            self.phase = f"prefill {ev.done * 100 // max(ev.total, 1)}%"
            self._update_status()
        elif isinstance(ev, TurnDone):
            await self._turn_done(ev)
        elif isinstance(ev, Idle):
            await self._idle()
        elif isinstance(ev, Loaded):
            await self._loaded(ev)
        elif isinstance(ev, Switched):
            self.notify(ev.report.line(), title="cache mode", markup=False)
            self.mode = ev.report.mode
            self._update_status()
        elif isinstance(ev, CompareResult):
            self.compare_rows.append(ev.row)
            if self.compare_screen is not None:
                self.compare_screen.add_row(ev.row, ev.done)
        elif isinstance(ev, Failed):
            self._failed(ev)

    def _fz(self, stats: TurnStats) -> TurnStats:
        return freeze(stats) if self.freeze_stats else stats

    async def _loaded(self, ev) -> None:
        self.loaded = True
        self.phase = ""
        self.model_id = ev.model_id or self.model_id
        # Pop the loading screen (and anything opened over it, e.g. help).
        while self.loading_screen is not None and self.loading_screen in self.screen_stack:
            await self.pop_screen()
        self.loading_screen = None
        if self._pending_transcript is not None:
            await self._show_transcript(self._pending_transcript)
            self._pending_transcript = None
        elif self.config.chat.system:
            await self._add_message(SystemMessage(self.config.chat.system, 0), "system")
        for note in ev.notes:
            self._notice(note)
        if self.verbose and self.blas is not None and hasattr(self.blas, "summary"):
            self.notify(self.blas.summary(), markup=False)
        self.bridge.request_info()
        self._track("call")
        self.query_one(ChatInput).focus()
        self._update_status()

    def _session_info(self, info: SessionInfo) -> None:
        if self.freeze_stats:
            info.cache = freeze_cache(info.cache)
            info.memory = freeze_memory(info.memory)
        self.info = info
        self.memory = info.memory
        self.mode = info.mode
        self.requested_mode = info.requested_mode
        self.cache_view = info.cache
        self._mark_evicted(info.cache.first_visible_message)
        self._update_status()
        self._update_panel()

    async def _turn_done(self, ev) -> None:
        stats = self._fz(ev.stats)
        widget = self._reply
        async with self._stream_lock:
            self._pending_text = ""
            if widget is not None:
                await widget.finish(ev.text, stats.finish)
        self._reply = None
        self.live_stats = None
        self.phase = ""
        interrupted = stats.finish == "cancelled"
        if ev.text or not interrupted:
            if widget is not None:
                widget.conv_index = len(self.entries)
            self.entries.append(Entry("assistant", ev.text, widget))
        self.last_stats = stats
        self.cache_view = stats.cache
        self.mode = stats.mode or self.mode
        self.history.append(stats)
        self.conv_steps.extend(stats.steps)
        self.conv_memory.extend(stats.memory_trace)
        self.memory = stats.memory if stats.memory_trace else self.memory
        if stats.prefix_tokens:  # every time, not once per kind like the notices below
            self.store_notes.append(("note", stats.prefix_line()))
            self.notify(stats.prefix_line(), title="prefix store", markup=False, timeout=6)
        for note in stats.notices:
            self._notice(note)
        self._mark_evicted(stats.cache.first_visible_message)
        self._update_status()
        self._update_panel()

    async def _idle(self) -> None:
        self.bridge.idle()
        command = self.commands.popleft() if self.commands else ""
        if command in REPLY_COMMANDS and self._reply is not None:
            # The command ended without a TurnDone: it failed (the Failed event said why).
            await self._flush_stream()
            self._reply.fail("")
            self._reply = None
            self.live_stats = None
        if command == "compare":
            if self.compare_screen is not None:
                self.compare_screen.finish()
        if command == "switch_mode":
            self.bridge.request_info()
            self._track("call")
        if not self.bridge.busy:
            self.phase = ""
            if self.queued:
                await self._send_queued()
        self._update_input_state()
        self._update_status()

    def _failed(self, ev) -> None:
        self.failures.append((ev.message, ev.detail))
        if not self.loaded:
            self.load_error = ev.message
            if self.loading_screen is not None:
                self.loading_screen.fail(ev.message)
            self.notify(ev.message, title="could not load the model", severity="error", markup=False,
                        timeout=30)
            return
        self.notify(ev.message, title="error", severity="error", markup=False, timeout=10)

    def _notice(self, note: str) -> None:
        key = re.sub(r"\d+", "#", note)
        if key in self._seen_notices:
            return
        self._seen_notices.add(key)
        self.notify(note, title="note", severity="warning", markup=False, timeout=10)

    # ---- saved conversations ----------------------------------------------------------------------
    def _store_notes(self, notes: list[tuple[str, str]]) -> None:
        for level, text in notes:
            self.store_notes.append((level, text))
            self.notify(text, title="error" if level == "error" else "note",
                        severity="error" if level == "error" else "warning", markup=False, timeout=10)

    async def _show_transcript(self, ev: TranscriptLoaded) -> None:
        """A saved conversation became the session's: show its messages."""
        self.editing = False
        await self.query_one(ChatView).remove_children()
        self.entries = []
        self.conv_steps = []
        self.conv_memory = []
        self.last_stats = None
        for i, (role, content, interrupted) in enumerate(ev.messages):
            cls = {"system": SystemMessage, "user": UserMessage}.get(role, AssistantMessage)
            widget = cls(content, i)
            if isinstance(widget, AssistantMessage):
                widget.finished = True
                if interrupted:
                    widget.tags = ["interrupted"]
                    widget.add_class("interrupted")
            self.entries.append(Entry(role, content, widget))
            await self._mount_message(widget)
        self.conversation_id = ev.conversation_id
        self.conversation_title = ev.title
        self.resume_line = ev.line
        self.sub_title = ev.title
        self.notify(ev.line, title="resumed from the KV snapshot" if ev.from_snapshot else "resumed: re-prefill",
                    severity="information" if ev.from_snapshot else "warning", markup=False, timeout=8)
        self._update_input_state()
        self._update_status()
        self._update_panel()

    async def _conversation_changed(self, ev: ConversationChanged) -> None:
        if ev.deleted:
            if ev.current:
                await self._clear_conversation()
                self.bridge.request_info()
                self._track("call")
            self.notify(f"conversation {ev.conversation_id} deleted", markup=False, timeout=4)
        else:
            if ev.current:
                self.conversation_title = ev.title
                self.sub_title = ev.title
            self.notify(f"conversation {ev.conversation_id} renamed to {ev.title}", markup=False, timeout=4)
        if self.sessions_screen is not None and self.sessions_screen.is_attached:
            self.sessions_screen.current = self._current_conversation()
            self.sessions_screen.reload()

    def _current_conversation(self) -> int | None:
        chat = self.bridge.chat  # an int read from the engine thread's object: no lock needed
        return chat.conversation_id if chat is not None else self.conversation_id

    def list_conversations(self) -> tuple[list[Any], str]:
        """The saved conversations (read on the UI thread: SQLite readers never block the writer)."""
        from chatapp.store import ChatStore, StoreError

        data_dir = self.bridge.data_dir()
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
        self.sessions_screen = SessionsScreen(self.list_conversations, self.open_conversation,
                                              self.rename_conversation, self.delete_conversation,
                                              current=self._current_conversation())
        self.push_screen(self.sessions_screen)

    def open_conversation(self, conversation_id: int) -> None:
        """Show a saved conversation and continue it (its KV snapshot is restored when it fits)."""
        if self._refuse_busy("open"):
            return
        self.bridge.open_conversation(conversation_id)
        self._track("call")
        self.bridge.request_info()
        self._track("call")

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        if not self.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        self.bridge.rename_conversation(conversation_id, title)
        self._track("call")

    def delete_conversation(self, conversation_id: int) -> None:
        if self._refuse_busy("delete"):
            return
        self.bridge.delete_conversation(conversation_id)
        self._track("call")

    async def _clear_conversation(self) -> None:
        self.editing = False
        await self.query_one(ChatView).remove_children()
        self.entries = []
        self.conv_steps = []
        self.conv_memory = []
        self.last_stats = None
        self.conversation_id = None
        self.conversation_title = ""
        self.sub_title = ""
        if self.config.chat.system:
            await self._add_message(SystemMessage(self.config.chat.system), "system")
        self._update_panel()

    # ---- streaming ----------------------------------------------------------------------------------
    async def _flush_stream(self) -> None:
        """Move the text received since the last tick into the reply (on a timer, and at the end)."""
        if self._stream_lock is None:
            return
        async with self._stream_lock:
            if self._reply is not None and self._pending_text:
                chunk, self._pending_text = self._pending_text, ""
                await self._reply.append(chunk)

    async def _start_reply(self, command: str, *args: Any, after: ChatMessage | None = None) -> None:
        widget = AssistantMessage()
        widget.tags = ["streaming"]
        await self._mount_message(widget, after=after)
        self._reply = widget
        self._pending_text = ""
        self.live_stats = None
        self.phase = "thinking"
        self.bridge.submit(command, *args)
        self._track(command)
        self._update_status()

    def _track(self, command: str) -> None:
        self.commands.append(command)
        self._update_input_state()

    # ---- the transcript mirror --------------------------------------------------------------------------
    async def _mount_message(self, widget: ChatMessage, after: ChatMessage | None = None) -> None:
        chat = self.query_one(ChatView)
        if after is not None and after.parent is chat:
            await chat.mount(widget, after=after)
        else:
            await chat.mount(widget)
        if chat.is_anchored and not chat._anchor_released:
            chat.scroll_end(animate=False)

    async def _add_message(self, widget: ChatMessage, role: str) -> Entry:
        widget.conv_index = len(self.entries)
        entry = Entry(role, widget.text, widget)
        self.entries.append(entry)
        await self._mount_message(widget)
        return entry

    def _last_user(self) -> int | None:
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i].role == "user":
                return i
        return None

    def _mark_evicted(self, first_visible: int) -> None:
        for i, entry in enumerate(self.entries):
            if entry.widget is not None:
                entry.widget.set_evicted(i < first_visible)

    # ---- status and panel ---------------------------------------------------------------------------------
    def _mode_label(self) -> str:
        if self.requested_mode == "auto":
            return f"auto→{self.mode}"
        return self.mode

    def _budget(self) -> int | None:
        """Most tokens the current evicting mode keeps (from the settings in use), else None."""
        if self.info is None:
            return None
        e = self.info.effective
        if self.mode == "window":
            return e.get("sinks", 0) + e.get("window", 0)
        if self.mode in ("window-quant", "scored", "scored-quant"):
            return e.get("max_kv_tokens")
        return None

    def _update_status(self) -> None:
        if not self.is_mounted:
            return
        live = self._reply is not None and self.live_stats is not None
        stats = self.live_stats if live else self.last_stats
        cache = live_cache(stats, self.cache_view, self._budget()) if live else self.cache_view
        if self._reply is not None:
            phase = "streaming" if self.live_stats and self.live_stats.generated_tokens else self.phase or "thinking"
        else:
            phase = self.phase or ("busy" if self.bridge.busy else "")
        try:
            bar = self.query_one(StatusBar)
        except Exception:  # noqa: BLE001 - not composed yet
            return
        bar.set_items(status_items(self.model_id, self._mode_label(), stats, cache, live=live, phase=phase,
                                   memory=self.memory))

    def _update_panel(self) -> None:
        try:
            panel = self.query_one(SidePanel)
        except Exception:  # noqa: BLE001
            return
        if panel.display:
            panel.update_panel(self.conv_steps, self.cache_view, self.history, self.conv_memory, self.memory)

    def _update_input_state(self) -> None:
        try:
            chat_input = self.query_one(ChatInput)
        except Exception:  # noqa: BLE001
            return
        busy = self.bridge.busy
        chat_input.set_class(busy, "busy")
        chat_input.set_class(self.editing, "editing")
        chat_input.border_title = EDIT_TITLE if self.editing else BUSY_TITLE if busy else INPUT_TITLE

    def _refuse_busy(self, what: str) -> bool:
        if not self.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return True
        if self.bridge.busy:
            self.notify(f"{what}: wait for the reply to finish (Esc stops it)", severity="warning", markup=False)
            return True
        return False

    # ---- input ------------------------------------------------------------------------------------------
    async def on_chat_input_submitted(self, message: ChatInput.Submitted) -> None:
        text = message.text.strip()
        if not text:
            return  # empty and whitespace-only messages are ignored
        if not self.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        if self.editing:
            if self._refuse_busy("not resent"):
                return
            message.chat_input.clear()
            await self._resend_edited(text)
            return
        message.chat_input.clear()
        if self.bridge.busy or self.queued:
            await self._queue(text)
        else:
            await self.send(text)

    async def _queue(self, text: str) -> None:
        """Enter during a reply: show the message as queued; it is sent when the engine is free."""
        widget = UserMessage(text)
        widget.tags = ["queued"]
        self.queued.append(widget)
        await self._mount_message(widget)

    async def _send_queued(self) -> None:
        widget = self.queued.pop(0)
        widget.set_tag("queued", False)
        widget.conv_index = len(self.entries)
        self.entries.append(Entry("user", widget.text, widget))
        await self._start_reply("send", widget.text, after=widget)

    async def _unqueue(self) -> None:
        """Esc: queued messages go back into the input box instead of being sent."""
        if not self.queued:
            return
        texts = [w.text for w in self.queued]
        for widget in self.queued:
            if widget.is_attached:
                await widget.remove()
        self.queued = []
        box = self.query_one(ChatInput)
        box.text = "\n\n".join(texts + ([box.text] if box.text.strip() else []))
        box.move_cursor(box.document.end)
        self.notify("queued messages are back in the input box", markup=False, timeout=3)

    async def send(self, text: str) -> None:
        """Send ``text`` as the user's next message (what Enter does)."""
        await self._add_message(UserMessage(text), "user")
        await self._start_reply("send", text)

    async def _resend_edited(self, text: str) -> None:
        self.editing = False
        i = self._last_user()
        if i is None:
            return
        entry = self.entries[i]
        chat = self.query_one(ChatView)
        if entry.widget is not None and entry.widget.parent is chat:
            later = chat.children[chat.children.index(entry.widget) + 1:]
            await chat.remove_children(list(later))
            entry.widget.set_text(text)
            entry.widget.set_tag("edited")
        else:
            entry.widget = UserMessage(text, i)
            await self._mount_message(entry.widget)
        for e in self.entries[i + 1:]:
            if e.widget is not None and e.widget.is_attached:
                await e.widget.remove()
        del self.entries[i + 1:]
        entry.text = text
        await self._start_reply("edit_last", text)

    # ---- actions ----------------------------------------------------------------------------------------
    async def action_cancel(self) -> None:
        if self._reply is not None:
            self.bridge.cancel()
            await self._unqueue()
        elif self.queued:
            await self._unqueue()
        elif self.editing:
            self.editing = False
            self.query_one(ChatInput).clear()
            self._update_input_state()

    async def action_new_chat(self) -> None:
        if self._refuse_busy("new chat"):
            return
        await self._clear_conversation()
        self.bridge.submit("new_chat")
        self._track("new_chat")
        self.bridge.request_info()
        self._track("call")
        self._update_panel()
        self.notify("new chat", markup=False, timeout=2)

    async def action_regenerate(self) -> None:
        if self._refuse_busy("regenerate"):
            return
        if self._last_user() is None:
            self.notify("nothing to regenerate yet", markup=False)
            return
        if self.entries[-1].role == "assistant":
            entry = self.entries.pop()
            if entry.widget is not None and entry.widget.is_attached:
                await entry.widget.remove()
        await self._start_reply("regenerate")

    def action_edit_last(self) -> None:
        if self._refuse_busy("edit"):
            return
        i = self._last_user()
        if i is None:
            self.notify("there is no message to edit yet", markup=False)
            return
        chat_input = self.query_one(ChatInput)
        self.editing = True
        chat_input.text = self.entries[i].text
        chat_input.move_cursor(chat_input.document.end)
        chat_input.focus()
        self._update_input_state()

    async def action_clear(self) -> None:
        await self.query_one(ChatView).remove_children()
        for entry in self.entries:
            entry.widget = None
        if self._reply is not None:  # keep the streaming reply and the queue on screen
            await self._mount_message(self._reply)
        for widget in self.queued:
            await self._mount_message(widget)
        self.notify("screen cleared; the model still has the conversation (Ctrl+N starts over)",
                    markup=False, timeout=3)

    def action_toggle_panel(self) -> None:
        panel = self.query_one(SidePanel)
        panel.display = not panel.display
        self._update_panel()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_show_config(self) -> None:
        extra = [("model", self.model_id)]
        if self.info is not None:
            extra.append(("prompt format", self.info.fmt))
            extra.append(("cache mode in use", self._mode_label()))
        if self.blas is not None:
            extra.append(("BLAS", self.blas.summary() if hasattr(self.blas, "summary") else str(self.blas)))
        self.push_screen(ConfigScreen(self.config, extra))

    def switch_mode(self, mode: str, changes: dict | None = None) -> None:
        """Ask the engine to switch the cache mode; during a reply it applies when the reply ends."""
        if not self.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        if self._reply is not None:
            self.notify(f"cache mode {mode}: applies when this reply ends", markup=False, timeout=4)
        self.requested_mode = mode
        self.bridge.submit("switch_mode", mode, dict(changes or {}))
        self._track("switch_mode")
        if self._reply is None:
            self.phase = f"switching to {mode}"
        self._update_status()

    def action_cycle_mode(self) -> None:
        self.switch_mode(next_mode(self.requested_mode))

    def action_mode_dialog(self) -> None:
        if not self.loaded:
            self.notify("the model is still loading", severity="warning", markup=False)
            return
        settings = self.info.settings if self.info else {
            "window": self.config.cache.window, "sinks": self.config.cache.sinks,
            "kv_bits": self.config.cache.kv_bits, "kv_group_size": self.config.cache.kv_group_size,
            "max_kv_tokens": self.config.cache.max_kv_tokens}
        effective = self.info.effective if self.info else {}

        def done(result) -> None:
            if result is not None:
                mode, changes = result
                self.switch_mode(mode, changes)

        self.push_screen(ModeDialog(self.requested_mode, settings, effective, busy=self.bridge.busy), done)

    def action_compare(self) -> None:
        if self._refuse_busy("compare"):
            return
        if self._last_user() is None:
            self.notify("send a message first: compare replays the last turn", markup=False)
            return
        self.compare_rows = []
        max_tokens = min(self.config.sampling.max_tokens, 128)
        self.compare_screen = CompareScreen(MODES)
        self.push_screen(self.compare_screen)
        self.bridge.submit("compare", list(MODES), max_tokens)
        self._track("compare")
        self.phase = "comparing"
        self._update_status()

    async def action_quit(self) -> None:
        self.bridge.stop(timeout=1.0)
        self.exit(0)

    def on_unmount(self) -> None:
        self.bridge.stop(timeout=1.0)

    # Actions of the main screen: off while a dialog (or the loading screen) is on top, so that,
    # say, Ctrl+N in the mode dialog does not start a new chat behind it.
    MAIN_ACTIONS = frozenset({"cancel", "new_chat", "regenerate", "edit_last", "clear", "toggle_panel",
                              "cycle_mode", "mode_dialog", "compare", "show_config", "sessions"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.MAIN_ACTIONS and len(self.screen_stack) > 1:
            return action == "show_config" and isinstance(self.screen, LoadingScreen)
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
                            self.action_cycle_mode)
        yield SystemCommand("Cache mode…", "F4: choose the cache mode and its settings", self.action_mode_dialog)
        for mode in MODES:
            yield SystemCommand(f"Cache mode: {mode}", f"switch the KV cache to {mode}",
                                lambda m=mode: self.switch_mode(m), discover=False)
        yield SystemCommand("Compare modes", "F5: replay the last turn in every cache mode", self.action_compare)
        yield SystemCommand("Show configuration", "F6: effective settings and where each came from",
                            self.action_show_config)
        yield SystemCommand("Saved conversations", "F7: open (resume), rename or delete a saved conversation",
                            self.action_sessions)
        yield SystemCommand("Help", "F1: keys and gauges", self.action_help)


def run_tui(config, blas=None, verbose: bool = False, resume: int | str | None = None, save: bool = True) -> int:
    """Run the terminal UI until the user quits; returns the process exit code.

    ``resume`` (a conversation id or "latest") continues a saved conversation; ``save=False``
    keeps the chat in memory only (``--no-save``)."""
    app = ChatApp(config, blas=blas, verbose=verbose, resume=resume, save=save)
    result = app.run()
    if verbose:
        for message, detail in app.failures:
            print(f"chatapp: {message}", file=sys.stderr)
            if detail:
                print(detail, file=sys.stderr)
    if app.load_error:
        print(f"chatapp: error: {app.load_error}", file=sys.stderr)
        return 2
    if app.return_code not in (None, 0):
        return app.return_code
    return result if isinstance(result, int) else 0
