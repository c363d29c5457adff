"""What the engine tells the TUI: one Textual :class:`Message` per event kind.

The engine thread's events (:mod:`chatapp.engine.events`) and the bridge's own (below: store
notes, a transcript resumed, a conversation renamed or deleted, an engine that cannot start)
are wrapped by :func:`message_for` into the message of their kind, and posted to the app
(``post_message`` is thread-safe). The app handles each kind with its own ``@on`` handler.
Each message has a stable ``kind`` (the event's name: "TokenEvent", "TurnDone", ...), which
the app records in ``event_log``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from textual.message import Message

from chatapp.engine.events import (
    CompareResult,
    Failed,
    Idle,
    Loaded,
    LoadProgress,
    PrefillProgress,
    SessionInfo,
    Switched,
    TokenEvent,
    TurnDone,
)
from chatapp.store.model_switch import ModelReleased, ModelSwitch
from chatapp.store.system_prompt import SystemChange


# ---- events of the bridge's own (emitted on the engine thread) ------------------------------------
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


# ---- the messages -------------------------------------------------------------------------------------
class EngineMessage(Message):
    """One engine event, delivered on the UI thread; ``event`` is the dataclass."""

    kind: ClassVar[str] = ""

    def __init__(self, event: Any) -> None:
        super().__init__()
        self.event = event


class LoadingMessage(EngineMessage):
    kind = "LoadProgress"
    event: LoadProgress


class LoadedMessage(EngineMessage):
    kind = "Loaded"
    event: Loaded


class InfoMessage(EngineMessage):
    kind = "SessionInfo"
    event: SessionInfo


class PrefillMessage(EngineMessage):
    kind = "PrefillProgress"
    event: PrefillProgress


class TokenMessage(EngineMessage):
    kind = "TokenEvent"
    event: TokenEvent


class TurnDoneMessage(EngineMessage):
    kind = "TurnDone"
    event: TurnDone


class IdleMessage(EngineMessage):
    kind = "Idle"
    event: Idle


class SwitchedMessage(EngineMessage):
    kind = "Switched"
    event: Switched


class CompareMessage(EngineMessage):
    kind = "CompareResult"
    event: CompareResult


class FailedMessage(EngineMessage):
    kind = "Failed"
    event: Failed


class StartupFailedMessage(EngineMessage):
    kind = "StartupFailed"
    event: StartupFailed


class NotesMessage(EngineMessage):
    kind = "ChatNotes"
    event: ChatNotes


class TranscriptMessage(EngineMessage):
    kind = "TranscriptLoaded"
    event: TranscriptLoaded


class ConversationMessage(EngineMessage):
    kind = "ConversationChanged"
    event: ConversationChanged


class SystemPromptMessage(EngineMessage):
    kind = "SystemChange"
    event: SystemChange


class ModelSwitchMessage(EngineMessage):
    kind = "ModelSwitch"
    event: ModelSwitch


class ModelReleasedMessage(EngineMessage):
    kind = "ModelReleased"
    event: ModelReleased


MESSAGES: dict[type, type[EngineMessage]] = {
    LoadProgress: LoadingMessage, Loaded: LoadedMessage, SessionInfo: InfoMessage,
    PrefillProgress: PrefillMessage, TokenEvent: TokenMessage, TurnDone: TurnDoneMessage, Idle: IdleMessage,
    Switched: SwitchedMessage, CompareResult: CompareMessage, Failed: FailedMessage,
    StartupFailed: StartupFailedMessage, ChatNotes: NotesMessage, TranscriptLoaded: TranscriptMessage,
    ConversationChanged: ConversationMessage, SystemChange: SystemPromptMessage, ModelSwitch: ModelSwitchMessage,
    ModelReleased: ModelReleasedMessage,
}


def message_for(event: Any) -> EngineMessage:
    """The message of ``event``'s kind (a KeyError names an event kind nobody handles)."""
    return MESSAGES[type(event)](event)
