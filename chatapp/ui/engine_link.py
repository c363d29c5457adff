"""The app's part that follows the engine (``ChatApp.engine``, an :class:`EngineClient`): its
messages, the streaming reply, the status bar and the side panel.

The client owns its state (created by its own ``__init__``) and reaches the app only through
:class:`EngineHost`, the app's public face it needs (notifications, screens, widgets, the config
and the comforts' part); the app reads the client's state through ``app.engine`` and never the
other way round by private name. Each kind of engine event arrives as its own message
(:mod:`chatapp.ui.messages`, all subclasses of ``EngineMessage``); the app's one
``@on(EngineMessage)`` handler is :func:`deliver`, which records its ``kind`` in the client's
``event_log`` and runs the kind's handler on the client, a method marked ``@handles(<event type>)``
(``HANDLERS``). The comforts' results go on to their part (``host.comforts``, ui/comforts.py).
The one busy state is the client's: the requests in flight (``in_flight``, ``busy``), which it
puts on the engine worker's queue itself (``submit``).

The messages on screen are the transcript mirror's (ui/transcript.py, the app's second part, given
to the client): the engine's message indexes (``CacheView.first_visible_message``) map to its
``entries``; the client adds the replies and shows what the cache holds of each.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections import deque
from typing import Any, Callable, Protocol

from cache.settings import CAPPED, starting_mode
from chatapp.engine.events import (
    ChatNotes,
    CompareResult,
    ConversationChanged,
    Failed,
    Idle,
    Loaded,
    LoadProgress,
    ModelReleased,
    ModelSwitch,
    PrefillProgress,
    SessionInfo,
    StartupFailed,
    Switched,
    SystemChange,
    TokenEvent,
    TranscriptLoaded,
    TurnDone,
)
from chatapp.engine.requests import Compare, EditLast, Regenerate, Request, Send
from chatapp.engine.stats import CacheView, MemoryGauges, StepStat, TurnStats

from . import start_probe
from .bridge import EngineBridge
from .coalesce import Coalescer
from .comforts import Comforts
from .format import freeze, freeze_cache, freeze_memory, live_cache, status_items
from .messages import BatchMessage, EngineMessage
from .screens import CompareScreen, LoadingScreen, SessionsScreen
from .transcript import Transcript
from .widgets import (
    AssistantMessage,
    ChatInput,
    ChatMessage,
    Entry,
    SidePanel,
    StatusBar,
    SystemMessage,
    UserMessage,
)

INPUT_TITLE = "message · Enter sends · Ctrl+J new line"
BUSY_TITLE = "reply streaming · Enter queues your message · Esc stops"
EDIT_TITLE = "editing your last message · Enter resends · Esc cancels"
LOADING_TITLE = "the model is loading · Enter queues your message · Ctrl+Q quits"


#: event kind -> the EngineClient method that shows it (filled by ``@handles``; one per kind)
HANDLERS: dict[type, Callable[[Any, Any], Any]] = {}


def handles(*kinds: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make the decorated method the handler of these engine event kinds."""

    def register(method: Callable[..., Any]) -> Callable[..., Any]:
        for kind in kinds:
            HANDLERS[kind] = method
        return method

    return register


async def deliver(app: HasEngine, message: EngineMessage) -> None:
    """The app's one ``@on(EngineMessage)`` handler (``ChatApp._on_engine`` is this function):
    every engine event's kind is recorded in the client's ``event_log`` and the kind's handler,
    looked up by the event's type, runs on the client (``app.engine``; one handler per kind). A
    batched message (tokens, prefill progress: ui/messages.py's ``BatchMessage``) is taken from the
    engine thread here, each of its events recorded, the handler run once with the batch's event
    (the tokens' text together, the newest progress)."""
    client = app.engine
    event, count = message.take() if isinstance(message, BatchMessage) else (message.event, 1)
    client.event_log.extend([message.kind] * count)
    result = HANDLERS[type(event)](client, event)
    if inspect.isawaitable(result):
        await result


class HasEngine(Protocol):
    """The app as ``deliver`` sees it: the holder of its engine client."""

    engine: EngineClient


