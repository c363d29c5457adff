"""The TUI's engine worker: the engine's :class:`EngineWorker` with every turn saved.

Imported lazily by :class:`chatapp.ui.bridge.EngineBridge` (it imports MLX). Runs on the engine
thread: ``Send`` / ``Regenerate`` / ``EditLast`` / ``NewChat`` go through the bridge's
:class:`~chatapp.store.chat.PersistentChat` (each complete message committed, a cancelled reply
saved marked interrupted), the KV snapshot is saved (and a first turn's prompt kept in the
prefix store) after each turn once the engine is idle, the sessions screen's requests
(open, rename, delete a saved conversation) run against the store, and the chat is closed
(snapshot saved, store unlocked) when the worker stops.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from chatapp.engine.events import ConversationChanged, Failed, LoadProgress
from chatapp.engine.requests import (
    DeleteConversation,
    EditLast,
    NewChat,
    OpenConversation,
    Regenerate,
    RenameConversation,
    Request,
    Send,
    SetSystemPrompt,
    SwitchModel,
)
from chatapp.engine.worker import EngineWorker
from chatapp.store import StoreError
from chatapp.store.model_switch import release_old_model, switch_model
from chatapp.store.system_prompt import set_system_prompt


class _NotSaving(Exception):
    pass


class ChatWorker(EngineWorker):
    """``bridge`` provides ``make_session``, ``on_event``, ``chat``, ``emit_notes``, ``emit_transcript``
    and ``post_event``."""

    def __init__(self, bridge) -> None:
        super().__init__(bridge.make_session, bridge.on_event)
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

    def _dispatch(self, request: Request) -> None:
        chat = self.bridge.chat
        if chat is None:
            super()._dispatch(request)
            return
        match request:
            case Send() | Regenerate() | EditLast():
                result = chat.turn(request, self._emit, self._notes)
                if result.refusal:
                    self._emit(Failed(result.refusal))
            case NewChat():
                chat.new_chat()
                self.bridge.emit_notes()
                self._emit_description()
            case OpenConversation(conversation_id):
                self._open(chat, conversation_id)
            case RenameConversation(conversation_id, title):
                self._store_op(f"cannot rename conversation {conversation_id}",
                               lambda: self._rename(chat, conversation_id, title))
            case DeleteConversation(conversation_id):
                self._store_op(f"cannot delete conversation {conversation_id}",
                               lambda: self._delete(chat, conversation_id))
            case SetSystemPrompt(text):
                change = set_system_prompt(chat, self.session, text)
                change.info = self.describe()
                self._emit(change)
                self.bridge.emit_notes()
            case SwitchModel(spec):
                self._switch_model(chat, spec)
            case _:
                super()._dispatch(request)

    def _switch_model(self, chat, spec: str) -> None:
        """Load ``spec`` and move the conversation onto it; the old model stays on failure, and
        once nothing references it (the old chat lets go of its session) its memory is freed."""
        result, new_chat, config = switch_model(self.bridge.config, chat, spec,
                                                on_slow_warm_up=lambda line: self._emit(LoadProgress("kernels", line)))
        if result.ok:
            self.session = new_chat.session
            self.bridge.chat, self.bridge.config = new_chat, config
            result.info, result.config = self.describe(), config
        del chat, new_chat
        self._emit(result)
        self.bridge.emit_notes()
        if result.ok:
            self._emit(release_old_model(result.active_before))

    def _notes(self, notes) -> None:
        self.bridge.emit_notes([(n.level, n.text) for n in notes])

    # ---- saved conversations (the sessions screen) --------------------------------------------------
    def _open(self, chat, conversation_id: int) -> None:
        """Make a saved conversation the session's, resumed from its KV snapshot when it fits."""
        try:
            chat.resume(conversation_id)
        except StoreError as e:
            self.bridge.emit_notes([("error", f"cannot open conversation {conversation_id}: {e}")])
            return
        self.bridge.emit_transcript(chat, self.describe())

    @staticmethod
    def _rename(chat, conversation_id: int, title: str) -> ConversationChanged:
        if not chat.saving:
            raise _NotSaving()
        if conversation_id == chat.conversation_id:
            chat.rename(title)
        else:
            chat.store.rename(conversation_id, title)
        return ConversationChanged(conversation_id, chat.store.get(conversation_id).title,
                                   current=conversation_id == chat.conversation_id)

    @staticmethod
    def _delete(chat, conversation_id: int) -> ConversationChanged:
        if not chat.saving:
            raise _NotSaving()
        current = conversation_id == chat.conversation_id
        if current:
            chat.new_chat()  # the session forgets it too
        chat.store.delete(conversation_id)
        return ConversationChanged(conversation_id, deleted=True, current=current,
                                   info=chat.session.describe() if current else None)

    def _store_op(self, what: str, fn: Callable[[], ConversationChanged]) -> None:
        try:
            event = fn()
        except _NotSaving:
            self.bridge.emit_notes([("error", f"{what}: this chatapp is not saving conversations (another "
                                              "chatapp holds the data directory, or saving is off)")])
            return
        except (StoreError, sqlite3.Error, OSError) as e:
            self.bridge.emit_notes([("error", f"{what}: {e}")])
            return
        self._emit(event)
        self.bridge.emit_notes()
