"""Search every saved conversation (full text, store/search.py) from the sessions screen (F7, then /).

Results update as you type: the conversation, its date and the matching line. Enter (or a click)
on a result opens (resumes) that conversation. The store is read on the UI thread, read-only
(SQLite readers never block the engine thread's writes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Static

from chatapp.textsafe import printable

from .format import fmt_when

ROLE_NAMES = {"user": "you", "assistant": "assistant", "system": "system"}


def search_saved(data_dir: Path, text: str, limit: int = 50) -> tuple[list[Any], str]:
    """(hits, message): the matches of ``text`` in the store at ``data_dir``, or none and a line
    saying why (empty search, unreadable store, nothing found)."""
    from chatapp.store import ChatStore, StoreError
    from chatapp.store.search import SearchError

    if not text.strip():
        return [], "type words to find in every saved conversation"
    try:
        with ChatStore.open(data_dir, write=False) as store:
            hits = store.search(text, limit)
    except SearchError as e:
        return [], str(e)
    except (StoreError, OSError) as e:
        return [], f"cannot read the saved conversations in {data_dir}: {e}"
    if not hits:
        return [], f"no saved message holds {text.strip()!r}"
    return hits, f"{len(hits)} match{'es' if len(hits) != 1 else ''}" + (" (the first ones)" if len(hits) >= limit
                                                                       else "")


class SearchScreen(ModalScreen[int | None]):
    """A search box over every saved conversation; dismisses with the conversation id to open."""

    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("down", "to_results", show=False)]

    def __init__(self, data_dir: Path, query: str = "") -> None:
        super().__init__()
        self.data_dir = data_dir
        self.query_text = query
        self.hits: list[Any] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="search-box", classes="dialog"):
            yield Static(Text("Search saved conversations", style="bold"), markup=False)
            yield Input(self.query_text, placeholder="words to find (all of them)", id="search-input", compact=True)
            yield DataTable(id="search-table", zebra_stripes=True, cursor_type="row")
            yield Static("", id="search-status", markup=False)
            yield Static(Text("type to search · ↓ to the results · Enter opens (resumes) · Esc closes",
                              style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("id", "updated", "conversation", "match")
        self.run_search(self.query_text)
        self.query_one(Input).focus()

    def run_search(self, text: str) -> None:
        self.query_text = text
        self.hits, message = search_saved(self.data_dir, text)
        table = self.query_one(DataTable)
        table.clear()
        for i, h in enumerate(self.hits):
            who = ROLE_NAMES.get(h.role, h.role)
            table.add_row(Text(str(h.conversation_id), justify="right"), Text(fmt_when(h.updated)),
                          Text(printable(h.title or "(untitled)")),
                          Text.assemble((who + ": ", "dim"), printable(h.line)), key=str(i))
        self.query_one("#search-status", Static).update(Text(message, style="dim"))

    @on(Input.Changed, "#search-input")
    def _changed(self, event: Input.Changed) -> None:
        self.run_search(event.value)

    @on(Input.Submitted, "#search-input")
    def _submitted(self, event: Input.Submitted) -> None:
        if self.hits:
            self.action_to_results()

    def action_to_results(self) -> None:
        if self.hits:
            self.query_one(DataTable).focus()

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.open(event.cursor_row)

    def open(self, row: int) -> None:
        if 0 <= row < len(self.hits):
            self.dismiss(self.hits[row].conversation_id)

    def action_cancel(self) -> None:
        self.dismiss(None)


def open_search(screen, data_dir: Path, on_open: Callable[[int], Any]) -> None:
    """Push the search screen over ``screen`` (the sessions screen); a chosen result closes
    both and opens that conversation."""

    def done(cid: int | None) -> None:
        if cid is not None:
            screen.dismiss()
            on_open(cid)

    screen.app.push_screen(SearchScreen(data_dir), done)
