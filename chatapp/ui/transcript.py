"""The transcript mirror, a part of the chat app (``ChatApp.transcript``): the conversation's
messages as the session holds them, each with its widget (``entries``), the messages queued
behind a reply, and what the KV cache holds of each (the markers, the dimmed evicted ones, the
first-eviction notice).

The engine reports messages by their index in the conversation (``CacheView.messages``,
``first_visible_message``); ``entries`` maps those indexes to widgets. The mirror reaches the
screen only through the chat view it is given; the engine client (ui/engine_link.py) and the
app's actions change it, the comforts read it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from chatapp.engine.stats import CacheView

from .markers import CacheNotice, EvictionWatch, apply_markers
from .widgets import ChatMessage, ChatView, Entry, SystemMessage, UserMessage


class Transcript:
    def __init__(self, view: Callable[[], ChatView]) -> None:
        self._view = view  # the chat view the messages are mounted in (once the app is composed)
        self.entries: list[Entry] = []
        self.queued: list[UserMessage] = []  # messages sent during a reply, waiting their turn
        self.eviction_watch = EvictionWatch()  # the first-eviction notice, once per conversation

    async def clear(self) -> None:
        """A new or another conversation: no messages, and its first eviction not said yet."""
        self.eviction_watch.reset()
        await self._view().remove_children()
        self.entries = []

    async def mount_message(self, widget: ChatMessage, after: ChatMessage | None = None) -> None:
        chat = self._view()
        if after is not None and after.parent is chat:
            await chat.mount(widget, after=after)
        else:
            await chat.mount(widget)
        if chat.is_anchored and not chat._anchor_released:
            chat.scroll_end(animate=False)

    async def add_message(self, widget: ChatMessage, role: str) -> Entry:
        widget.conv_index = len(self.entries)
        entry = Entry(role, widget.text, widget)
        self.entries.append(entry)
        await self.mount_message(widget)
        return entry

    def last_user(self) -> int | None:
        for i in range(len(self.entries) - 1, -1, -1):
            if self.entries[i].role == "user":
                return i
        return None

    async def show_system_prompt(self, text: str) -> None:
        """The conversation's system prompt is ``text`` now ("" none): the mirror follows."""
        chat = self._view()
        first = self.entries[0] if self.entries else None
        if first is not None and first.role == "system":
            if text:
                first.text = text
                if first.widget is not None:
                    first.widget.set_text(text)
            else:
                self.entries.pop(0)
                if first.widget is not None and first.widget.is_attached:
                    await first.widget.remove()
        elif text:
            widget = SystemMessage(text, 0)
            if first is None:
                await self.add_message(widget, "system")
            else:
                self.entries.insert(0, dataclasses.replace(first, role="system", text=text, widget=widget))
                await chat.mount(widget, before=chat.children[0] if chat.children else None)
        for i, e in enumerate(self.entries):
            if e.widget is not None:
                e.widget.conv_index = i

    # ---- the queue ---------------------------------------------------------------------------------
    async def queue(self, text: str) -> None:
        """Enter during a reply (or a load): show the message as queued; it is sent when the engine is free."""
        widget = UserMessage(text)
        widget.tags = ["queued"]
        self.queued.append(widget)
        await self.mount_message(widget)

    async def take_queued(self) -> list[str]:
        """The queued messages' texts, their widgets removed and the queue emptied."""
        texts = [w.text for w in self.queued]
        for widget in self.queued:
            if widget.is_attached:
                await widget.remove()
        self.queued = []
        return texts

    # ---- what the cache holds ----------------------------------------------------------------------
    def show_cache(self, cache: CacheView, effective: dict) -> None:
        """Dim the messages the model no longer sees, mark what the KV cache holds of each
        (ui/markers.py) and say the conversation's first eviction once (``effective``: the cache
        settings in use)."""
        self._mark_evicted(cache)
        apply_markers(self.entries, cache.messages)
        line = self.eviction_watch.check(cache.messages, [e.role for e in self.entries], cache, effective)
        if line:
            self._view().mount(CacheNotice(line, markup=False))

    def _mark_evicted(self, cache: CacheView) -> None:
        """Dim the messages before ``first_visible_message`` (the model no longer sees them), all but
        those the cache map says are still held (a pinned system prompt stays lit)."""
        rows = {row.index: row for row in cache.messages}
        for i, entry in enumerate(self.entries):
            if entry.widget is not None:
                row = rows.get(i)
                gone = row is None or row.state in ("evicted", "partly evicted")
                entry.widget.set_evicted(i < cache.first_visible_message and gone)
