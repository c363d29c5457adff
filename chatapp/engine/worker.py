"""The engine thread: owns the model, the session and all MLX work; talks by events.

MLX streams belong to threads (mlx-lm issue 1181 shows a crash on GPU backends otherwise), so
loading, prefill, decode and cache conversion all run on this one thread. Callers submit typed
requests (:mod:`chatapp.engine.requests`); results come back through ``on_event`` as the
dataclasses of :mod:`chatapp.engine.events` (the TUI turns them into Textual messages); an event
that reports a change of the session carries the session's description after it, so a front end
never asks again.
The worker owns the cancel flag of the sessions it serves (``cancel_token``; ``make_session``
builds the session on it, and a model switch's new session too): ``cancel()``, safe from any
thread, sets it, and each request starts by clearing it, so a cancel meant for the request before
(Esc reaching a reply as it ended, an F3 switch queued behind it) stops nothing after it.
The worker owns the session it serves too (``session``, read-only): ``make_session`` gives it the
first, and a part that replaces it (the store's model switch) hands the new one to
:meth:`EngineWorker.adopt`, which takes only a session built on the worker's cancel flag.

One dispatcher (``_dispatch``) serves every request kind on this thread: a layer above may take a
kind with :meth:`EngineWorker.handle` (the store's saved turns and conversations,
``store/chat_requests.py``) and be told when the thread ends with :meth:`EngineWorker.on_stop`;
the worker holds those parts rather than being subclassed by them, so the engine imports nothing
from above.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Any, Callable

from .compare import compare_modes
from .events import CompareResult, Failed, Idle, Loaded, SessionInfo, TokenEvent, TurnDone
from .requests import Compare, Describe, EditLast, NewChat, Quit, Regenerate, Request, Send, SwitchMode
from .session import Session


class EngineWorker:
    def __init__(self, make_session: Callable[[Callable[[Any], None], threading.Event], Session],
                 on_event: Callable[[Any], None]):
        """``make_session(emit, cancel)`` loads the model (reporting progress through ``emit``) and
        returns a Session built on the cancel flag ``cancel``; it runs on the worker thread."""
        self._make_session = make_session
        self._emit = on_event
        self.cancel_token = threading.Event()  # stops the running request; cleared as each begins
        self._queue: queue.Queue[Request] = queue.Queue()
        self._session: Session | None = None  # the session served (``session``; ``adopt`` replaces it)
        self._handlers: dict[type, Callable[[Any], None]] = {}  # request kinds a layer above takes
        self._stop_hooks: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="chatapp-engine", daemon=True)

    def handle(self, kind: type, handler: Callable[[Any], None]) -> None:
        """Before ``start``: requests of ``kind`` go to ``handler`` (on this thread) instead of the
        engine's own handling; it may emit events and hand the worker a new session (a model
        switch: :meth:`adopt`)."""
        self._handlers[kind] = handler

    @property
    def session(self) -> Session | None:
        """The session this worker serves (None until loaded); replaced only through :meth:`adopt`."""
        return self._session

    def adopt(self, session: Session) -> None:
        """Engine thread (a handler's request): ``session`` replaces the one served, as a model
        switch's new session does. It must be built on ``cancel_token``, the flag ``cancel`` sets
        and each request clears; a session on another flag could not be stopped (ValueError)."""
        if getattr(session, "cancel_token", None) is not self.cancel_token:
            raise ValueError("the engine worker serves only sessions built on its cancel flag (cancel_token)")
        self._session = session

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Before ``start``: ``hook`` runs on this thread as it ends (a failed load included)."""
        self._stop_hooks.append(hook)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._queue.put(request)

    def cancel(self) -> None:
        """Stop the running request between two steps (any thread)."""
        self.cancel_token.set()

    def stop(self) -> None:
        self.cancel()
        self._queue.put(Quit())

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            for hook in self._stop_hooks:
                hook()

    def _serve(self) -> None:
        try:
            self._session = self._make_session(self._emit, self.cancel_token)
        except Exception as e:  # noqa: BLE001 - reported to the user as one line
            self._emit(Failed(str(e).splitlines()[0] if str(e) else type(e).__name__, traceback.format_exc()))
            return
        self._emit(Loaded(self.session.model_id, self.session.load_lines(), self.describe()))
        while True:
            request = self._queue.get()
            if isinstance(request, Quit):
                return
            try:
                self.cancel_token.clear()  # a cancel meant for the request before is forgotten
                self._dispatch(request)
            except Exception as e:  # noqa: BLE001
                self._emit(Failed(f"{request.kind} failed: {e}", traceback.format_exc(), self.describe()))
            finally:
                self._emit(Idle())

    def _dispatch(self, request: Request) -> None:
        handler = self._handlers.get(type(request))
        if handler is not None:
            handler(request)
            return
        s = self.session
        match request:
            case Send(text):
                self._stream(s.send(text))
            case Regenerate():
                self._stream(s.regenerate())
            case EditLast(text):
                self._stream(s.edit_last(text))
            case SwitchMode(mode, changes):
                # The switch within this request (``_serve`` cleared the cancel flag as it began);
                # its report is the event, sent with the session it produced: the front end asks
                # nothing more.
                switched = s.switch(mode, **changes)
                try:
                    switched.info = s.describe()
                except Exception as e:  # noqa: BLE001 - the switch happened; only its description failed
                    self._emit(switched)
                    self._emit(Failed(f"cache mode {switched.mode}: switched, but the session could not "
                                      f"describe itself: {e}", traceback.format_exc()))
                    return
                self._emit(switched)
            case Compare(modes, max_tokens):
                # One row per mode, sent as each finishes; a cancel ends the comparison early.
                for n, row in enumerate(compare_modes(s, list(modes), max_tokens=max_tokens)):
                    self._emit(CompareResult(row, done=n == len(modes) - 1))
            case NewChat():
                s.new_chat()
                self._emit_description()
            case Describe():
                self._emit(s.describe())
            case _:
                raise ValueError(f"the engine does not handle {request.kind!r} requests")

    def describe(self) -> SessionInfo | None:
        """Engine thread: the session's description for an event that changed it; None when there is
        no session yet or it cannot describe itself (the failure is the event's own story)."""
        try:
            return self.session.describe() if self.session is not None else None
        except Exception:  # noqa: BLE001 - an event must not fail for want of its description
            return None

    def _emit_description(self) -> None:
        info = self.describe()
        if info is not None:
            self._emit(info)

    def _stream(self, events) -> None:
        """The worker's own turns (no part above took them), ended as the store's turn driver
        (``PersistentChat.turn``) ends them: a reply that raises part-way still ends with a TurnDone
        marked failed (what was shown, which the conversation keeps as interrupted), then the
        exception goes on to ``_serve``'s Failed."""
        seq = len(self.session.conversation.messages)  # where the reply goes (the user's message is in)
        done, shown, stats = False, "", None
        try:
            for ev in events:
                done = done or isinstance(ev, TurnDone)
                if isinstance(ev, TokenEvent):
                    shown += ev.text
                stats = getattr(ev, "stats", stats)
                self._emit(ev)
        except Exception as e:
            if not done:
                self.session.keep_interrupted(shown, seq)
                self._emit(TurnDone.failed(e, shown, stats))
            raise
