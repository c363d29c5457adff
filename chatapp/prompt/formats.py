"""Prompt formats: how a conversation becomes the token ids the model sees.

| name       | for                                    | what the model sees                                   |
| ---------- | -------------------------------------- | ----------------------------------------------------- |
| `template` | models with a chat template, or a Jinja file (``--chat-template``) | the template, applied by the tokenizer's own ``apply_chat_template`` |
| `llama-2`  | Llama-2-chat (Meta's ``chat_completion``) | ``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {reply} </s><s>[INST] {user} [/INST]`` |
| `mistral`  | Mistral-Instruct                       | ``<s>[INST] {system}\\n\\n{user} [/INST] {reply}</s>[INST] {user} [/INST]`` |
| `chatml`   | ChatML models (``<|im_start|>``/``<|im_end|>`` tokens) | BOS (if the tokenizer has one), ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n`` |
| `plain`    | base models                            | a ``User:``/``Assistant:`` transcript (below)         |
| `raw`      | ``--raw``                              | the messages concatenated, nothing added              |

Formats defined on token ids (``llama-2``, ``mistral``) are rendered as ids: each ``[INST] ...``
segment and each reply is encoded on its own (so each starts with SentencePiece's dummy-prefix
space) and BOS/EOS are token ids, never text, so a user typing ``</s>`` sends text. Text formats
(``template``, ``chatml``, ``plain``, ``raw``) render the text and tokenise it in one piece.

Replies as generated: a reply is shown and stored stripped (but with ``template``/``raw``), yet the
model saw it as it generated it. Every format but ``template`` renders a reply from
``Message.raw`` (the text as generated, when the session has it), so the tokens in the cache
after a reply are a prefix of the next turn's rendering, the end-of-turn token (``</s>``,
``<|im_end|>``) included, and a new turn prefills only its new message.

The plain transcript::

    <system text>\\n\\n            (only when there is a system prompt)
    User: <message>\\n
    Assistant: <reply>\\n\\n       (the reply as generated, when the session has it)
    User: <message>\\n
    Assistant:                   (the generation prompt)

Stops: a reply ends at the format's end-of-turn token (``stop_token_ids``: EOS for ``llama-2``
and ``mistral``, ``<|im_end|>`` for ``chatml``) and at the start of the next turn the model may
begin to write (``stop_strings``: ``[INST]``, ``\\nUser:``), which is never shown.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import ClassVar, Hashable

from .conversation import Conversation, Message

FORMAT_NAMES = ("template", "llama-2", "mistral", "chatml", "plain", "raw")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
PLAIN_STOP = "\nUser:"
INST_STOP = "[INST]"
_SEGMENT_CACHE = 4096  # encoded segments kept per format: a turn re-encodes only its new ones


class FormatError(Exception):
    """A prompt format that cannot be used, or a template that fails; ``str()`` is one line."""


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` with no BOS/EOS added and special-token names kept as text."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    except TypeError:  # a tokenizer without the option
        return list(tokenizer.encode(text, add_special_tokens=False))


def vocab_ids(tokenizer, tokens) -> dict[str, int]:
    """The ids of those of ``tokens`` that are single tokens of the tokenizer's vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):  # a tokenizer that cannot list its vocabulary
        return {}
    return {t: vocab[t] for t in tokens if t in vocab}


def _reply(m: Message, strip: bool) -> str:
    """The reply as rendered: as generated when known, else its content (stripped if ``strip``)."""
    if m.raw is not None:
        return m.raw
    return m.content.strip() if strip else m.content