class EngineHost(Protocol):
    """What the engine client uses of the app (``ChatApp``): Textual's screens, widgets and
    notifications, the configuration (which a model switch replaces) and the comforts' part."""

    config: Any
    comforts: Comforts
    sub_title: str

    @property
    def is_mounted(self) -> bool: ...
    @property
    def screen_stack(self) -> list[Any]: ...
    def notify(self, message: str, **kwargs: Any) -> None: ...
    def push_screen(self, screen: Any, callback: Callable[[Any], Any] | None = None) -> Any: ...
    def pop_screen(self) -> Any: ...
    def query_one(self, selector: Any, expect_type: Any = None) -> Any: ...
    def refresh_bindings(self) -> None: ...
    def post_message(self, message: Any) -> bool: ...


class EngineClient:
    """The app's part that follows the engine (``ChatApp.engine``). Owns what the engine's events
    change: the bridge, the session as last described, the streaming reply and its statistics, the
    status bar's rebuilds; ``transcript`` is the mirror of the messages it adds to. ``host`` is the
    app (:class:`EngineHost`)."""

    def __init__(self, host: EngineHost, config, transcript: Transcript, *, blas=None, verbose: bool = False,
                 freeze_stats: bool = False, resume: int | str | None = None, save: bool = True) -> None:
        self.host = host
        self.transcript = transcript  # the messages on screen, mirrored (ui/transcript.py)
        self.blas = blas
        self.verbose = verbose
        self.freeze_stats = freeze_stats
        self.bridge = EngineBridge(config, host.post_message, save=save, resume=resume)
        self.conversation_id: int | None = None  # the saved conversation on screen (opened, resumed, or a TurnDone's)
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
        self.mode = starting_mode(config.cache.mode)
        self.requested_mode = config.cache.mode
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
        self.reply: AssistantMessage | None = None  # the reply streaming now
        self._pending_text = ""
        self._stream_lock: asyncio.Lock | None = None
        self._seen_notices: set[str] = set()
        self.in_flight: deque[Request] = deque()  # submitted, their Idle not back yet, oldest first
        self.event_log: deque[str] = deque(maxlen=2000)  # engine event names, newest last (tests, debugging)
        self.status_rate = Coalescer(self._rebuild_status)  # status-bar rebuilds at a steady rate
        # Rebuild the status bar now (per-token figures go through ``status_rate.request``): the
        # coalescer's ``now``, so it counts as the interval's rebuild.
        self.update_status: Callable[[], None] = self.status_rate.now

    def mounted(self) -> None:
        """The app is mounted: the streaming reply's lock belongs to its event loop."""
        self._stream_lock = asyncio.Lock()

    # ---- engine messages: one handler per kind (``deliver`` runs it) --------------------------------------
    @handles(LoadProgress)
    async def _loading(self, ev: LoadProgress) -> None:
        if self.loading_screen is None and not self.loaded and ev.phase == "download":
            # a download takes minutes: its own screen with a progress bar (a later start loads
            # under the chat, whose input box takes messages from the first frame on)
            self.loading_screen = LoadingScreen(self.model_id)
            await self.host.push_screen(self.loading_screen)
        if self.loading_screen is not None:
            self.loading_screen.progress(ev.phase, ev.detail, ev.percent)
        elif not self.loaded:
            self.set_phase(f"loading: {ev.detail}")
        else:  # a switch compiling the new model's kernels: its dialog shows it
            self.host.comforts.model_progress(ev.detail)

    @handles(TranscriptLoaded)
    async def _transcript(self, ev: TranscriptLoaded) -> None:
        if self.loaded:
            await self._show_transcript(ev)
        else:
            self._pending_transcript = ev

    @handles(SystemChange)
    async def _system_changed(self, ev: SystemChange) -> None:
        await self.host.comforts.system_changed(ev)  # the part that asked for it (ui/comforts.py)

    @handles(ModelSwitch)
    async def _model_switched(self, ev: ModelSwitch) -> None:
        await self.host.comforts.model_switched(ev)

    @handles(ModelReleased)
    def _model_released(self, ev: ModelReleased) -> None:
        line = ev.line()
        self.store_notes.append(("note", line))
        self.host.notify(line, title="model switched", markup=False, timeout=12)

    @handles(TokenEvent)
    def _token(self, ev: TokenEvent) -> None:
        self.live_stats = self._fz(ev.stats)
        self._pending_text += ev.text
        self.status_rate.request()  # rebuilt a few times a second, not per token (ui/coalesce.py)

    @handles(PrefillProgress)
    def _prefill(self, ev: PrefillProgress) -> None:
        self.live_stats = self._fz(ev.stats)
        self.phase = f"prefill {ev.done * 100 // max(ev.total, 1)}%"
        self.status_rate.request()

    @handles(CompareResult)
    def _compare_row(self, ev: CompareResult) -> None:
        self.compare_rows.append(ev.row)
        if self.compare_screen is not None:
            self.compare_screen.add_row(ev.row, ev.done)

    def _fz(self, stats: TurnStats) -> TurnStats:
        return freeze(stats) if self.freeze_stats else stats

    @handles(Loaded)
    async def _loaded(self, ev: Loaded) -> None:
        self.loaded = True
        self.phase = ""
        self.model_id = ev.model_id or self.model_id
        # Pop the loading screen (and anything opened over it, e.g. help).
        while self.loading_screen is not None and self.loading_screen in self.host.screen_stack:
            await self.host.pop_screen()
        self.loading_screen = None
        if self._pending_transcript is not None:
            await self._show_transcript(self._pending_transcript)
            self._pending_transcript = None
        elif self.host.config.chat.system:
            await self.transcript.add_message(SystemMessage(self.host.config.chat.system, 0), "system")
        for note in ev.notes:
            self.notice(note)
        if self.verbose and self.blas is not None and hasattr(self.blas, "summary"):
            self.host.notify(self.blas.summary(), markup=False)
        self.show_session(ev.info)
        if self.transcript.queued:  # typed while loading: after what the load showed, then sent in turn
            for text in await self.transcript.take_queued():
                await self.transcript.queue(text)
            if not self.busy:
                await self.send_queued()
        self.host.query_one(ChatInput).focus()
        self.host.refresh_bindings()  # the main actions a load held back (ChatApp.check_action)
        self.update_input_state()
        self.update_status()
        start_probe.reached("ready")

    @handles(SessionInfo, Switched)
    def show_session(self, info: SessionInfo | Switched | None) -> None:
        """A state change's event came with the session it produced (or it is the description
        itself): show it, no second request. A cache-mode switch (``Switched``: F3, the mode dialog)
        says its report, then shows the session it brought. None: only the status bar is rebuilt."""
        if isinstance(info, Switched):
            self.host.notify(info.line(), title="cache mode", markup=False)
            self.mode, info = info.mode, info.info
        if info is None:
            self.update_status()
            return
        if self.freeze_stats:
            info.cache = freeze_cache(info.cache)
            info.memory = freeze_memory(info.memory)
        self.info = info
        self.memory = info.memory
        self.mode = info.mode
        self.requested_mode = info.requested_mode
        self.cache_view = info.cache
        self.transcript.show_cache(info.cache, info.effective)
        self.update_status()
        self.update_panel()

    @handles(TurnDone)
    async def _turn_done(self, ev: TurnDone) -> None:
        if ev.error:
            await self._turn_failed(ev)
            return
        stats = self._fz(ev.stats)
        widget = self.reply
        async with self._stream_lock:
            self._pending_text = ""
            if widget is not None:
                await widget.finish(ev.text, stats.finish)
        self.reply = None
        self.live_stats = None
        self.phase = ""
        if ev.conversation_id is not None:  # a first turn saved a new conversation
            self.conversation_id = ev.conversation_id
        interrupted = stats.finish == "cancelled"
        if ev.text or not interrupted:
            if widget is not None:
                widget.conv_index = len(self.transcript.entries)
            self.transcript.entries.append(Entry("assistant", ev.text, widget))
        self.last_stats = stats
        self.cache_view = stats.cache
        self.mode = stats.mode or self.mode
        self.history.append(stats)
        self.conv_steps.extend(stats.steps)
        self.conv_memory.extend(stats.memory_trace)
        self.memory = stats.memory if stats.memory_trace else self.memory
        if stats.prefix_tokens:  # every time, not once per kind like the notices below
            self.store_notes.append(("note", stats.prefix_line()))
            self.host.notify(stats.prefix_line(), title="prefix store", markup=False, timeout=6)
        for note in stats.notices:
            self.notice(note)
        self.transcript.show_cache(stats.cache, self.info.effective if self.info else {})
        self.update_status()
        self.update_panel()

    async def _turn_failed(self, ev: TurnDone) -> None:
        """The reply failed part-way (the Failed event that follows says why): the streaming ends,
        the reply is marked failed, and what was shown of it, which the conversation keeps as an
        interrupted reply, joins the mirror; no statistics are recorded for it."""
        await self.flush_stream()
        widget = self.reply
        if widget is not None:
            widget.fail(ev.error)
        self.reply = None
        self.live_stats = None
        self.phase = ""
        if ev.conversation_id is not None:  # a first turn saved a new conversation
            self.conversation_id = ev.conversation_id
        if ev.text:
            if widget is not None:
                widget.conv_index = len(self.transcript.entries)
            self.transcript.entries.append(Entry("assistant", ev.text, widget))
        self.update_status()

    @handles(Idle)
    async def _idle(self, _ev: Idle) -> None:
        request = self.in_flight.popleft() if self.in_flight else None  # the oldest request is done
        match request:
            case Send() | Regenerate() | EditLast() if self.reply is not None:
                # The request ended without a TurnDone: it failed before its reply began (the
                # Failed event said why).
                await self.flush_stream()
                self.reply.fail("")
                self.reply = None
                self.live_stats = None
            case Compare() if self.compare_screen is not None:
                self.compare_screen.finish()
        if not self.busy:
            self.phase = ""
            if self.transcript.queued:
                await self.send_queued()
        self.update_input_state()
        self.update_status()

    @handles(Failed, StartupFailed)
    def _failed(self, ev: Failed | StartupFailed) -> None:
        self.failures.append((ev.message, ev.detail))
        if getattr(ev, "info", None) is not None:  # the session after the failed request (StartupFailed has none)
            self.show_session(ev.info)
        if not self.loaded:
            self.load_error = ev.message
            self.phase = "not loaded"
            if self.loading_screen is not None:
                self.loading_screen.fail(ev.message)
            else:  # loading went on under the chat: the failure gets the loading screen's page
                self.loading_screen = LoadingScreen(self.model_id, error=ev.message)
                self.host.push_screen(self.loading_screen)
            self.host.notify(ev.message, title="could not load the model", severity="error", markup=False,
                             timeout=30)
            return
        self.host.notify(ev.message, title="error", severity="error", markup=False, timeout=10)

    def notice(self, note: str) -> None:
        key = re.sub(r"\d+", "#", note)
        if key in self._seen_notices:
            return
        self._seen_notices.add(key)
        self.host.notify(note, title="note", severity="warning", markup=False, timeout=10)

    # ---- saved conversations ----------------------------------------------------------------------
    @handles(ChatNotes)
    def _store_notes(self, ev: ChatNotes) -> None:
        for level, text in ev.notes:
            self.store_notes.append((level, text))
            self.host.notify(text, title="error" if level == "error" else "note",
                             severity="error" if level == "error" else "warning", markup=False, timeout=10)

    async def _show_transcript(self, ev: TranscriptLoaded) -> None:
        """A saved conversation became the session's: show its messages."""
        self.editing = False
        await self.transcript.clear()
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
            self.transcript.entries.append(Entry(role, content, widget))
            await self.transcript.mount_message(widget)
        self.conversation_id = ev.conversation_id
        self.conversation_title = ev.title
        self.resume_line = ev.line
        self.host.sub_title = ev.title
        if ev.info is not None:
            self.show_session(ev.info)
        self.host.notify(ev.line, title="resumed from the KV snapshot" if ev.from_snapshot else "resumed: re-prefill",
                         severity="information" if ev.from_snapshot else "warning", markup=False, timeout=8)
        self.update_input_state()
        self.update_status()
        self.update_panel()

    @handles(ConversationChanged)
    async def _conversation_changed(self, ev: ConversationChanged) -> None:
        if ev.deleted:
            if ev.current:
                await self.clear_conversation()
                self.show_session(ev.info)
            self.host.notify(f"conversation {ev.conversation_id} deleted", markup=False, timeout=4)
        else:
            if ev.current:
                self.conversation_title = ev.title
                self.host.sub_title = ev.title
            self.host.notify(f"conversation {ev.conversation_id} renamed to {ev.title}", markup=False, timeout=4)
        if self.sessions_screen is not None and self.sessions_screen.is_attached:
            self.sessions_screen.current = self.conversation_id
            self.sessions_screen.reload()

    async def clear_conversation(self) -> None:
        self.editing = False
        await self.transcript.clear()
        self.conv_steps = []
        self.conv_memory = []
        self.last_stats = None
        self.conversation_id = None
        self.conversation_title = ""
        self.host.sub_title = ""
        if self.host.config.chat.system:
            await self.transcript.add_message(SystemMessage(self.host.config.chat.system), "system")
        self.update_panel()

    # ---- streaming ----------------------------------------------------------------------------------
    async def flush_stream(self) -> None:
        """Move the text received since the last tick into the reply (on a timer, and at the end);
        the timer also rebuilds the status bar when figures wait for their interval."""
        self.status_rate.tick()
        if self._stream_lock is None:
            return
        async with self._stream_lock:
            if self.reply is not None and self._pending_text:
                chunk, self._pending_text = self._pending_text, ""
                await self.reply.append(chunk)

    async def start_reply(self, request: Request, after: ChatMessage | None = None) -> None:
        widget = AssistantMessage()
        widget.tags = ["streaming"]
        await self.transcript.mount_message(widget, after=after)
        self.reply = widget
        self._pending_text = ""
        self.live_stats = None
        self.phase = "thinking"
        self.submit(request)
        self.update_status()

    def submit(self, request: Request) -> None:
        """Put ``request`` on the engine worker's queue (it is in flight, the app busy, until its Idle)."""
        self.in_flight.append(request)
        self.bridge.worker.submit(request)
        self.update_input_state()

    @property
    def busy(self) -> bool:
        """Requests in flight: the one busy state of the UI."""
        return bool(self.in_flight)

    # ---- status and panel ---------------------------------------------------------------------------------
    def mode_label(self) -> str:
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
        if self.mode in CAPPED:
            return e.get("max_kv_tokens")
        return None

    def set_phase(self, phase: str) -> None:
        """What the status bar says the app is doing ("" nothing in particular); shown at once."""
        self.phase = phase
        self.update_status()

    def _rebuild_status(self) -> None:
        if not self.host.is_mounted:
            return
        live = self.reply is not None and self.live_stats is not None
        stats = self.live_stats if live else self.last_stats
        cache = live_cache(stats, self.cache_view, self._budget()) if live else self.cache_view
        if self.reply is not None:
            phase = "streaming" if self.live_stats and self.live_stats.generated_tokens else self.phase or "thinking"
        else:
            phase = self.phase or ("busy" if self.busy else "")
        try:
            bar = self.host.query_one(StatusBar)
        except Exception:  # noqa: BLE001 - not composed yet
            return
        bar.set_items(status_items(self.model_id, self.mode_label(), stats, cache, live=live, phase=phase,
                                   memory=self.memory))

    def update_panel(self) -> None:
        try:
            panel = self.host.query_one(SidePanel)
        except Exception:  # noqa: BLE001
            return
        if panel.display:
            panel.update_panel(self.conv_steps, self.cache_view, self.history, self.conv_memory, self.memory)

    def update_input_state(self) -> None:
        try:
            chat_input = self.host.query_one(ChatInput)
        except Exception:  # noqa: BLE001
            return
        busy = self.busy
        chat_input.set_class(busy, "busy")
        chat_input.set_class(self.editing, "editing")
        chat_input.border_title = (LOADING_TITLE if not self.loaded else EDIT_TITLE if self.editing
                                   else BUSY_TITLE if busy else INPUT_TITLE)

    async def send_queued(self) -> None:
        widget = self.transcript.queued.pop(0)
        widget.set_tag("queued", False)
        widget.conv_index = len(self.transcript.entries)
        self.transcript.entries.append(Entry("user", widget.text, widget))
        await self.start_reply(Send(widget.text), after=widget)
