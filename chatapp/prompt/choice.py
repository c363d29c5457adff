"""Which prompt format a model gets, and why (no MLX: ``--show-config`` uses it before loading).

The settings decide first: ``chat.raw`` (``--raw``), then ``chat.template`` (``--chat-template
FILE``), then ``chat.format`` (``--chat-format NAME``) unless it is ``auto``. In ``auto``, what the
repo tells decides, in this order:

1. a chat template (``tokenizer_config.json``, ``chat_template.jinja``): ``template``;
2. ``<|im_start|>`` and ``<|im_end|>`` in the tokenizer's vocabulary: ``chatml``;
3. the model id (or the ``_name_or_path`` its config records) matching a known chat family
   (:data:`ID_PATTERNS`, e.g. ``*llama-2*chat*`` -> ``llama-2``);
4. an id naming some other chat or instruct model (``*-chat*``, ``*-instruct*``): the format of
   its architecture's family (:data:`ARCH_FORMATS`, else ``chatml``);
5. otherwise a base model (``mlx-community/Llama-2-7b-4bit``): ``plain`` text continuation.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from .formats import CHATML_TOKENS, has_chat_template, vocab_ids

# (pattern on the lower-cased model id, format), first match wins.
ID_PATTERNS = (
    ("*llama-2*chat*", "llama-2"),
    ("*llama2*chat*", "llama-2"),
    ("*codellama*instruct*", "llama-2"),
    ("*mistral*instruct*", "mistral"),
    ("*mixtral*instruct*", "mistral"),
    ("*chatml*", "chatml"),
    ("*hermes*", "chatml"),
    ("*dolphin*", "chatml"),
)
CHAT_PATTERNS = ("*-chat*", "*_chat*", "*-instruct*", "*_instruct*", "*-it", "*-it-*")
ARCH_FORMATS = {"llama": "llama-2", "mistral": "mistral", "mixtral": "mistral"}


@dataclass(frozen=True)
class RepoFacts:
    """What a model's files tell about its prompt format."""

    model_id: str
    config: dict
    has_chat_template: bool
    chatml_tokens: bool  # <|im_start|> and <|im_end|> are tokens of its vocabulary

    @classmethod
    def from_tokenizer(cls, model_id: str, config: dict, tokenizer) -> "RepoFacts":
        chatml = len(vocab_ids(tokenizer, CHATML_TOKENS)) == len(CHATML_TOKENS)
        return cls(model_id, dict(config), has_chat_template(tokenizer), chatml)

    @classmethod
    def from_folder(cls, model_id: str, path: Path) -> "RepoFacts":
        """From the files alone (no tokenizer built): for ``--show-config``."""
        tok_config = _read_json(path / "tokenizer_config.json")
        template = bool(tok_config.get("chat_template")) or any(
            (path / name).is_file() for name in ("chat_template.jinja", "chat_template.json"))
        added = {str(v.get("content", "")) for v in (tok_config.get("added_tokens_decoder") or {}).values()
                 if isinstance(v, dict)}
        added |= {str(t.get("content", "")) for t in _read_json(path / "tokenizer.json").get("added_tokens") or []
                  if isinstance(t, dict)}
        added |= set(_read_json(path / "added_tokens.json"))
        return cls(model_id, _read_json(path / "config.json"), template, all(t in added for t in CHATML_TOKENS))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class FormatRequest:
    """The ``[chat]`` settings that choose a format, and where each came from (for the reason)."""

    format: str = "auto"
    template: str = ""
    raw: bool = False
    format_source: str = "default"
    template_source: str = "default"
    raw_source: str = "default"

    @classmethod
    def from_config(cls, config) -> "FormatRequest":
        """From a :class:`chatapp.config.Config` (its ``[chat]`` values and their sources)."""
        c = config.chat
        return cls(format=c.format, template=c.template, raw=c.raw, format_source=config.source("chat.format"),
                   template_source=config.source("chat.template"), raw_source=config.source("chat.raw"))


@dataclass(frozen=True)
class FormatChoice:
    """The format a session uses and why (shown by --show-config, --verbose and the TUI's notes)."""

    name: str
    reason: str
    template_file: str = ""  # a --chat-template file to read, when the choice is one

    def describe(self) -> str:
        return f"{self.name} ({self.reason})"

    def line(self) -> str:
        return f"prompt format {self.describe()}"


def choose_format(request: FormatRequest, facts: RepoFacts) -> FormatChoice:
    """Apply the settings, then detection (see the module docstring)."""
    if request.raw:
        return FormatChoice("raw", f"chat.raw is on ({request.raw_source}): no template at all")
    if request.template:
        return FormatChoice("template", f"the Jinja template {request.template} (chat.template, "
                                        f"{request.template_source})", request.template)
    if request.format != "auto":
        return FormatChoice(request.format, f"chat.format, {request.format_source}")
    return detect_format(facts)


def detect_format(facts: RepoFacts) -> FormatChoice:
    if facts.has_chat_template:
        return FormatChoice("template", "the model's own chat template")
    if facts.chatml_tokens:
        return FormatChoice("chatml", "no chat template; the tokenizer has the <|im_start|>/<|im_end|> tokens")
    names = [("the model id", facts.model_id)]
    recorded = facts.config.get("_name_or_path")
    if isinstance(recorded, str) and recorded:
        names.append(("the name its config records", recorded))
    for what, name in names:
        for pattern, fmt in ID_PATTERNS:
            if fnmatch.fnmatchcase(name.lower(), pattern):
                return FormatChoice(fmt, f"no chat template; {what} {name} matches {pattern}")
    arch = str(facts.config.get("model_type") or ("llama" if "n_layers" in facts.config else ""))
    for what, name in names:
        for pattern in CHAT_PATTERNS:
            if fnmatch.fnmatchcase(name.lower(), pattern):
                fmt = ARCH_FORMATS.get(arch, "chatml")
                family = f"a {arch} model" if arch in ARCH_FORMATS else f"architecture {arch or 'unknown'}"
                return FormatChoice(fmt, f"no chat template; {what} {name} names a chat model ({pattern}), {family}")
    return FormatChoice("plain", "no chat template, and nothing names a chat or instruct model: a base model "
                                 "continues plain text")


__all__ = ["ARCH_FORMATS", "CHAT_PATTERNS", "FormatChoice", "FormatRequest", "ID_PATTERNS", "RepoFacts",
           "choose_format", "detect_format"]
