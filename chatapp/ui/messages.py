"""What the engine tells the TUI: one Textual :class:`Message` per event kind.

Every event that crosses the engine thread (:mod:`chatapp.engine.events`, their one home: the
engine's, the store's and the bridge's own) is wrapped into the message of its kind
(``MESSAGES[type(event)](event)``, in ``EngineBridge.on_event``; a KeyError names an event kind
nobody handles) and posted to the app (``post_message`` is thread-safe). The app's one
``@on(EngineMessage)`` dispatcher hands each to its kind's handler (``ui/engine_link.HANDLERS``).
Each message has a stable ``kind`` (the event's name: "TokenEvent", "TurnDone", ...), which the
engine client (``app.engine``) records in ``event_log``.

Streamed tokens and prefill progress are batched, by one rule (:class:`BatchMessage`): an event
that arrives while the message of the events of its kind before it still waits in the app's queue
joins that message (:meth:`BatchMessage.merge`) instead of posting its own, and any other event
closes the batch. The kind says how an event joins: a token's text is appended to the batch's
(:class:`TokenMessage`: the text in order, the newest token and statistics), a newer prefill
progress replaces the one waiting (:class:`PrefillMessage`: only the newest matters). The UI takes
the batch (:meth:`BatchMessage.take`) and sees what the separate messages would have left on screen.
"""

from __future__ import annotations

import threading
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


class BatchMessage(EngineMessage):
    """An event that later events of its kind join while it waits in the app's queue: merged on the
    engine thread (``merge``) until the UI takes it (``take``); ``join`` says how (its kind's rule)."""

    def __init__(self, event: Any) -> None:
        super().__init__(event)
        self.events = 1  # the engine events this message stands for
        self._taken = False
        self._lock = threading.Lock()  # merge (engine thread) against take (UI thread)

    def join(self, event: Any) -> Any:
        """The batch's event once ``event``, the next of its kind, has joined it."""
        raise NotImplementedError

    def merge(self, event: Any) -> bool:
        """Engine thread: add ``event`` unless it is of another kind or the UI has taken this
        message already (False: ``event`` needs a message of its own)."""
        if type(event) is not type(self.event):
            return False
        with self._lock:
            if self._taken:
                return False
            self.event = self.join(event)
            self.events += 1
            return True

    def take(self) -> tuple[Any, int]:
        """UI thread: the batch as it stands (nothing joins it afterwards) and how many events it holds."""
        with self._lock:
            self._taken = True
            return self.event, self.events


class PrefillMessage(BatchMessage):
    """Prefill progress: the newest of the reports that arrived before the UI took it."""

    kind = "PrefillProgress"
    event: PrefillProgress

    def join(self, event: PrefillProgress) -> PrefillProgress:
        return event  # only the newest progress matters


class TokenMessage(BatchMessage):
    """Streamed text: one token, and the tokens after it that arrived before the UI took it."""

    kind = "TokenEvent"
    event: TokenEvent

    def join(self, event: TokenEvent) -> TokenEvent:
        return TokenEvent(self.event.text + event.text, event.token, event.stats)


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
