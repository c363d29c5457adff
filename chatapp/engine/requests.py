"""What front ends ask of the engine thread, as plain dataclasses with no MLX in them.

The TUI's bridge puts these on the engine worker's queue; the worker dispatches on their type
(``match``), so every request the engine understands is listed here, with what it carries.
Each has a stable ``kind`` (the name used in error lines: "switch_mode failed: ...").
The events that come back are in :mod:`chatapp.engine.events`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Send:
    """The user's next message; the reply streams back."""

    text: str
    kind: ClassVar[str] = "send"


@dataclass(frozen=True)
class Regenerate:
    """Generate the last reply again."""

    kind: ClassVar[str] = "regenerate"


@dataclass(frozen=True)
class EditLast:
    """Replace the last user message (and what follows it) with ``text`` and reply again."""

    text: str
    kind: ClassVar[str] = "edit_last"


@dataclass(frozen=True)
class SwitchMode:
    """Switch the cache mode (and settings: window, sinks, kv_bits, ...) now."""

    mode: str
    changes: dict = field(default_factory=dict)
    kind: ClassVar[str] = "switch_mode"


@dataclass(frozen=True)
class Compare:
    """Replay the last turn in each of ``modes`` (one CompareResult per mode)."""

    modes: tuple[str, ...]
    max_tokens: int = 64
    kind: ClassVar[str] = "compare"


@dataclass(frozen=True)
class NewChat:
    """Forget the conversation and start over (the system prompt is kept)."""

    kind: ClassVar[str] = "new_chat"


@dataclass(frozen=True)
class Describe:
    """Ask for a :class:`~chatapp.engine.events.SessionInfo` of the session."""

    kind: ClassVar[str] = "describe"


@dataclass(frozen=True)
class OpenConversation:
    """Make a saved conversation the session's (resumed from its KV snapshot when it fits)."""

    conversation_id: int
    kind: ClassVar[str] = "open"


@dataclass(frozen=True)
class RenameConversation:
    conversation_id: int
    title: str
    kind: ClassVar[str] = "rename"


@dataclass(frozen=True)
class DeleteConversation:
    conversation_id: int
    kind: ClassVar[str] = "delete"


@dataclass(frozen=True)
class SetSystemPrompt:
    """Make ``text`` the conversation's system prompt ("" removes it); the next turn prefills again."""

    text: str
    kind: ClassVar[str] = "system_prompt"


@dataclass(frozen=True)
class SwitchModel:
    """Load ``spec`` (a folder, a repo id, a .gguf file) and move the conversation onto it; the
    old model stays when it does not load, and is released when it does."""

    spec: str
    kind: ClassVar[str] = "switch_model"


@dataclass(frozen=True)
class Quit:
    """Stop the engine thread (queued after what is already waiting)."""

    kind: ClassVar[str] = "quit"


Request = (Send | Regenerate | EditLast | SwitchMode | Compare | NewChat | Describe | OpenConversation
           | RenameConversation | DeleteConversation | SetSystemPrompt | SwitchModel | Quit)
