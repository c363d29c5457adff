"""The thread boundary between the engine and Textual.

:class:`EngineWorker` runs all MLX work on its own thread and reports events through a
callback that runs on that thread. :class:`EngineBridge` owns the worker, turns each event into
an :class:`EngineEvent` Textual message (``post_message`` is thread-safe: it hands the message
to the app's event loop with ``call_soon_threadsafe``), and counts the commands in flight so
the UI knows when the engine is busy.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from textual.message import Message

from chatapp.engine.events import LoadProgress, PrefillProgress, SessionInfo, TokenEvent


# ---- events of our own (emitted on the engine thread) ---------------------------------------------
@dataclass
class ChatNotes:
    """One-line notes and errors from the conversation store (``(level, text)``, level "note" or "error")."""

    notes: list[tuple[str, str]]


@dataclass
class TranscriptLoaded:
    """A saved conversation became the session's (sessions screen or ``--resume``)."""

    conversation_id: int
    title: str
    messages: list[tuple[str, str, bool]]  # (role, content, interrupted)
    from_snapshot: bool
    line: str  # how it was resumed: from the KV snapshot, or re-prefilled and why


@dataclass
class ConversationChanged:
    """A saved conversation was renamed (``title``) or deleted (``deleted``)."""

    conversation_id: int
    title: str = ""
    deleted: bool = False
    current: bool = False  # it was the conversation on screen


@dataclass
class StartupFailed:
    """The engine could not even be imported (e.g. MLX is missing); like ``Failed`` at load."""

    message: str
    detail: str = ""


class EngineEvent(Message):
    """One engine event, delivered on the UI thread."""

    def __init__(self, event: Any) -> None:
        super().__init__()
        self.event = event


def describe_session(session) -> SessionInfo:
    """Runs on the engine thread (through the worker's ``call`` command)."""
    from chatapp.engine.memory import read_gauges

    def fields(s) -> dict[str, int]:
        return {"window": s.window, "sinks": s.sinks, "kv_bits": s.kv_bits,
                "kv_group_size": s.kv_group_size, "max_kv_tokens": s.max_kv_tokens}

    cache = session.cache_view()
    return SessionInfo(
        model_id=getattr(session, "model_id", ""),
        mode=session.mode,
        requested_mode=session.requested_mode,
        cache=cache,
        settings=fields(session.base_settings),
        effective=fields(session.settings),
        has_system=bool(session.conversation.messages and session.conversation.messages[0].role == "system"),
        messages=len(session.conversation.messages),
        fmt=session.format_choice.describe() if getattr(session, "format_choice", None) else session.format.name,
        memory=read_gauges(kv_held=cache.bytes_held, tokens=len(session.cached)),
    )


class _NotSaving(Exception):
    pass