class PromptFormat(ABC):
    """Renders a conversation into token ids (see the module docstring).

    ``name`` is the format's name; ``key`` identifies the exact rendering (snapshots and stored
    prefixes made with another key do not fit this one).
    """

    name: ClassVar[str] = ""
    stop_strings: ClassVar[tuple[str, ...]] = ()
    strips_replies: ClassVar[bool] = True  # the reply is shown and stored stripped
    renders_as_generated: ClassVar[bool] = True  # replies render from Message.raw

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def for_tokenizer(cls, tokenizer, raw: bool = False) -> "PromptFormat":
        """The format used when none is chosen: ``raw``, the tokenizer's template, else ``plain``."""
        if raw:
            return RawFormat(tokenizer)
        return TemplateFormat(tokenizer) if has_chat_template(tokenizer) else PlainFormat(tokenizer)

    @property
    def key(self) -> str:
        return self.name

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a reply besides the tokenizer's EOS."""
        return frozenset()

    @abstractmethod
    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
        """The conversation as text (for a format on ids: with BOS/EOS written as <s>, </s>)."""

    @abstractmethod
    def tokens(self, conv: Conversation, generation_prompt: bool = True) -> list[int]:
        """The token ids the model sees; ``generation_prompt`` adds the assistant's turn opener."""

    def rendering(self, conv: Conversation, generation_prompt: bool = True) -> Hashable:
        """What exactly is tokenised: equal renderings give equal token ids."""
        return self.text(conv, generation_prompt)

    def message_starts(self, conv: Conversation) -> list[int]:
        """Token index where each message begins (prefix lengths), for "what the model sees"."""
        starts = []
        for i in range(len(conv.messages)):
            head = Conversation(conv.messages[:i])
            starts.append(len(self.tokens(head, generation_prompt=False)) if i else 0)
        return starts

    def check(self, system: str = "") -> None:
        """Render a short conversation, raising FormatError when the format cannot (a broken template)."""
        conv = Conversation.start(system)
        conv.add("user", "Hello")
        conv.add("assistant", "Hello! How can I help?")
        conv.add("user", "Tell me a story.")
        self.tokens(conv)


# ---- text formats: the conversation as one text, tokenised in one piece ------------------------------
class _TextFormat(PromptFormat):
    def tokens(self, conv: Conversation, generation_prompt: bool = True) -> list[int]:
        # The tokenizer's default specials: a SentencePiece model's BOS, none for byte-level BPE.
        return list(self.tokenizer.encode(self.text(conv, generation_prompt)))


class PlainFormat(_TextFormat):
    name = "plain"
    stop_strings = (PLAIN_STOP,)

    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
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


class RawFormat(_TextFormat):
    name = "raw"
    strips_replies = False

    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
        return "".join(m.content if m.raw is None else m.raw for m in conv.messages)


