"""The engine thread: owns the model, the session and all MLX work; talks by events.

MLX streams belong to threads (mlx-lm issue 1181 shows a crash on GPU backends otherwise), so
loading, prefill, decode and cache conversion all run on this one thread. Callers submit
commands; results come back through ``on_event`` (the TUI turns them into Textual messages).
``cancel()`` is safe to call from any thread.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Any, Callable

from .events import CompareResult, Failed, Idle, Loaded, Switched
from .session import Session, compare_modes


class EngineWorker:
    def __init__(self, make_session: Callable[[Callable[[Any], None]], Session], on_event: Callable[[Any], None]):
        """``make_session(emit)`` loads the model (reporting progress through ``emit``) and
        returns a Session; it runs on the worker thread."""
        self._make_session = make_session
        self._emit = on_event
        self._queue: queue.Queue = queue.Queue()
        self.session: Session | None = None
        self._thread = threading.Thread(target=self._run, name="chatapp-engine", daemon=True)
        self.busy = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: str, *args: Any) -> None:
        self._queue.put((command, args))

    def cancel(self) -> None:
        if self.session is not None:
            self.session.cancel()

    def stop(self) -> None:
        self.cancel()
        self._queue.put(("quit", ()))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.session = self._make_session(self._emit)
        except Exception as e:  # noqa: BLE001 - reported to the user as one line
            self._emit(Failed(str(e).splitlines()[0] if str(e) else type(e).__name__, traceback.format_exc()))
            return
        s = self.session
        choice = getattr(s, "format_choice", None)
        notes = ([choice.line()] if choice is not None else []) + list(s.notices)
        self._emit(Loaded(getattr(s, "model_id", ""), notes))
        del s  # the session lives in self.session only: a model switch replaces it and frees the old one
        while True:
            command, args = self._queue.get()
            if command == "quit":
                return
            self.busy.set()
            try:
                self._dispatch(command, args)
            except Exception as e:  # noqa: BLE001
                self._emit(Failed(f"{command} failed: {e}", traceback.format_exc()))
            finally:
                self.busy.clear()
                self._emit(Idle())

    def _dispatch(self, command: str, args: tuple) -> None:
        s = self.session
        if command in ("send", "regenerate", "edit_last", "reply"):
            events = getattr(s, command)(*args)
            for ev in events:
                self._emit(ev)
        elif command == "switch_mode":
            mode, changes = args
            self._emit(Switched(s.switch_mode(mode, **changes)))
        elif command == "compare":
            modes, max_tokens = args
            # One row per mode, sent as each finishes; a cancel ends the comparison early.
            for n, row in enumerate(compare_modes(s, modes, max_tokens=max_tokens)):
                self._emit(CompareResult(row, done=n == len(modes) - 1))
        elif command == "new_chat":
            s.new_chat()
        elif command == "call":  # run an arbitrary function on the engine thread (tests, tools)
            fn, = args
            fn(s)
        else:
            raise ValueError(f"unknown command {command!r}")
