"""The conversation: messages, and how they become the token ids the model sees.

Three formats:
- ``template``: the tokenizer's own chat template (instruction-tuned models).
- ``plain``: models without a chat template (base models such as stories260K or Llama-2 base)
  get a documented plain transcript::

      <system text>\n\n            (only when there is a system prompt)
      User: <message>\n
      Assistant: <reply>\n\n       (the reply exactly as generated, when the session has it)
      User: <message>\n
      Assistant:                   (the generation prompt)

  Generation stops when the model starts a new "\nUser:" line. A reply is shown and stored
  stripped, but the model saw it as generated (a SentencePiece model's first token carries a
  leading space, a byte-level model's may not): when " " + reply would tokenise differently from
  what the model produced, the session keeps the text that does not (``Message.raw``) and renders
  it, so the next turn's tokens match the cache and the reply is not prefilled again.
- ``raw`` (``--raw``): no template at all; messages are concatenated as they are, so the model
  simply continues the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant"]

PLAIN_STOP = "\nUser:"


@dataclass
class Message:
    role: Role
    content: str
    interrupted: bool = False  # a reply cut short by cancel; kept as generated
    raw: str | None = None  # plain/raw formats: the reply exactly as generated (content may be stripped)

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


class PromptFormat:
    """Renders a conversation into token ids, and records where each message starts."""

    def __init__(self, tokenizer, fmt: str):
        if fmt not in ("template", "plain", "raw"):
            raise ValueError(f"unknown prompt format {fmt!r}")
        self.tokenizer = tokenizer
        self.fmt = fmt

    @classmethod
    def for_tokenizer(cls, tokenizer, raw: bool = False) -> "PromptFormat":
        if raw:
            return cls(tokenizer, "raw")
        has = getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None)
        return cls(tokenizer, "template" if has else "plain")

    @property
    def stop_strings(self) -> list[str]:
        return [PLAIN_STOP] if self.fmt == "plain" else []

    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
        if self.fmt == "template":
            return self.tokenizer.apply_chat_template(
                [m.as_template_dict() for m in conv.messages],
                add_generation_prompt=generation_prompt,
                tokenize=False,
            )
        if self.fmt == "raw":
            return "".join(m.content if m.raw is None else m.raw for m in conv.messages)
        parts = []
        for m in conv.messages:
            if m.role == "system":
                parts.append(f"{m.content}\n\n")
            elif m.role == "user":
                parts.append(f"User: {m.content}\nAssistant:")
            elif m.raw is not None:
                parts.append(f"{m.raw}\n\n")
            else:
                parts.append(f" {m.content}\n\n")
        text = "".join(parts)
        if not generation_prompt and text.endswith("Assistant:"):
            text = text[: -len("Assistant:")]
        return text

    def tokens(self, conv: Conversation, generation_prompt: bool = True) -> list[int]:
        text = self.text(conv, generation_prompt)
        if self.fmt == "template":
            # Templates write their own BOS; adding special tokens again would double it.
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(text))

    def message_starts(self, conv: Conversation) -> list[int]:
        """Token index where each message begins (prefix lengths), for "what the model sees"."""
        starts = []
        for i in range(len(conv.messages)):
            head = Conversation(conv.messages[:i])
            starts.append(len(self.tokens(head, generation_prompt=False)) if i else 0)
        return starts
