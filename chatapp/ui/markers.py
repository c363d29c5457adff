"""Cache markers on the transcript: what the KV cache holds of each message.

Each message widget gets a thin marker, its right border, coloured from the theme's variables
(so every theme works, and a 16-colour terminal maps them to distinct ANSI colours) and drawn
in a different line style per state (so it reads without colour too); and a text form in its
header ("kv 8-bit", "kv 40/60 tok evicted") for screen readers and snapshot tests. A message
wholly outside the window already says so in its header (widgets.EVICTED_TAG), so its marker
adds no second text. The rows come from the engine (engine/cache_map.py) inside every
``CacheView`` a turn or an info request returns.

The first time a turn makes the policy evict part of the conversation, one notice is added to
the transcript (:func:`eviction_notice`).
"""

from __future__ import annotations

from typing import Any, Sequence

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from chatapp.engine.cache_map import STATE_HELP, STATES, MessageCache, eviction_notice

MARKER_CLASSES = {state: "kv-" + state.replace(" ", "-") for state in STATES}
# The line style of each state's marker (the colours are in app.tcss): legend and CSS agree.
MARKER_GLYPHS = {"held": "▐", "restored": "▐", "quantised": "╏", "partly evicted": "╏", "evicted": "┃",
                 "pending": "╎"}
LEGEND_STYLES = {"held": "green", "restored": "cyan", "quantised": "yellow", "partly evicted": "red",
                 "evicted": "red", "pending": "dim"}


class CacheNotice(Static):
    """A one-line notice in the transcript (not a message of the conversation)."""

    DEFAULT_CSS = """
    CacheNotice { height: auto; margin: 1 0 0 0; padding: 0 1; color: $warning; text-style: italic; }
    """


def marker_text(row: MessageCache) -> str | None:
    """The header's text form of a row (None for a wholly evicted message: EVICTED_TAG says it)."""
    return None if row.state == "evicted" else row.text()


def apply_marker(widget: Any, row: MessageCache | None) -> None:
    """Set one message widget's marker (class and header text) from its row; None clears it."""
    old = getattr(widget, "cache_marker", None)
    new = marker_text(row) if row is not None else None
    if old and old != new:
        widget.set_tag(old, False)
    if new:
        widget.set_tag(new, True)
    widget.cache_marker = new
    widget.cache_state = row.state if row is not None else ""
    for state, cls in MARKER_CLASSES.items():
        widget.set_class(row is not None and row.state == state, cls)


def apply_markers(entries: Sequence[Any], rows: Sequence[MessageCache]) -> None:
    """Markers for the app's transcript mirror (``ChatApp.entries``; entry i is message i)."""
    for i, entry in enumerate(entries):
        if entry.widget is not None:
            apply_marker(entry.widget, rows[i] if i < len(rows) else None)


class EvictionWatch:
    """Says once per conversation when the policy first evicts part of it."""

    def __init__(self) -> None:
        self.said = False

    def reset(self) -> None:
        self.said = False

    def check(self, rows: Sequence[MessageCache], roles: Sequence[str], cache: Any,
              effective: dict[str, int]) -> str:
        """The notice to show now ("" when there is none or it was shown). ``cache``: the
        CacheView; ``effective``: the cache settings in use (SessionInfo.effective)."""
        if self.said or not rows:
            return ""
        line = eviction_notice(rows, roles, kept_tokens(cache, effective))
        if line:
            self.said = True
        return line


def kept_tokens(cache: Any, effective: dict[str, int]) -> int:
    """"The last N tokens" the policy keeps: what is held past the sinks (in scored mode, whose
    middle is kept by attention score, the protected recent window)."""
    sinks = int(effective.get("sinks", 0))
    if cache.mode == "scored":
        return int(effective.get("window", 0))
    return max(0, cache.tokens - sinks)


def legend() -> Table:
    """The markers' legend for the help screen (F1)."""
    t = Table(box=None, show_header=False, padding=(0, 2, 0, 0), expand=True)
    t.add_column(no_wrap=True)
    t.add_column(no_wrap=True, style="bold")
    t.add_column(ratio=1)
    for state in STATES:
        t.add_row(Text(MARKER_GLYPHS[state], style=LEGEND_STYLES[state]), state, STATE_HELP[state])
    return t


__all__ = ["CacheNotice", "EvictionWatch", "MARKER_CLASSES", "apply_marker", "apply_markers", "kept_tokens",
           "legend", "marker_text"]