class ChatMLFormat(PromptFormat):
    name = "chatml"
    stop_strings = CHATML_TOKENS

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        ids = vocab_ids(tokenizer, CHATML_TOKENS)
        missing = [t for t in CHATML_TOKENS if t not in ids]
        if missing:
            raise FormatError(f"the chatml format needs the tokens {' and '.join(CHATML_TOKENS)}, "
                              f"which this tokenizer lacks ({', '.join(missing)})")
        self._ids = frozenset(ids.values())

    @property
    def stop_token_ids(self) -> frozenset[int]:
        # <|im_end|> ends the turn; <|im_start|> would begin the next one.
        return self._ids

    def tokens(self, conv: Conversation, generation_prompt: bool = True) -> list[int]:
        # The tokenizer's BOS first when it has one (a Llama or Mistral vocabulary), as a
        # "{{ bos_token }}<|im_start|>..." template gives, whether or not its encode adds it.
        bos = getattr(self.tokenizer, "bos_token_id", None)
        text = self.tokenizer.encode(self.text(conv, generation_prompt), add_special_tokens=False)
        return ([bos] if bos is not None else []) + list(text)

    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
        parts = []
        for m in conv.messages:
            content = _reply(m, strip=False) if m.role == "assistant" else m.content
            parts.append(f"<|im_start|>{m.role}\n{content}<|im_end|>\n")
        if generation_prompt and (not conv.messages or conv.messages[-1].role != "assistant"):
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class TemplateFormat(PromptFormat):
    """A Jinja chat template applied by the tokenizer: its own, or ``template`` read from ``source``."""

    name = "template"
    strips_replies = False
    renders_as_generated = False

    def __init__(self, tokenizer, template: str | None = None, source: str = ""):
        super().__init__(tokenizer)
        if template is None and not has_chat_template(tokenizer):
            raise FormatError("the template format needs a chat template, and this model's tokenizer has none "
                              "(use --chat-template FILE or another --chat-format)")
        self.template = template
        self.source = source  # the file the template came from ("" for the tokenizer's own)

    @property
    def key(self) -> str:
        text = self.template if self.template is not None else _template_text(self.tokenizer)
        return f"template:{hashlib.sha256(text.encode('utf-8')).hexdigest()[:16]}"

    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
        extra = {"chat_template": self.template} if self.template is not None else {}
        try:
            return self.tokenizer.apply_chat_template(
                [m.as_template_dict() for m in conv.messages], add_generation_prompt=generation_prompt,
                tokenize=False, **extra)
        except Exception as e:  # noqa: BLE001 - any Jinja error, reported with its line
            raise FormatError(template_error_line(e, self.source)) from None

    def tokens(self, conv: Conversation, generation_prompt: bool = True) -> list[int]:
        # Templates write their own BOS; adding special tokens again would double it.
        return list(self.tokenizer.encode(self.text(conv, generation_prompt), add_special_tokens=False))


# ---- formats defined on token ids --------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A piece of text encoded on its own, with BOS before and/or EOS after it as token ids."""

    text: str
    bos: bool = False
    eos: bool = False


class _SegmentFormat(PromptFormat):
    stop_strings = (INST_STOP,)

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.bos_id = getattr(tokenizer, "bos_token_id", None)
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        if self.bos_id is None or self.eos_id is None:
            raise FormatError(f"the {self.name} format needs a tokenizer with BOS and EOS tokens, and this one lacks "
                              f"{'BOS' if self.bos_id is None else 'EOS'}")
        self._encode = lru_cache(maxsize=_SEGMENT_CACHE)(lambda text: tuple(encode_text(tokenizer, text)))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset({self.eos_id})

    @abstractmethod
    def segments(self, conv: Conversation) -> list[Segment]:
        """The conversation as segments, in order."""

    def rendering(self, conv: Conversation, generation_prompt: bool = True) -> Hashable:
        return tuple(self.segments(conv))

    def tokens(self, conv: Conversation, generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for seg in self.segments(conv):
            if seg.bos:
                ids.append(self.bos_id)
            ids.extend(self._encode(seg.text))
            if seg.eos:
                ids.append(self.eos_id)
        return ids

    def text(self, conv: Conversation, generation_prompt: bool = True) -> str:
        """The rendering with BOS and EOS written as ``<s>`` and ``</s>`` (for reading, not tokenising)."""
        return "".join(f"{'<s>' if s.bos else ''}{s.text}{'</s>' if s.eos else ''}" for s in self.segments(conv))

    @staticmethod
    def _turns(conv: Conversation) -> tuple[str, list[tuple[str | None, Message | None]]]:
        """(system text, [(user text or None, reply or None)]) in order of the conversation."""
        system, turns = "", []
        for m in conv.messages:
            if m.role == "system":
                system = m.content
            elif m.role == "user":
                turns.append((m.content, None))
            elif turns and turns[-1][1] is None and turns[-1][0] is not None:
                turns[-1] = (turns[-1][0], m)
            else:  # a reply with no question before it
                turns.append((None, m))
        return system, turns


class Llama2Format(_SegmentFormat):
    """Meta's ``chat_completion`` formatting (llama/generation.py), on token ids."""

    name = "llama-2"

    def segments(self, conv: Conversation) -> list[Segment]:
        system, turns = self._turns(conv)
        out: list[Segment] = []
        for user, reply in turns:
            if user is not None and system:  # the system block opens the first user message
                user, system = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}", ""
            if user is None:
                out.append(Segment(_reply(reply, strip=True), eos=True))
            elif reply is None:
                out.append(Segment(f"[INST] {user.strip()} [/INST]", bos=True))
            elif reply.raw is None:
                out.append(Segment(f"[INST] {user.strip()} [/INST] {reply.content.strip()} ", bos=True, eos=True))
            else:  # the reply as generated, after the prompt the model answered
                out.append(Segment(f"[INST] {user.strip()} [/INST]", bos=True))
                out.append(Segment(reply.raw, eos=True))
        return out


