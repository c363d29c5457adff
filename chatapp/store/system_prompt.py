"""Change a conversation's system prompt (the TUI's system-prompt dialog); runs on the engine thread.

Every token after the system prompt attends to it, so a new system prompt leaves nothing of
the cache reusable but the template's few tokens before it: the session's prefix reuse would
trim the cache back to those and prefill the rest, and that is what the next turn costs. The
caches are emptied here instead, so that the next turn can warm-start from the prefix store
when the new system prompt was used before (the store keeps every first turn's system prompt,
see PersistentChat.store_prefix). The saved transcript is rewritten at once.
"""

from __future__ import annotations

from chatapp.engine.events import SystemChange

from .textio import clean_text


def set_system_prompt(chat, session, text: str) -> SystemChange:
    """Make ``text`` the system prompt of ``session``'s conversation ("" removes it); ``chat``
    (a PersistentChat, or None) saves the transcript."""
    text = clean_text(text).strip()
    if text == system_prompt_of(session):
        return SystemChange(text, False)
    tokens, kept = session.set_system(text)
    change = SystemChange(text, True, reprefill=len(tokens), kept=kept)
    source = getattr(chat, "prefixes", None) if chat is not None else None
    if tokens and source is not None and getattr(chat, "namespace", None) is not None:
        try:
            change.stored = source.covered(chat.namespace, tokens)
        except Exception:  # noqa: BLE001 - an estimate for the note only
            change.stored = 0
    if chat is not None:
        chat.commit()
    return change


def system_prompt_of(session) -> str:
    msgs = session.conversation.messages
    return msgs[0].content if msgs and msgs[0].role == "system" else ""


__all__ = ["SystemChange", "set_system_prompt", "system_prompt_of"]
