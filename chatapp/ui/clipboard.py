"""What the copy keys copy: the last reply, a chosen message, a code block.

Copying goes through Textual's ``App.copy_to_clipboard``, which sends the text to the terminal
as an OSC 52 escape sequence: the terminal puts it on the system clipboard, over SSH too.
Terminals that support it: kitty, WezTerm, iTerm2 (allow it in Preferences), Alacritty, foot,
Windows Terminal, Ghostty, xterm (with ``allowWindowOps``), tmux (``set -g set-clipboard on``);
macOS Terminal.app and GNOME Terminal (VTE) ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

OSC52_NOTE = ("Copying uses OSC 52: kitty, WezTerm, iTerm2, Alacritty, foot, Ghostty, Windows Terminal, xterm "
              "(allowWindowOps) and tmux (set-clipboard on) support it; macOS Terminal and GNOME Terminal do not.")
ROLE_NAMES = {"system": "system prompt", "user": "you", "assistant": "assistant"}
PREVIEW_CHARS = 60


@dataclass
class Copyable:
    label: str  # what the copy dialog lists
    text: str  # what is copied
    kind: str  # "message" or "code"


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced or indented code block of a Markdown text, in order."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("gfm-like", {"html": False}).parse(markdown or "")
    return [(t.info.strip().split(" ")[0] if t.info else "", t.content) for t in tokens
            if t.type in ("fence", "code_block")]


def preview(text: str, width: int = PREVIEW_CHARS) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"


def last_reply(entries: Sequence) -> str | None:
    """The text of the last assistant message (None when there is none)."""
    return next((e.text for e in reversed(entries) if e.role == "assistant" and e.text), None)


def last_code_block(entries: Sequence) -> str | None:
    for e in reversed(entries):
        if e.role == "assistant":
            blocks = code_blocks(e.text)
            if blocks:
                return blocks[-1][1]
    return None


def copyables(entries: Sequence) -> list[Copyable]:
    """Everything the copy dialog offers, the newest first: each message, then each of its code blocks."""
    out: list[Copyable] = []
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if not e.text:
            continue
        out.append(Copyable(f"{ROLE_NAMES.get(e.role, e.role)} #{i}: {preview(e.text)}", e.text, "message"))
        for n, (lang, code) in enumerate(code_blocks(e.text) if e.role == "assistant" else [], 1):
            out.append(Copyable(f"  code block {n}{' (' + lang + ')' if lang else ''}: {preview(code)}", code,
                                "code"))
    return out


__all__ = ["Copyable", "OSC52_NOTE", "code_blocks", "copyables", "last_code_block", "last_reply", "preview"]
