"""Screens and dialogs: loading, help, configuration, cache-mode dialog, mode comparison, saved sessions."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, DataTable, Input, Label, ProgressBar, Select, Static

from cache.settings import DIALOG_KNOBS
from chatapp.textsafe import printable

from .clipboard import OSC52_NOTE
from .comforts import COMFORT_KEYS
from .format import (
    MODE_FIELDS,
    MODE_HELP,
    MODES,
    fmt_bytes,
    fmt_rate,
    fmt_seconds_ms,
    fmt_when,
    hbar,
    model_label,
    validate_mode_fields,
)
from .markers import legend as markers_legend

#: (key, what it does) - the help screen and docs/tui.md list these.
KEYS: list[tuple[str, str]] = [
    ("Enter", "send the message (during a reply it is queued and sent when the reply ends)"),
    ("Ctrl+J", "new line in the message (also Shift+Enter / Alt+Enter in terminals that report them, "
               "e.g. with the kitty keyboard protocol)"),
    ("Esc", "stop the reply (the partial reply is kept, marked interrupted; queued messages return "
            "to the input box); cancel editing"),
    ("Ctrl+N", "new chat (the conversation stays saved: F7 reopens it)"),
    ("Ctrl+R", "regenerate the last reply"),
    ("Ctrl+O", "edit your last message (Enter resends it, Esc cancels)"),
    ("Ctrl+L", "clear the screen (the model keeps the conversation)"),
    ("F2", "show / hide the side panel"),
    ("F3", "next cache mode"),
    ("F4", "cache-mode dialog (mode and settings)"),
    ("F5", "compare cache modes on the last turn"),
    ("F6", "effective configuration and where each value came from"),
    ("F7", "saved conversations: open (resume), search (/), rename, delete"),
    ("F1 / ?", "this help"),
    ("Ctrl+P", "command palette (every action, searchable)"),
    ("Ctrl+Q", "quit"),
]


class LoadingScreen(Screen):
    """A progress bar while the model downloads and loads; the error if it fails."""

    BINDINGS = [Binding("q,ctrl+q,escape", "app.quit", "Quit")]

    def __init__(self, model_id: str, error: str = "") -> None:
        super().__init__(id="loading")
        self.model_id = model_id
        self.failed = False
        self.error = error  # shown as the failure once mounted

    def on_mount(self) -> None:
        if self.error:
            self.fail(self.error)

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static(Text.assemble(("Loading ", "bold"), (model_label(self.model_id), "bold")),
                         id="loading-title", markup=False)
            yield ProgressBar(total=None, show_eta=False, id="loading-bar")
            yield Static(Text("starting", style="dim"), id="loading-status", markup=False)
            yield Static("", id="loading-error", markup=False)

    def progress(self, phase: str, detail: str, percent: float | None) -> None:
        bar = self.query_one(ProgressBar)
        if percent is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=percent)
        self.query_one("#loading-status", Static).update(Text(printable(detail), style="dim"))

    def fail(self, message: str) -> None:
        self.failed = True
        self.query_one(ProgressBar).update(total=100, progress=0)
        self.query_one("#loading-status", Static).update(Text("the model could not be loaded", style="bold"))
        self.query_one("#loading-error", Static).update(
            Text.assemble((printable(message), "bold red"), ("\n\npress q to quit", "dim")))
        self.add_class("failed")


class HelpScreen(ModalScreen):
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        keys = Table(box=None, show_header=False, padding=(0, 2, 0, 0), expand=True)
        keys.add_column(style="bold", no_wrap=True)
        keys.add_column(ratio=1)
        for key, what in KEYS + COMFORT_KEYS:
            keys.add_row(key, what)
        note = Text("While a reply streams, new messages are queued and cache-mode switches apply when it "
                    "ends. docs/tui.md explains every gauge.", style="dim")
        with VerticalScroll(id="help-box", classes="dialog"):
            yield Static(Text("Keys", style="bold"), markup=False)
            yield Static(keys, markup=False)
            yield Static(note, markup=False, id="help-note")
            yield Static(Text(OSC52_NOTE, style="dim"), markup=False, id="help-osc52")
            yield Static(Text("Cache markers (the right edge of each message; its header says it too)",
                              style="bold"), markup=False, id="help-markers-title")
            yield Static(markers_legend(), markup=False, id="help-markers")
            yield Static(Text("Esc closes", style="dim"), classes="dialog-hint", markup=False)


class ConfigScreen(ModalScreen):
    """Every setting, its effective value and where it came from (``Config.describe()``)."""

    BINDINGS = [Binding("escape,f6,q", "dismiss", "Close")]

    def __init__(self, config, extra: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__()
        self.config = config
        self.extra = list(extra)

    def compose(self) -> ComposeResult:
        with Vertical(id="config-box", classes="dialog"):
            yield Static(Text("Effective configuration", style="bold"), markup=False)
            yield DataTable(id="config-table", zebra_stripes=True, cursor_type="row")
            for label, value in self.extra:
                yield Static(Text.assemble((label + ": ", "dim"), printable(value)), markup=False)
            yield Static(Text("Esc closes", style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("setting", "value", "source")
        for key, value, source in self.config.describe():
            shown = "random" if value is None else repr(value) if isinstance(value, str) else str(value)
            table.add_row(Text(key), Text(printable(shown)), Text(printable(source), style="dim"))
        table.focus()


class ModeDialog(ModalScreen[tuple[str, dict] | None]):
    """Choose the cache mode and its settings; returns (mode, changed settings) or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    # (name, label, hint) per knob the dialog shows (cache.settings.KNOBS); a text knob is a Select
    FIELDS = [(knob.name, knob.dialog_label, knob.dialog_hint) for knob in DIALOG_KNOBS]
    CHOICE_FIELDS = {knob.name: knob.choices for knob in DIALOG_KNOBS if knob.type is str}

    def __init__(self, mode: str, settings: dict[str, int], effective: dict[str, int] | None = None,
                 busy: bool = False) -> None:
        super().__init__()
        self.mode = mode if mode in MODES else "auto"
        self.settings = dict(settings)
        self.effective = dict(effective or {})
        self.busy = busy

    def compose(self) -> ComposeResult:
        with Vertical(id="mode-box", classes="dialog"):
            yield Static(Text("Cache mode", style="bold"), markup=False)
            yield Select([(m, m) for m in MODES], value=self.mode, allow_blank=False, id="mode-select",
                         compact=True)
            yield Static(Text(MODE_HELP[self.mode], style="dim"), id="mode-help", markup=False)
            yield Static(Text("Settings (dimmed: not used by this mode)", style="bold"), id="mode-fields-title",
                         markup=False)
            for name, label, hint in self.FIELDS:
                with Horizontal(classes="field-row", id=f"row-{name}"):
                    yield Label(label, classes="field-label")
                    if name in self.CHOICE_FIELDS:
                        choices = self.CHOICE_FIELDS[name]
                        value = self.settings.get(name, choices[0])
                        yield Select([(c, c) for c in choices], value=value if value in choices else choices[0],
                                     allow_blank=False, id=f"f-{name}", compact=True, classes="field-input")
                    else:
                        yield Input(str(self.settings.get(name, "")), id=f"f-{name}", type="integer",
                                    compact=True, classes="field-input")
                    yield Static(Text(hint, style="dim"), id=f"e-{name}", classes="field-msg", markup=False)
            note = []
            changed = {k: v for k, v in self.effective.items() if self.settings.get(k) != v}
            if changed:
                note.append("in use after fitting to the model: " + ", ".join(f"{k} {v}" for k, v in changed.items()))
            if self.busy:
                note.append("a reply is streaming: the switch applies when it ends")
            yield Static(Text("\n".join(note), style="italic"), id="mode-note", markup=False)
            with Horizontal(id="mode-buttons"):
                yield Button("Apply", variant="primary", id="apply", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self._show_relevant()
        self.query_one("#mode-select", Select).focus()

    def _show_relevant(self) -> None:
        for name, _, _ in self.FIELDS:
            self.query_one(f"#row-{name}").set_class(self.mode not in MODE_FIELDS[name], "unused")

    @on(Select.Changed, "#mode-select")
    def _mode_changed(self, event: Select.Changed) -> None:
        if isinstance(event.value, str):
            self.mode = event.value
            self.query_one("#mode-help", Static).update(Text(MODE_HELP[self.mode], style="dim"))
            self._show_relevant()

    def raw_fields(self) -> dict[str, str]:
        return {name: str(self.query_one(f"#f-{name}").value) for name, _, _ in self.FIELDS}

    def validate(self) -> tuple[dict[str, int], dict[str, str]]:
        values, errors = validate_mode_fields(self.mode, self.raw_fields())
        for name, _, hint in self.FIELDS:
            msg = self.query_one(f"#e-{name}", Static)
            if name in errors:
                msg.update(Text(errors[name], style="bold red"))
                msg.add_class("error")
            else:
                msg.update(Text(hint, style="dim"))
                msg.remove_class("error")
        return values, errors

    @on(Input.Changed)
    def _field_changed(self, event: Input.Changed) -> None:
        self.validate()

    @on(Input.Submitted)
    @on(Button.Pressed, "#apply")
    def action_apply(self) -> None:
        values, errors = self.validate()
        if errors:
            self.notify("fix the highlighted settings first", severity="warning", markup=False)
            return
        changes = {k: v for k, v in values.items() if self.settings.get(k) != v}
        self.dismiss((self.mode, changes))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class CompareScreen(ModalScreen):
    """The last turn replayed in every mode: TTFT and decode rate side by side, with bars."""

    BINDINGS = [Binding("escape,q,f5", "dismiss", "Close")]

    def __init__(self, modes: Sequence[str], rows: Sequence[Any] = (), done: bool = False) -> None:
        super().__init__()
        self.modes = list(modes)
        self.rows: list[Any] = list(rows)
        self.done = done

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="compare-box", classes="dialog"):
            yield Static(Text("Compare cache modes on the last turn", style="bold"), markup=False)
            yield Static("", id="compare-status", markup=False)
            yield DataTable(id="compare-table", show_cursor=False, zebra_stripes=True)
            yield Static("", id="compare-chart", markup=False)
            yield Static("", id="compare-errors", markup=False)
            yield Static(Text("Esc closes (a running comparison keeps going in the background)", style="dim"),
                         classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for label in ("mode", "context", "TTFT", "prefill tok/s", "decode tok/s", "tok", "KV held", "KV alloc",
                      "route"):
            table.add_column(label, key=label)
        table.can_focus = False
        self.query_one("#compare-box").focus()
        self._refresh()

    def add_row(self, row: Any, done: bool) -> None:
        self.rows.append(row)
        self.done = done
        if self.is_mounted:
            self._refresh()

    def finish(self) -> None:
        self.done = True
        if self.is_mounted:
            self._refresh()

    def _refresh(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for r in self.rows:
            if r.error:
                dash = Text("—", justify="right", style="red")
                table.add_row(Text(r.mode, style="red"), *[dash] * 8)
                continue
            table.add_row(
                Text(r.mode), Text(f"{r.context:,}", justify="right"),
                Text(fmt_seconds_ms(r.ttft), justify="right"), Text(fmt_rate(r.prefill_tps), justify="right"),
                Text(fmt_rate(r.decode_tps), justify="right"), Text(str(r.generated), justify="right"),
                Text(fmt_bytes(r.kv_held), justify="right"), Text(fmt_bytes(r.kv_allocated), justify="right"),
                Text(r.route, style="dim" if r.route == "fused" else "yellow"),
            )
        status = self.query_one("#compare-status", Static)
        if self.done:
            ok = [r for r in self.rows if not r.error]
            if not self.rows:
                status.update(Text("nothing to compare: send a message first", style="italic"))
            else:
                status.update(Text(f"done: {len(ok)} of {len(self.rows)} modes ran; same context, greedy",
                                   style="dim"))
        else:
            status.update(Text(f"running… {len(self.rows)} of {len(self.modes)} modes", style="italic"))
        self.query_one("#compare-chart", Static).update(self.chart(self.rows, self.size.width or 60))
        errors = Text()
        for r in self.rows:
            if r.error:
                errors.append(f"{r.mode} failed: ", style="bold red")
                errors.append(printable(" ".join(r.error.splitlines())) + "\n")
        errors.rstrip()
        self.query_one("#compare-errors", Static).update(errors)

    @staticmethod
    def chart(rows: Sequence[Any], width: int) -> Text:
        """Two bar charts: decode tok/s (longer is better) and TTFT (shorter is better)."""
        ok = [r for r in rows if not r.error]
        out = Text(no_wrap=True, overflow="ellipsis")
        if not ok:
            return out
        mw = max(len(r.mode) for r in ok)
        bar_w = max(8, min(50, width - mw - 20))
        for title, key, fmt in (("decode tok/s (longer is faster)", "decode_tps", fmt_rate),
                                ("TTFT (shorter is faster)", "ttft", fmt_seconds_ms)):
            top = max(getattr(r, key) for r in ok)
            out.append(title + "\n", style="bold")
            for r in ok:
                v = getattr(r, key)
                out.append(r.mode.ljust(mw) + " ", style="dim")
                out.append(hbar(v, top, bar_w), style="bold")
                out.append(" " + fmt(v) + "\n")
        out.rstrip()
        return out


class SessionsScreen(ModalScreen):
    """Saved conversations, latest first: open (resume), rename, delete.

    ``load()`` returns ``(rows, message)``: the store's ``ConversationInfo`` rows and a line to
    show when there are none or the store cannot be read. The actions call back into the app
    (``on_open(id)``, ``on_rename(id, title)``, ``on_delete(id)``), which runs them on the engine
    thread and calls :meth:`reload` when they are done.
    """

    BINDINGS = [
        Binding("escape,q,f7", "dismiss", "Close"),
        Binding("enter,o", "open", "Open", priority=True),
        Binding("r", "rename", "Rename"),
        Binding("d,delete", "delete", "Delete"),
        Binding("slash,s,ctrl+f", "search", "Search"),
    ]

    def __init__(self, load: Callable[[], tuple[list[Any], str]], on_open: Callable[[int], Any],
                 on_rename: Callable[[int, str], Any], on_delete: Callable[[int], Any],
                 current: int | None = None) -> None:
        super().__init__()
        self._load = load
        self.on_open = on_open
        self.on_rename = on_rename
        self.on_delete = on_delete
        self.current = current
        self.rows: list[Any] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions-box", classes="dialog"):
            yield Static(Text("Saved conversations", style="bold"), markup=False)
            yield DataTable(id="sessions-table", zebra_stripes=True, cursor_type="row")
            yield Static("", id="sessions-status", markup=False)
            yield Static(Text("Enter opens (resumes) · / searches · r renames · d deletes · Esc closes", style="dim"),
                         classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("id", "title", "updated", "messages", "model")
        self.reload()
        table.focus()

    def reload(self) -> None:
        rows, message = self._load()
        self.rows = list(rows)
        table = self.query_one(DataTable)
        old = table.cursor_row
        table.clear()
        for c in self.rows:
            mark = " ●" if c.id == self.current else ""
            table.add_row(Text(f"{c.id}{mark}", justify="right"), Text(printable(c.title or "(untitled)")),
                          Text(fmt_when(c.updated)), Text(str(c.messages), justify="right"),
                          Text(printable(model_label(c.model_id)), style="dim"), key=str(c.id))
        if self.rows:
            table.move_cursor(row=min(max(old, 0), len(self.rows) - 1))
        status = message or (f"{len(self.rows)} conversation{'s' if len(self.rows) != 1 else ''}"
                             + ("; ● is the one on screen" if any(c.id == self.current for c in self.rows) else ""))
        self.query_one("#sessions-status", Static).update(Text(status, style="dim"))

    def selected(self) -> Any | None:
        table = self.query_one(DataTable)
        if not self.rows or table.cursor_row < 0 or table.cursor_row >= len(self.rows):
            return None
        return self.rows[table.cursor_row]

    def select(self, conversation_id: int) -> bool:
        """Move the cursor to a conversation (tests, and after a rename)."""
        for i, c in enumerate(self.rows):
            if c.id == conversation_id:
                self.query_one(DataTable).move_cursor(row=i)
                return True
        return False

    @on(DataTable.RowSelected)
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_open()

    def action_open(self) -> None:
        c = self.selected()
        if c is None:
            return
        self.dismiss()
        self.on_open(c.id)

    def action_search(self) -> None:
        from .search_screen import open_search

        open_search(self, self.app.engine.bridge.data_dir(), self.on_open)

    def action_rename(self) -> None:
        c = self.selected()
        if c is None:
            return

        def done(title: str | None) -> None:
            if title:
                self.on_rename(c.id, title)

        self.app.push_screen(RenameDialog(c.title), done)

    def action_delete(self) -> None:
        c = self.selected()
        if c is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.on_delete(c.id)

        self.app.push_screen(ConfirmDialog(f"Delete conversation {c.id} “{c.title or '(untitled)'}” and its "
                                           f"{c.messages} messages? This cannot be undone."), done)


class RenameDialog(ModalScreen[str | None]):
    """A new name for a conversation; Enter renames, Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.title_text = title

    def compose(self) -> ComposeResult:
        with Vertical(id="rename-box", classes="dialog"):
            yield Static(Text("Rename conversation", style="bold"), markup=False)
            yield Input(self.title_text, id="rename-input", compact=True)
            yield Static(Text("Enter renames · Esc cancels", style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        title = event.value.strip()
        if not title:
            self.notify("the name is empty", severity="warning", markup=False)
            return
        self.dismiss(title)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """Yes / no; y or Enter confirms, n or Esc cancels."""

    BINDINGS = [Binding("y", "yes", "Yes"), Binding("n,escape", "no", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box", classes="dialog"):
            yield Static(Text(printable(self.question)), markup=False)
            with Horizontal(id="confirm-buttons"):
                yield Button("Delete", variant="error", id="yes", compact=True)
                yield Button("Cancel", id="no", compact=True)

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed, "#yes")
    def action_yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def action_no(self) -> None:
        self.dismiss(False)