class MistralFormat(_SegmentFormat):
    """Mistral-Instruct (mistral_common's v1 tokenizer): one BOS, ``[INST] ... [/INST]`` turns,
    each reply closed by EOS. Mistral has no system block: the system prompt goes before the
    first user message (not the last, as mistral_common does, so that it never moves and earlier
    turns stay in the cache)."""

    name = "mistral"

    def segments(self, conv: Conversation) -> list[Segment]:
        system, turns = self._turns(conv)
        out: list[Segment] = []
        for user, reply in turns:
            if user is not None:
                if system:
                    user, system = f"{system}\n\n{user}", ""
                out.append(Segment(f"[INST] {user} [/INST]", bos=not out))
            if reply is not None:
                out.append(Segment(_reply(reply, strip=False), bos=not out, eos=True))
        return out


_FORMATS: dict[str, type[PromptFormat]] = {
    "template": TemplateFormat, "llama-2": Llama2Format, "mistral": MistralFormat, "chatml": ChatMLFormat,
    "plain": PlainFormat, "raw": RawFormat,
}
assert tuple(_FORMATS) == FORMAT_NAMES


def make_format(name: str, tokenizer, template: str | None = None, source: str = "") -> PromptFormat:
    """The format ``name`` for ``tokenizer`` (``template``/``source``: a Jinja template read from a
    file). Raises FormatError (one line) for an unknown name or a tokenizer the format cannot use."""
    if template is not None:
        return TemplateFormat(tokenizer, template, source)
    cls = _FORMATS.get(name)
    if cls is None:
        raise FormatError(f"unknown prompt format {name!r}: use one of {', '.join(FORMAT_NAMES)}")
    return cls(tokenizer)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False) or getattr(tokenizer, "chat_template", None))


def _template_text(tokenizer) -> str:
    """The tokenizer's own template as text (named templates as JSON), for the format's key."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return template
    if template:
        return json.dumps(template, sort_keys=True)
    renderer = getattr(tokenizer, "_chat_template", None)  # mlx-lm: a model-specific Python renderer
    return f"{type(renderer).__module__}.{getattr(renderer, '__qualname__', type(renderer).__qualname__)}"


def template_error_line(err: BaseException, source: str = "") -> str:
    """One line for a Jinja error: the file (when the template came from one), the template line
    and the message. Syntax errors carry their line; runtime errors (``raise_exception``, an
    undefined value) have it in the traceback frames Jinja maps onto the template."""
    line = getattr(err, "lineno", None)
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    message = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
    where = ", ".join(part for part in (source, f"line {line}" if line else "") if part)
    return f"{where}: {message}" if where else message


def read_template_file(path: str | Path) -> str:
    """The text of a Jinja template file; FormatError naming the file when it cannot be read."""
    path = Path(path).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"chat template {path}: no such file") from None
    except IsADirectoryError:
        raise FormatError(f"chat template {path}: is a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise FormatError(f"chat template {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise FormatError(f"chat template {path}: cannot read it ({e.strerror or e})") from None


__all__ = [
    "CHATML_TOKENS", "FORMAT_NAMES", "FormatError", "PromptFormat", "Segment", "encode_text", "has_chat_template",
    "make_format", "read_template_file", "template_error_line",
]
