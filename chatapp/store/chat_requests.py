"""The saved conversation's requests on the engine thread: a part the engine worker holds, not a
worker of its own.

The TUI's engine thread runs one :class:`~chatapp.engine.worker.EngineWorker` with one
dispatcher. :class:`ChatRequests` loads the session and opens its
:class:`~chatapp.store.chat.PersistentChat` (:meth:`make_session`), then takes the request kinds
that touch the store (:meth:`attach` registers them with the worker): ``Send`` / ``Regenerate`` /
``EditLast`` go through the chat's turn driver (each complete message committed, a cancelled
reply saved marked interrupted, the KV snapshot and the prefix store after each turn), ``NewChat``
keeps the old conversation, the sessions screen's requests (open, rename, delete a saved
conversation) run against the store, and the system prompt and the model switch go through
``store/system_prompt.py`` and ``store/model_switch.py``. When the worker stops, the chat is
closed (snapshot saved, store unlocked).

Everything it tells a front end is an event of :mod:`chatapp.engine.events` handed to ``emit``
(the store's notes as ``ChatNotes``, a resumed conversation as ``TranscriptLoaded``): it knows
nothing of Textual, so it sits in ``store/`` (engine <- store <- UI, tests/test_lint.py).
Imported lazily: it imports MLX through the engine.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Callable

from chatapp.engine.events import ChatNotes, ConversationChanged, Failed, LoadProgress, TranscriptLoaded
from chatapp.engine.requests import (
    DeleteConversation,
    EditLast,
    NewChat,
    OpenConversation,
    Regenerate,
    RenameConversation,
    Send,
    SetSystemPrompt,
    SwitchModel,
)
from chatapp.engine.worker import EngineWorker

from . import StoreError, resolve_data_dir
from .model_switch import release_old_model, switch_model
from .system_prompt import set_system_prompt

Emit = Callable[[Any], None]


class _NotSaving(Exception):
    pass


class ChatRequests:
    """The store's side of the engine thread; ``chat`` is created and used on that thread only."""

    def __init__(self, config, emit: Emit, *, save: bool = True, resume: int | str | None = None) -> None:
        self.config = config
        self._emit = emit
        self.save = save
        self.resume = resume
        self.chat = None  # the PersistentChat, once the session is loaded
        self.worker: EngineWorker | None = None

    def attach(self, worker: EngineWorker) -> None:
        """Give ``worker`` this part's request kinds (its one dispatcher looks them up) and the close."""
        self.worker = worker
        for kind in (Send, Regenerate, EditLast):
            worker.handle(kind, self._turn)
        worker.handle(NewChat, self._new_chat)
        worker.handle(OpenConversation, self._open)
        worker.handle(RenameConversation, self._rename)
        worker.handle(DeleteConversation, self._delete)
        worker.handle(SetSystemPrompt, self._system_prompt)
        worker.handle(SwitchModel, self._switch_model)
        worker.on_stop(self.close)

    # ---- loading --------------------------------------------------------------------------------------
    def make_session(self, emit: Emit, cancel):
        """Engine thread: load the model (reporting progress through ``emit``), then open the chat;
        the session is built on ``cancel``, the worker's cancel flag."""
        from chatapp.engine.setup import load_engine, session_from_config

        emit(LoadProgress("load", f"loading {self.config.model.id}"))

        def on_download(p) -> None:  # called on download threads
            name = p.filename or "model files"
            detail = f"downloading {name}: file {min(p.files_done + 1, p.files_total)} of {p.files_total}"
            emit(LoadProgress("download", detail, p.percent))

        loaded = load_engine(self.config, progress=on_download,
                             on_slow_warm_up=lambda line: emit(LoadProgress("kernels", line)))
        emit(LoadProgress("session", "preparing the session", 100.0))
        session = session_from_config(self.config, loaded, cancel=cancel)
        self._open_chat(session, loaded)
        return session

    def _open_chat(self, session, loaded) -> None:
        """Save the conversation as it goes (docs/persistence.md); a data directory another
        chatapp holds, or one that cannot be written, leaves the chat in memory, said in a note."""
        from .chat import ModelIdentity, open_chat

        chat = open_chat(session, ModelIdentity.from_loaded(loaded, self.config.model.id),
                         resolve_data_dir(self.config), save=self.save, resume=self.resume,
                         snapshot_cap_mb=self.config.data.snapshot_cap_mb,
                         prefix_cap_mb=self.config.data.prefix_cap_mb)
        self.chat = chat
        if chat.resume_info is not None:
            self._emit_transcript()  # shown once loaded; ``Loaded`` describes the session
        self.emit_notes()

    def close(self) -> None:
        """The worker stopped: a reply still streaming is kept as interrupted; the snapshot is saved."""
        if self.chat is not None:
            try:
                self.chat.close()
            finally:
                self.emit_notes()

    # ---- what goes to the front end ---------------------------------------------------------------------
    def emit_notes(self, extra: list[tuple[str, str]] | None = None) -> None:
        """The store's pending notes (and ``extra``), as one ``ChatNotes``."""
        notes = list(extra or [])
        if self.chat is not None:
            notes += [(n.level, n.text) for n in self.chat.take_notes()]
        if notes:
            self._emit(ChatNotes(notes))

    def _emit_transcript(self, session_info=None) -> None:
        """The conversation the chat resumed, with ``session_info`` (the session with it)."""
        chat = self.chat
        info = chat.resume_info
        title = chat.store.get(info.conversation_id).title if chat.store is not None else ""
        messages = [(m.role, m.content, m.interrupted) for m in chat.session.conversation.messages]
        self._emit(TranscriptLoaded(info.conversation_id, title, messages, info.from_snapshot, info.line(),
                                    session_info))
        # The "snapshot not used" note is that line itself: show it once.
        notes = [(n.level, n.text) for n in chat.take_notes() if n.text != info.line()]
        if notes:
            self._emit(ChatNotes(notes))

    def _describe(self):
        return self.worker.describe() if self.worker is not None else None

    # ---- the request kinds ------------------------------------------------------------------------------
    def _turn(self, request: Send | Regenerate | EditLast) -> None:
        result = self.chat.turn(request, self._emit, self._notes)
        if result.refusal:
            self._emit(Failed(result.refusal))

    def _notes(self, notes) -> None:
        self.emit_notes([(n.level, n.text) for n in notes])

    def _new_chat(self, _request: NewChat) -> None:
        self.chat.new_chat()
        self.emit_notes()
        info = self._describe()
        if info is not None:
            self._emit(info)

    def _system_prompt(self, request: SetSystemPrompt) -> None:
        change = set_system_prompt(self.chat, self.worker.session, request.text)
        change.info = self._describe()
        self._emit(change)
        self.emit_notes()

    def _switch_model(self, request: SwitchModel) -> None:
        """Load the model and move the conversation onto it; the old model stays on failure, and
        once nothing references it (the old chat lets go of its session) its memory is freed. The
        new session, built on the worker's cancel flag, goes to the worker (``EngineWorker.adopt``:
        the worker owns the session it serves; this part owns the chat and the config)."""
        chat = self.chat
        result, new_chat, config = switch_model(
            self.config, chat, request.spec,
            on_slow_warm_up=lambda line: self._emit(LoadProgress("kernels", line)), cancel=self.worker.cancel_token)
        if result.ok:
            self.worker.adopt(new_chat.session)
            self.chat, self.config = new_chat, config
            result.info, result.config = self._describe(), config
        del chat, new_chat
        self._emit(result)
        self.emit_notes()
        if result.ok:
            self._emit(release_old_model(result.active_before))

    # ---- saved conversations (the sessions screen) ---------------------------------------------------
    def _open(self, request: OpenConversation) -> None:
        """Make a saved conversation the session's, resumed from its KV snapshot when it fits."""
        try:
            self.chat.resume(request.conversation_id)
        except StoreError as e:
            self.emit_notes([("error", f"cannot open conversation {request.conversation_id}: {e}")])
            return
        self._emit_transcript(self._describe())

    def _rename(self, request: RenameConversation) -> None:
        cid, title = request.conversation_id, request.title
        self._store_op(f"cannot rename conversation {cid}", lambda: _renamed(self.chat, cid, title))

    def _delete(self, request: DeleteConversation) -> None:
        cid = request.conversation_id
        self._store_op(f"cannot delete conversation {cid}", lambda: _deleted(self.chat, cid))

    def _store_op(self, what: str, fn: Callable[[], ConversationChanged]) -> None:
        try:
            event = fn()
        except _NotSaving:
            self.emit_notes([("error", f"{what}: this chatapp is not saving conversations (another "
                                       "chatapp holds the data directory, or saving is off)")])
            return
        except (StoreError, sqlite3.Error, OSError) as e:
            self.emit_notes([("error", f"{what}: {e}")])
            return
        self._emit(event)
        self.emit_notes()


def _renamed(chat, conversation_id: int, title: str) -> ConversationChanged:
    if not chat.saving:
        raise _NotSaving()
    if conversation_id == chat.conversation_id:
        chat.rename(title)
    else:
        chat.store.rename(conversation_id, title)
    return ConversationChanged(conversation_id, chat.store.get(conversation_id).title,
                               current=conversation_id == chat.conversation_id)


def _deleted(chat, conversation_id: int) -> ConversationChanged:
    if not chat.saving:
        raise _NotSaving()
    current = conversation_id == chat.conversation_id
    if current:
        chat.new_chat()  # the session forgets it too
    chat.store.delete(conversation_id)
    return ConversationChanged(conversation_id, deleted=True, current=current,
                               info=chat.session.describe() if current else None)


__all__ = ["ChatRequests"]
