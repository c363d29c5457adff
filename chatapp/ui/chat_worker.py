"""The TUI's engine worker: the engine's :class:`EngineWorker` with every turn saved.

Imported lazily by :class:`chatapp.ui.bridge.EngineBridge` (it imports MLX). Runs on the engine
thread: ``send`` / ``regenerate`` / ``edit_last`` / ``new_chat`` go through the bridge's
:class:`~chatapp.store.chat.PersistentChat` (each complete message committed, a cancelled reply
saved marked interrupted), the KV snapshot is saved (and a first turn's prompt kept in the
prefix store) after each turn once the engine is idle,
and the chat is closed (snapshot saved, store unlocked) when the worker stops.
"""

from __future__ import annotations

from chatapp.engine.events import Failed
from chatapp.engine.worker import EngineWorker


class ChatWorker(EngineWorker):
    """``bridge`` provides ``_make_session``, ``_on_event``, ``chat`` and ``emit_notes``."""

    def __init__(self, bridge) -> None:
        super().__init__(bridge._make_session, bridge._on_event)
        self.bridge = bridge

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            chat = self.bridge.chat
            if chat is not None:
                try:
                    chat.close()  # a reply still streaming is kept as interrupted; the snapshot is saved
                finally:
                    self.bridge.emit_notes()

    def _dispatch(self, command: str, args: tuple) -> None:
        chat = self.bridge.chat
        if chat is None:
            super()._dispatch(command, args)
            return
        if command in ("send", "regenerate", "edit_last"):
            if command == "send":
                prepared = chat.prepare(args[0])
                if prepared.notes:
                    self.bridge.emit_notes([("note", n) for n in prepared.notes])
                if not prepared.send:
                    self._emit(Failed(prepared.refusal or "an empty message is not sent"))
                    return
                args = (prepared.text,)
            try:
                for ev in getattr(chat, command)(*args):
                    self._emit(ev)
            finally:
                self.bridge.emit_notes()
            chat.after_turn()  # the turn is over, the caches idle: the snapshot, then the prefix store
            self.bridge.emit_notes()
        elif command == "new_chat":
            chat.new_chat()
            self.bridge.emit_notes()
        else:
            super()._dispatch(command, args)
