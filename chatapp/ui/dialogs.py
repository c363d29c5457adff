"""The comfort dialogs: copy a message or code block, export, system prompt, switch model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, OptionList, Select, Static, TextArea
from textual.widgets.option_list import Option

from chatapp.textsafe import printable

from .clipboard import OSC52_NOTE, Copyable


class CopyDialog(ModalScreen[str | None]):
    """Every message and code block, the newest first; Enter copies the chosen one."""

    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, items: Sequence[Copyable]) -> None:
        super().__init__()
        self.items = list(items)

    def compose(self) -> ComposeResult:
        with Vertical(id="copy-box", classes="dialog"):
            yield Static(Text("Copy to the clipboard", style="bold"), markup=False)
            yield OptionList(*[Option(Text(printable(c.label), style="italic" if c.kind == "code" else ""),
                                      id=str(i)) for i, c in enumerate(self.items)], id="copy-list")
            yield Static(Text(OSC52_NOTE, style="dim"), markup=False, id="copy-note")
            yield Static(Text("Enter copies · Esc closes", style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.items[int(event.option.id)].text)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ExportDialog(ModalScreen[None]):
    """Write the open conversation to a file, as Markdown or JSON; an error stays in the dialog."""

    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, default_stem: str, write: Callable[[str, Path], str]) -> None:
        super().__init__()
        self.default_stem = default_stem
        self.write = write  # (format, path) -> "" when written, else the one-line error
        self.written: Path | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="export-box", classes="dialog"):
            yield Static(Text("Export the conversation", style="bold"), markup=False)
            yield Select([("Markdown", "markdown"), ("JSON", "json")], value="markdown", allow_blank=False,
                         id="export-format", compact=True)
            yield Input(str(Path.cwd() / f"{self.default_stem}.md"), id="export-path", compact=True)
            yield Static("", id="export-error", markup=False)
            yield Static(Text("Enter writes · Esc closes", style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Select.Changed, "#export-format")
    def _format_changed(self, event: Select.Changed) -> None:
        box = self.query_one(Input)
        path = Path(box.value)
        suffix = ".json" if event.value == "json" else ".md"
        if path.suffix in (".md", ".json"):
            box.value = str(path.with_suffix(suffix))

    @on(Input.Submitted, "#export-path")
    def action_write(self) -> None:
        fmt = self.query_one(Select).value
        raw = self.query_one(Input).value.strip()
        error = "give a file name" if not raw else self.write(str(fmt), Path(raw).expanduser())
        if error:
            self.query_one("#export-error", Static).update(Text(printable(error), style="bold red"))
            return
        self.written = Path(raw).expanduser()
        self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class SystemPromptDialog(ModalScreen[str | None]):
    """Edit this conversation's system prompt; Ctrl+S applies ("" removes it), Esc cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "apply", "Apply", priority=True)]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="system-box", classes="dialog"):
            yield Static(Text("System prompt of this conversation", style="bold"), markup=False)
            yield TextArea(self.text, id="system-text", soft_wrap=True, show_line_numbers=False)
            yield Static(Text("Every later token attends to the system prompt: changing it re-prefills the "
                              "conversation on the next turn (a system prompt used before starts warm from "
                              "the prefix store).", style="dim"), markup=False)
            with Horizontal(id="system-buttons"):
                yield Button("Apply", variant="primary", id="apply", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
            yield Static(Text("Ctrl+S applies · Esc cancels", style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    @on(Button.Pressed, "#apply")
    def action_apply(self) -> None:
        self.dismiss(self.query_one(TextArea).text)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelDialog(ModalScreen[str | None]):
    """Choose the model to switch to: a recent one, or a path / repo id / .gguf file typed in.

    The dialog stays open while the model loads; a model that does not load shows its error
    here in one line (:meth:`failed`) and the old model stays in use."""

    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, current: str, recent: Sequence[str], on_choose: Callable[[str], Any]) -> None:
        super().__init__()
        self.current = current
        self.recent = [r for r in recent if r]
        self.on_choose = on_choose
        # the model being loaded ("" when none); not ``loading``, Textual's reactive that covers
        # the widget with a spinner and hid this dialog's status lines
        self.loading_spec = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="model-box", classes="dialog"):
            yield Static(Text.assemble(("Switch model", "bold"), ("   now: ", "dim"), printable(self.current)),
                         markup=False)
            yield Input("", placeholder="a model folder, a Hugging Face repo id, or a .gguf file",
                        id="model-input", compact=True)
            yield OptionList(*[Option(printable(r), id=str(i)) for i, r in enumerate(self.recent)], id="model-recent")
            yield Static("", id="model-status", markup=False)
            yield Static(Text("Enter loads · ↓ recent models · the conversation is kept and re-prefilled on "
                              "the new model · Esc closes", style="dim"), classes="dialog-hint", markup=False)

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    @on(Input.Submitted, "#model-input")
    def _typed(self, event: Input.Submitted) -> None:
        self.choose(event.value)

    @on(OptionList.OptionSelected, "#model-recent")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        self.choose(self.recent[int(event.option.id)])

    def choose(self, spec: str) -> None:
        spec = spec.strip()
        if self.loading_spec:
            self.notify(f"still loading {self.loading_spec}", severity="warning", markup=False)
            return
        if not spec:
            self.failed("give a model: a local folder, a Hugging Face repo id or a .gguf file")
            return
        self.loading_spec = spec
        self.query_one("#model-status", Static).update(Text(f"loading {printable(spec)}…", style="italic"))
        self.on_choose(spec)

    def progress(self, detail: str) -> None:
        """A line from the load under way (the kernels compiling), under the model's name."""
        if self.loading_spec:
            self.query_one("#model-status", Static).update(
                Text(f"loading {printable(self.loading_spec)}…\n{printable(detail)}", style="italic"))

    def failed(self, line: str) -> None:
        self.loading_spec = ""
        self.query_one("#model-status", Static).update(Text(printable(line), style="bold red"))

    def action_cancel(self) -> None:
        self.dismiss(None)


__all__ = ["CopyDialog", "ExportDialog", "ModelDialog", "SystemPromptDialog"]
