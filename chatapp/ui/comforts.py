"""The everyday comforts of the chat app, as a part the app holds (``ChatApp.comforts``): copy
(the last reply, a code block, any message), export, themes remembered, the system prompt of
the conversation, and switching the model without leaving the app.

:class:`Comforts` owns its state (the model dialog) and reaches the app only through
:class:`ComfortHost`, the app's public face it needs (notifications, screens, the clipboard,
``refuse_busy``) and its two other parts: the transcript mirror (``host.transcript``: the entries,
the system prompt shown) and the engine client as :class:`EngineView` (``host.engine``: the
conversation's id and title, the model, the session as last described, ``submit``, ...): no
private name of the app, and no attribute it merely hopes the app has. The app keeps the
bindings (Textual looks actions up on the app) and its ``action_*`` methods delegate here. Engine
work (the system prompt, the model switch) is a typed request (``SetSystemPrompt``,
``SwitchModel``); its result comes back as its own message (``ui/messages.py``), whose handler on
the engine client (``ui/engine_link.py``) calls :meth:`Comforts.system_changed` /
:meth:`Comforts.model_switched`.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from textual.app import SystemCommand
from textual.binding import Binding

from chatapp.engine.events import ModelSwitch, SessionInfo, SystemChange
from chatapp.engine.requests import Request, SetSystemPrompt, SwitchModel

from .clipboard import copyables, last_code_block, last_reply
from .dialogs import CopyDialog, ExportDialog, ModelDialog, SystemPromptDialog
from .transcript import Transcript

COMFORT_BINDINGS = [
    Binding("f8", "copy_last_reply", "Copy", show=False),
    Binding("f9", "copy_dialog", "Copy…", show=False),
    Binding("ctrl+s", "export", "Export", show=False),
    Binding("f10", "system_prompt", "System", show=False),
    Binding("f12", "switch_model", "Model", show=False),
]
COMFORT_ACTIONS = frozenset({"copy_last_reply", "copy_code", "copy_dialog", "export", "system_prompt",
                             "switch_model"})
#: (key, what it does) for the help screen and docs/tui.md
COMFORT_KEYS = [
    ("F8", "copy the last reply to the clipboard (OSC 52)"),
    ("F9", "copy a message or a code block (a list, newest first)"),
    ("Ctrl+S", "export the conversation as Markdown or JSON"),
    ("F10", "system prompt of this conversation"),
    ("F12", "switch model (the conversation is kept and re-prefilled)"),
]
RECENT_MODELS = 8


class EngineView(Protocol):
    """What the comforts use of the engine client (``ChatApp.engine``, ui/engine_link.py): the
    conversation and the model on screen, the session as last described, and its requests."""

    conversation_id: int | None
    conversation_title: str
    model_id: str  # a model switch sets it
    info: SessionInfo | None
    store_notes: list[tuple[str, str]]
    loaded: bool

    def submit(self, request: Request) -> None: ...
    def set_phase(self, phase: str) -> None: ...
    def notice(self, note: str) -> None: ...
    def show_session(self, info: SessionInfo | None) -> None: ...


class ComfortHost(Protocol):
    """What the comforts use of the app (``ChatApp``): public names only, and its parts."""

    config: Any  # a model switch replaces it
    transcript: Transcript  # the messages on screen (ui/transcript.py)
    engine: EngineView

    def notify(self, message: str, **kwargs: Any) -> None: ...
    def copy_to_clipboard(self, text: str) -> None: ...
    def push_screen(self, screen: Any, callback: Callable[[Any], Any] | None = None) -> Any: ...
    def refuse_busy(self, what: str) -> bool: ...


class Comforts:
    """The comfort actions and the results of their engine requests; ``host`` is the app."""

    def __init__(self, host: ComfortHost, data_dir: Callable[[], Path]) -> None:
        self.host = host
        self._data_dir = data_dir  # where the saved conversations are (the recent models' list)
        self.model_dialog: ModelDialog | None = None  # open while a switch may report into it

    # ---- copy -----------------------------------------------------------------------------------
    def _copy(self, text: str | None, what: str) -> None:
        if not text:
            self.host.notify(f"nothing to copy: no {what} yet", markup=False, timeout=3)
            return
        self.host.copy_to_clipboard(text)
        self.host.notify(f"copied {what} ({len(text):,} characters) to the clipboard (OSC 52)", markup=False,
                         timeout=3)

    def copy_last_reply(self) -> None:
        self._copy(last_reply(self.host.transcript.entries), "the last reply")

    def copy_code(self) -> None:
        self._copy(last_code_block(self.host.transcript.entries), "code block")

    def copy_dialog(self) -> None:
        items = copyables(self.host.transcript.entries)
        if not items:
            self.host.notify("nothing to copy yet", markup=False, timeout=3)
            return
        self.host.push_screen(CopyDialog(items), lambda text: self._copy(text, "the selection") if text else None)

    # ---- export ---------------------------------------------------------------------------------
    def export_text(self, fmt: str) -> str:
        """The conversation on screen as ``chatapp sessions export`` writes it."""
        from chatapp.store.db import ConversationInfo, StoredMessage
        from chatapp.store.export import to_json, to_markdown

        engine, entries, now = self.host.engine, self.host.transcript.entries, time.time()
        info = ConversationInfo(engine.conversation_id or 0, engine.conversation_title, engine.model_id, "", "",
                                engine.info.fmt if engine.info else "", now, now, len(entries), 0)
        msgs = [StoredMessage(i, e.role, e.text,
                              "interrupted" if e.widget is not None and e.widget.has_class("interrupted")
                              else "complete", now, now)
                for i, e in enumerate(entries)]
        return to_markdown(info, msgs) if fmt == "markdown" else to_json(info, msgs)

    def _export_to(self, fmt: str, path: Path) -> str:
        try:
            if path.is_dir():
                return f"{path} is a folder: give a file name"
            path.write_text(self.export_text(fmt), encoding="utf-8")
        except OSError as e:
            return f"cannot write {path}: {e.strerror or e}"
        self.host.notify(f"exported the conversation to {path}", markup=False, timeout=5)
        return ""

    def export(self) -> None:
        host, engine = self.host, self.host.engine
        if not host.transcript.entries:
            host.notify("nothing to export yet", markup=False, timeout=3)
            return
        slug = re.sub(r"[^A-Za-z0-9]+", "-", engine.conversation_title or "").strip("-").lower()[:40]
        stem = "chatapp-" + (str(engine.conversation_id) if engine.conversation_id else "chat") + (
            f"-{slug}" if slug else "")
        host.push_screen(ExportDialog(stem, self._export_to))

    # ---- themes ---------------------------------------------------------------------------------
    def theme_changed(self, name: str) -> None:
        """A theme chosen from the palette ("Change theme") is remembered in the user config."""
        host = self.host
        if not host.engine.loaded or name == host.config.ui.theme:
            return
        from chatapp.config_write import ConfigWriteError, remember

        try:
            path = remember("ui", "theme", name)
        except ConfigWriteError as e:
            host.notify(f"theme {name}: not remembered ({e})", severity="warning", markup=False)
            return
        host.config.ui.theme = name
        host.notify(f"theme {name}, remembered in {path}", markup=False, timeout=3)

    # ---- system prompt --------------------------------------------------------------------------
    def system_prompt(self) -> None:
        if self.host.refuse_busy("system prompt"):
            return
        current = next((e.text for e in self.host.transcript.entries[:1] if e.role == "system"), "")

        def done(text: str | None) -> None:
            if text is not None:
                self.set_system_prompt(text)

        self.host.push_screen(SystemPromptDialog(current), done)

    def set_system_prompt(self, text: str) -> None:
        self.host.engine.submit(SetSystemPrompt(text))  # SystemChange brings the session's description

    async def system_changed(self, change: SystemChange) -> None:
        """The engine set the system prompt: the config keeps it (Ctrl+N keeps it, as the session
        does) and the transcript shows it."""
        host = self.host
        host.notify(change.line(), title="system prompt", markup=False, timeout=8)
        if not change.changed:
            return
        host.config.chat.system = change.text
        await host.transcript.show_system_prompt(change.text)
        host.engine.show_session(change.info)

    # ---- switch model ---------------------------------------------------------------------------
    def recent_models(self) -> list[str]:
        """Models of the saved conversations (latest first), then .gguf files in the current folder."""
        from chatapp.store import ChatStore, StoreError

        seen: list[str] = []
        try:
            with ChatStore.open(self._data_dir(), write=False) as store:
                for c in store.list_conversations():
                    if c.model_spec and c.model_spec not in seen:
                        seen.append(c.model_spec)
        except (StoreError, OSError):
            pass
        try:
            seen += sorted(str(p) for p in Path.cwd().glob("*.gguf") if str(p) not in seen)
        except OSError:
            pass
        current = self.host.config.model.id
        return [s for s in seen if s != current][:RECENT_MODELS]

    def open_model_dialog(self) -> None:
        if self.host.refuse_busy("switch model"):
            return
        self.model_dialog = ModelDialog(self.host.engine.model_id, self.recent_models(), self.switch_model)
        self.host.push_screen(self.model_dialog)

    def switch_model(self, spec: str) -> None:
        """Load ``spec`` and move the conversation onto it (engine thread); the old model stays on failure."""
        if self.host.refuse_busy("switch model"):
            dialog = self.model_dialog
            if dialog is not None and dialog.is_attached:  # let the dialog take another Enter
                dialog.failed("not switched: wait for the reply to finish (Esc stops it), then press Enter again")
            return
        self.host.engine.submit(SwitchModel(spec))  # ModelSwitch brings the new session's description
        self.host.engine.set_phase(f"loading {spec}")

    def model_progress(self, detail: str) -> bool:
        """A switch compiling the new model's kernels: shown in the dialog; False when none is open."""
        if self.model_dialog is None:
            return False
        self.model_dialog.progress(detail)
        return True

    async def model_switched(self, result: ModelSwitch) -> None:
        host, dialog = self.host, self.model_dialog
        host.engine.set_phase("")
        if not result.ok:
            if dialog is not None and dialog.is_attached:
                dialog.failed(result.line())
            else:
                host.notify(result.line(), severity="error", markup=False, timeout=10)
            return
        host.config = result.config if result.config is not None else host.config
        host.engine.model_id = result.model_id
        host.engine.store_notes.append(("note", result.line()))
        if dialog is not None and dialog.is_attached:
            dialog.dismiss(None)
        self.model_dialog = None
        host.notify(result.line(), title="model switched", markup=False, timeout=12)
        for note in result.notes:
            host.engine.notice(note)
        host.engine.show_session(result.info)

    # ---- the command palette ----------------------------------------------------------------------
    def commands(self) -> Iterable[SystemCommand]:
        yield SystemCommand("Copy the last reply", "F8: to the clipboard (OSC 52)", self.copy_last_reply)
        yield SystemCommand("Copy the last code block", "the last fenced block of the replies", self.copy_code)
        yield SystemCommand("Copy a message or code block…", "F9: choose what to copy", self.copy_dialog)
        yield SystemCommand("Export the conversation…", "Ctrl+S: Markdown or JSON, to a file", self.export)
        yield SystemCommand("System prompt…", "F10: this conversation's system prompt", self.system_prompt)
        yield SystemCommand("Switch model…", "F12: load another model and keep the conversation",
                            self.open_model_dialog)


__all__ = ["COMFORT_ACTIONS", "COMFORT_BINDINGS", "COMFORT_KEYS", "ComfortHost", "Comforts"]
