"""A saved conversation as Markdown or JSON (``chatapp sessions export ID``).

Message text is written exactly as stored (control characters included): JSON escapes them
itself, and the CLI makes them visible only when it writes to a terminal. The JSON form is
lossless and reads back with :func:`from_json`.
"""

from __future__ import annotations

import json
import time

from .db import ChatStore, ConversationInfo, StoredMessage

FORMATS = ("markdown", "json")
_HEADINGS = {"system": "System", "user": "User", "assistant": "Assistant"}


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def to_markdown(info: ConversationInfo, messages: list[StoredMessage]) -> str:
    out = [f"# {info.title or f'Conversation {info.id}'}", ""]
    out.append(f"- id: {info.id}")
    if info.model_id:
        out.append(f"- model: {info.model_id}")
    out.append(f"- created: {_when(info.created)}")
    out.append(f"- updated: {_when(info.updated)}")
    out.append("")
    for m in messages:
        out.append(f"## {_HEADINGS.get(m.role, m.role)}")
        out.append("")
        out.append(m.content)
        if m.status == "interrupted":
            out.append("")
            out.append("*(interrupted)*")
        elif m.status == "in_progress":
            out.append("")
            out.append("*(in progress)*")
        out.append("")
    return "\n".join(out)


def to_dict(info: ConversationInfo, messages: list[StoredMessage]) -> dict:
    d = info.to_json()
    d.pop("snapshot_bytes", None)
    d["messages"] = [
        {"role": m.role, "content": m.content, "status": m.status, "created": m.created, "updated": m.updated}
        for m in messages
    ]
    return d


def to_json(info: ConversationInfo, messages: list[StoredMessage]) -> str:
    return json.dumps(to_dict(info, messages), ensure_ascii=False, indent=2) + "\n"


def from_json(text: str) -> tuple[dict, list[StoredMessage]]:
    """The conversation fields and messages of a JSON export."""
    d = json.loads(text)
    msgs = [StoredMessage(i, m["role"], m["content"], m["status"], m["created"], m["updated"])
            for i, m in enumerate(d.pop("messages"))]
    return d, msgs


def export(store: ChatStore, conversation_id: int, fmt: str = "markdown") -> str:
    """Conversation ``conversation_id`` of ``store`` as text in ``fmt`` ("markdown" or "json")."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    info = store.get(conversation_id)
    messages = store.messages(conversation_id)
    return to_markdown(info, messages) if fmt == "markdown" else to_json(info, messages)
