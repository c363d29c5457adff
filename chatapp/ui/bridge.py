"""The thread boundary between the engine and Textual.

:class:`EngineWorker` runs all MLX work on its own thread and reports events through a
callback that runs on that thread; the store's part of that thread
(:class:`~chatapp.store.chat_requests.ChatRequests`: the saved chat, its turns and conversations)
is held by the worker and reports through the same callback. :class:`EngineBridge` starts and
stops the worker and turns each event into the Textual message of its kind
(:data:`chatapp.ui.messages.MESSAGES`; ``post_message`` is thread-safe: it hands the message
to the app's event loop with ``call_soon_threadsafe``). Requests go to ``worker.submit`` from the
engine client (ui/engine_link.py), which keeps the requests in flight: the one busy state of the UI.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from typing import Any, Callable

from chatapp.engine.events import LoadProgress, PrefillProgress, StartupFailed, TokenEvent

from .messages import MESSAGES, BatchMessage


class EngineBridge:
    """Starts the engine worker and forwards its events as Textual messages (``ui.messages``).

    ``post`` receives each message on the engine thread; it must be thread-safe (``App.post_message``
    is). ``worker`` is the engine worker once started (``worker.submit`` takes the requests).
    """

    def __init__(self, config, post: Callable[[Any], Any], *, save: bool = True, resume: int | str | None = None):
        self.config = config
        self._post = post
        self.save = save
        self.resume = resume
        self.requests = None  # the store's part of the engine thread (store/chat_requests.py), once started
        self.worker = None
        self.started_at = 0.0
        self._stopping = False
        self._lock = threading.Lock()
        self._batch: BatchMessage | None = None  # the last message posted, when later events may join it

    # -- engine thread ---------------------------------------------------------------------------
    def make_session(self, emit: Callable[[Any], None], cancel):
        """Load the model and open the saved chat, the session on the worker's cancel flag (the
        worker's loader; tests hold it to time a load)."""
        return self.requests.make_session(emit, cancel)

    @property
    def chat(self):
        """The engine thread's PersistentChat, for tests that read it once the engine is idle; the UI
        never does (what it shows comes in the events)."""
        return self.requests.chat if self.requests is not None else None

    def on_event(self, event: Any) -> None:
        # TokenEvent / PrefillProgress carry the turn's live TurnStats, which the engine keeps
        # mutating; hand the UI a shallow copy of the numbers as they are now.
        stats = getattr(event, "stats", None)
        if stats is not None and isinstance(event, (TokenEvent, PrefillProgress)):
            event = copy.copy(event)
            event.stats = copy.copy(stats)
        # A token (a prefill's progress) joins the message of the ones before it while that one
        # waits in the app's queue: one message per frame's burst, not per event (ui/messages.py's
        # BatchMessage); any other event closes the batch, so nothing joins across it.
        if self._batch is not None and self._batch.merge(event):
            return
        message = MESSAGES[type(event)](event)  # a KeyError: an event kind nobody handles
        self._batch = message if isinstance(message, BatchMessage) else None
        self._post(message)

    # -- UI thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine without blocking the UI: importing MLX and mlx-lm takes seconds, so
        a helper thread imports the engine and starts the worker while the loading screen shows."""
        self.started_at = time.perf_counter()
        threading.Thread(target=self._start_worker, name="chatapp-engine-start", daemon=True).start()

    def _start_worker(self) -> None:
        self.on_event(LoadProgress("import", "starting the engine (importing MLX)"))
        try:
            from chatapp.engine.worker import EngineWorker
            from chatapp.store.chat_requests import ChatRequests
        except Exception as e:  # noqa: BLE001 - shown to the user as one line
            self.on_event(StartupFailed(f"cannot start the engine: {e}", traceback.format_exc()))
            return
        with self._lock:
            if self._stopping:
                return
            # One worker, one dispatcher; the store's part takes the request kinds that touch the chat.
            self.requests = ChatRequests(self.config, self.on_event, save=self.save, resume=self.resume)
            self.worker = EngineWorker(self.make_session, self.on_event)
            self.requests.attach(self.worker)
            self.worker.start()

    def data_dir(self):
        from chatapp.store import resolve_data_dir

        return resolve_data_dir(self.config)

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
