"""What the engine tells the TUI: one Textual :class:`Message` per event kind.

Every event that crosses the engine thread (:mod:`chatapp.engine.events`, their one home: the
engine's, the store's and the bridge's own) is wrapped into the message of its kind
(``MESSAGES[type(event)](event)``, in ``EngineBridge.on_event``; a KeyError names an event kind
nobody handles) and posted to the app (``post_message`` is thread-safe). The app's one
``@on(EngineMessage)`` dispatcher hands each to its kind's handler (``ui/engine_link.HANDLERS``).
Each message has a stable ``kind`` (the event's name: "TokenEvent", "TurnDone", ...), which the
engine client (``app.engine``) records in ``event_log``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from textual.message import Message

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
