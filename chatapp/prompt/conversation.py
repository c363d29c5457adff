"""The conversation: its messages, as the user and the model wrote them.

How a conversation becomes the token ids the model sees is a prompt format's job
(:mod:`chatapp.prompt.formats`). A reply is shown and stored as ``content``; ``raw`` keeps the
text as the model generated it when that differs (a stripped reply, a SentencePiece model's first
token's leading space), so that formats render it exactly as the cache holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

Role = Literal["system", "user", "assistant"]


@dataclass
class Message:
    role: Role
    content: str
    interrupted: bool = False  # a reply cut short by cancel; kept as generated
    raw: str | None = None  # the reply exactly as generated (content may be stripped)

    def as_template_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass
class Conversation:
    messages: list[Message] = field(default_factory=list)

    @classmethod
    def start(cls, system: str = "") -> "Conversation":
        return cls([Message("system", system)] if system else [])

    def add(self, role: Role, content: str, interrupted: bool = False, raw: str | None = None) -> Message:
        msg = Message(role, content, interrupted, raw)
        self.messages.append(msg)
        return msg

    @property
    def last(self) -> Message | None:
        return self.messages[-1] if self.messages else None

    def last_index(self, role: Role) -> int | None:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == role:
                return i
        return None

    def copy(self) -> "Conversation":
        return Conversation([Message(m.role, m.content, m.interrupted, m.raw) for m in self.messages])


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (token ids, messages) ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