class EngineBridge:
    """Starts the engine worker and forwards its events as :class:`EngineEvent` messages.

    ``post`` receives each event on the engine thread; it must be thread-safe (``App.post_message``
    is). ``pending`` counts submitted commands whose ``Idle`` has not come back yet; only the UI
    thread touches it.
    """

    def __init__(self, config, post: Callable[[Any], Any], *, save: bool = True, resume: int | str | None = None):
        self.config = config
        self._post = post
        self.save = save
        self.resume = resume
        self.chat = None  # the PersistentChat; created and used on the engine thread only
        self.worker = None
        self.pending = 0
        self.started_at = 0.0
        self._stopping = False
        self._lock = threading.Lock()

    # -- engine thread ---------------------------------------------------------------------------
    def _make_session(self, emit: Callable[[Any], None]):
        from chatapp.engine.setup import load_engine, session_from_config

        emit(LoadProgress("load", f"loading {self.config.model.id}"))

        def on_download(p) -> None:  # called on download threads
            name = p.filename or "model files"
            detail = f"downloading {name}: file {min(p.files_done + 1, p.files_total)} of {p.files_total}"
            emit(LoadProgress("download", detail, p.percent))

        loaded = load_engine(self.config, progress=on_download)
        emit(LoadProgress("session", "preparing the session", 100.0))
        session = session_from_config(self.config, loaded)
        self._open_chat(session, loaded)
        return session

    def _open_chat(self, session, loaded):
        """Save the conversation as it goes (docs/persistence.md); a data directory another
        chatapp holds, or one that cannot be written, leaves the chat in memory, said in a note."""
        from chatapp.store import resolve_data_dir
        from chatapp.store.chat import ModelIdentity, open_chat

        chat = open_chat(session, ModelIdentity.from_loaded(loaded, self.config.model.id),
                         resolve_data_dir(self.config), save=self.save, resume=self.resume,
                         snapshot_cap_mb=self.config.data.snapshot_cap_mb,
                         prefix_cap_mb=self.config.data.prefix_cap_mb)
        self.chat = chat
        if chat.resume_info is not None:
            self._emit_transcript(chat)
        self.emit_notes()

    def emit_notes(self, extra: list[tuple[str, str]] | None = None) -> None:
        """Engine thread: hand the store's pending notes (and ``extra``) to the UI."""
        notes = list(extra or [])
        if self.chat is not None:
            notes += [(n.level, n.text) for n in self.chat.take_notes()]
        if notes:
            self._post(EngineEvent(ChatNotes(notes)))

    def _emit_transcript(self, chat) -> None:
        info = chat.resume_info
        title = chat.store.get(info.conversation_id).title if chat.store is not None else ""
        messages = [(m.role, m.content, m.interrupted) for m in chat.session.conversation.messages]
        self._post(EngineEvent(TranscriptLoaded(info.conversation_id, title, messages, info.from_snapshot,
                                                info.line())))
        # The "snapshot not used" note is that line itself: show it once.
        notes = [(n.level, n.text) for n in chat.take_notes() if n.text != info.line()]
        if notes:
            self._post(EngineEvent(ChatNotes(notes)))

    def _on_event(self, event: Any) -> None:
        # TokenEvent / PrefillProgress carry the turn's live TurnStats, which the engine keeps
        # mutating; hand the UI a shallow copy of the numbers as they are now.
        stats = getattr(event, "stats", None)
        if stats is not None and isinstance(event, (TokenEvent, PrefillProgress)):
            event = copy.copy(event)
            event.stats = copy.copy(stats)
        self._post(EngineEvent(event))

    # -- UI thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine without blocking the UI: importing MLX and mlx-lm takes seconds, so
        a helper thread imports the engine and starts the worker while the loading screen shows."""
        self.started_at = time.perf_counter()
        threading.Thread(target=self._start_worker, name="chatapp-engine-start", daemon=True).start()

    def _start_worker(self) -> None:
        self._post(EngineEvent(LoadProgress("import", "starting the engine (importing MLX)")))
        try:
            from .chat_worker import ChatWorker
        except Exception as e:  # noqa: BLE001 - shown to the user as one line
            self._post(EngineEvent(StartupFailed(f"cannot start the engine: {e}", traceback.format_exc())))
            return
        with self._lock:
            if self._stopping:
                return
            self.worker = ChatWorker(self)
            self.worker.start()

    def submit(self, command: str, *args: Any) -> None:
        self.pending += 1
        self.worker.submit(command, *args)

    def request_info(self) -> None:
        """Ask the engine thread for a :class:`SessionInfo` (arrives as an event)."""
        self.submit("call", lambda s: self._post(EngineEvent(describe_session(s))))

    # -- saved conversations (the sessions screen); each runs on the engine thread ----------------------
    def data_dir(self):
        from chatapp.store import resolve_data_dir

        return resolve_data_dir(self.config)

    def open_conversation(self, conversation_id: int) -> None:
        """Make a saved conversation the session's, resumed from its KV snapshot when it fits."""
        def run(session) -> None:
            from chatapp.store import StoreError

            chat = self._need_chat()
            try:
                chat.resume(conversation_id)
            except StoreError as e:
                self.emit_notes([("error", f"cannot open conversation {conversation_id}: {e}")])
                return
            self._emit_transcript(chat)
        self.submit("call", run)

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        def run(session) -> None:
            chat = self._need_chat()

            def do() -> ConversationChanged:
                if not chat.saving:
                    raise _NotSaving()
                if conversation_id == chat.conversation_id:
                    chat.rename(title)
                else:
                    chat.store.rename(conversation_id, title)
                return ConversationChanged(conversation_id, chat.store.get(conversation_id).title,
                                           current=conversation_id == chat.conversation_id)
            self._store_op(f"cannot rename conversation {conversation_id}", do)
        self.submit("call", run)

    def delete_conversation(self, conversation_id: int) -> None:
        def run(session) -> None:
            chat = self._need_chat()

            def do() -> ConversationChanged:
                if not chat.saving:
                    raise _NotSaving()
                current = conversation_id == chat.conversation_id
                if current:
                    chat.new_chat()  # the session forgets it too
                chat.store.delete(conversation_id)
                return ConversationChanged(conversation_id, deleted=True, current=current)
            self._store_op(f"cannot delete conversation {conversation_id}", do)
        self.submit("call", run)

    def _need_chat(self):
        if self.chat is None:  # pragma: no cover - make_session always sets it
            raise RuntimeError("no conversation store")
        return self.chat

    def _store_op(self, what: str, fn: Callable[[], Any]) -> None:
        import sqlite3

        from chatapp.store import StoreError

        try:
            event = fn()
        except _NotSaving:
            self.emit_notes([("error", f"{what}: this chatapp is not saving conversations (another chatapp "
                                       "holds the data directory, or saving is off)")])
            return
        except (StoreError, sqlite3.Error, OSError) as e:
            self.emit_notes([("error", f"{what}: {e}")])
            return
        self._post(EngineEvent(event))
        self.emit_notes()

    def idle(self) -> None:
        self.pending = max(0, self.pending - 1)

    @property
    def busy(self) -> bool:
        return self.pending > 0

    def cancel(self) -> None:
        if self.worker is not None:
            self.worker.cancel()

    def stop(self, timeout: float = 2.0) -> None:
        with self._lock:
            self._stopping = True
            worker = self.worker
        if worker is not None:
            worker.stop()
            worker.join(timeout)
