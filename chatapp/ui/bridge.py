"""The thread boundary between the engine and Textual.

:class:`EngineWorker` runs all MLX work on its own thread and reports events through a
callback that runs on that thread. :class:`EngineBridge` owns the worker, turns each event into
the Textual message of its kind (:func:`chatapp.ui.messages.message_for`; ``post_message`` is
thread-safe: it hands the message to the app's event loop with ``call_soon_threadsafe``), and
keeps the requests in flight, oldest first: the one busy state of the UI.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable

from chatapp.engine.events import ChatNotes, LoadProgress, PrefillProgress, StartupFailed, TokenEvent, TranscriptLoaded
from chatapp.engine.requests import (
    DeleteConversation,
    OpenConversation,
    RenameConversation,
    Request,
)

from .messages import message_for


class EngineBridge:
    """Starts the engine worker and forwards its events as Textual messages (``ui.messages``).

    ``post`` receives each message on the engine thread; it must be thread-safe (``App.post_message``
    is). ``in_flight`` holds the submitted requests whose ``Idle`` has not come back yet, oldest
    first; only the UI thread touches it, and ``busy`` is whether it holds any.
    """

    def __init__(self, config, post: Callable[[Any], Any], *, save: bool = True, resume: int | str | None = None):
        self.config = config
        self._post = post
        self.save = save
        self.resume = resume
        self.chat = None  # the PersistentChat; created and used on the engine thread only
        self.worker = None
        self.in_flight: deque[Request] = deque()
        self.started_at = 0.0
        self._stopping = False
        self._lock = threading.Lock()

    # -- engine thread ---------------------------------------------------------------------------
    def make_session(self, emit: Callable[[Any], None]):
        from chatapp.engine.setup import load_engine, session_from_config

        emit(LoadProgress("load", f"loading {self.config.model.id}"))

        def on_download(p) -> None:  # called on download threads
            name = p.filename or "model files"
            detail = f"downloading {name}: file {min(p.files_done + 1, p.files_total)} of {p.files_total}"
            emit(LoadProgress("download", detail, p.percent))

        loaded = load_engine(self.config, progress=on_download,
                             on_slow_warm_up=lambda line: emit(LoadProgress("kernels", line)))
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
            self.emit_transcript(chat)  # shown once loaded; ``Loaded`` describes the session
        self.emit_notes()

    def emit_notes(self, extra: list[tuple[str, str]] | None = None) -> None:
        """Engine thread: hand the store's pending notes (and ``extra``) to the UI."""
        notes = list(extra or [])
        if self.chat is not None:
            notes += [(n.level, n.text) for n in self.chat.take_notes()]
        if notes:
            self._post(message_for(ChatNotes(notes)))

    def emit_transcript(self, chat, session_info=None) -> None:
        """Engine thread: the conversation ``chat`` resumed, with ``session_info`` (the session with it)."""
        info = chat.resume_info
        title = chat.store.get(info.conversation_id).title if chat.store is not None else ""
        messages = [(m.role, m.content, m.interrupted) for m in chat.session.conversation.messages]
        self._post(message_for(TranscriptLoaded(info.conversation_id, title, messages, info.from_snapshot,
                                                info.line(), session_info)))
        # The "snapshot not used" note is that line itself: show it once.
        notes = [(n.level, n.text) for n in chat.take_notes() if n.text != info.line()]
        if notes:
            self._post(message_for(ChatNotes(notes)))

    def on_event(self, event: Any) -> None:
        # TokenEvent / PrefillProgress carry the turn's live TurnStats, which the engine keeps
        # mutating; hand the UI a shallow copy of the numbers as they are now.
        stats = getattr(event, "stats", None)
        if stats is not None and isinstance(event, (TokenEvent, PrefillProgress)):
            event = copy.copy(event)
            event.stats = copy.copy(stats)
        self._post(message_for(event))

    # -- UI thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine without blocking the UI: importing MLX and mlx-lm takes seconds, so
        a helper thread imports the engine and starts the worker while the loading screen shows."""
        self.started_at = time.perf_counter()
        threading.Thread(target=self._start_worker, name="chatapp-engine-start", daemon=True).start()

    def _start_worker(self) -> None:
        self._post(message_for(LoadProgress("import", "starting the engine (importing MLX)")))
        try:
            from .chat_worker import ChatWorker
        except Exception as e:  # noqa: BLE001 - shown to the user as one line
            self._post(message_for(StartupFailed(f"cannot start the engine: {e}", traceback.format_exc())))
            return
        with self._lock:
            if self._stopping:
                return
            self.worker = ChatWorker(self)
            self.worker.start()

    def submit(self, request: Request) -> None:
        self.in_flight.append(request)
        self.worker.submit(request)

    # -- saved conversations (the sessions screen); each runs on the engine thread (ChatWorker) ----------
    def data_dir(self):
        from chatapp.store import resolve_data_dir

        return resolve_data_dir(self.config)

    def open_conversation(self, conversation_id: int) -> None:
        """Make a saved conversation the session's, resumed from its KV snapshot when it fits."""
        self.submit(OpenConversation(conversation_id))

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.submit(RenameConversation(conversation_id, title))

    def delete_conversation(self, conversation_id: int) -> None:
        self.submit(DeleteConversation(conversation_id))

    def idle(self) -> Request | None:
        """An ``Idle`` came back: the oldest request in flight is done; returns it."""
        return self.in_flight.popleft() if self.in_flight else None

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

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
