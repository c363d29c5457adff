"""The everyday comforts of the chat app, as a mixin of :class:`chatapp.ui.app.ChatApp`:
copy (the last reply, a code block, any message), export, themes remembered, the system
prompt of the conversation, and switching the model without leaving the app.

Kept out of app.py so that the app only lists the bindings and palette entries. Engine work
(the system prompt, the model switch) is a typed request (``SetSystemPrompt``, ``SwitchModel``);
its result comes back as its own message (``ui/messages.py``), whose ``@on`` handler in
``ui/engine_link.py`` calls ``_system_changed`` / ``_model_switched`` here.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path
from typing import Iterable

from textual.app import SystemCommand
from textual.binding import Binding

from chatapp.engine.requests import SetSystemPrompt, SwitchModel

from .clipboard import copyables, last_code_block, last_reply
from .dialogs import CopyDialog, ExportDialog, ModelDialog, SystemPromptDialog
from .widgets import ChatView, SystemMessage

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


class ComfortActions:
    """Mixed into ChatApp (which provides bridge, entries, config, notify, ...)."""

    model_dialog: ModelDialog | None = None

    # ---- copy -----------------------------------------------------------------------------------
    def _copy(self, text: str | None, what: str) -> None:
        if not text:
            self.notify(f"nothing to copy: no {what} yet", markup=False, timeout=3)
            return
        self.copy_to_clipboard(text)
        self.notify(f"copied {what} ({len(text):,} characters) to the clipboard (OSC 52)", markup=False, timeout=3)

    def action_copy_last_reply(self) -> None:
        self._copy(last_reply(self.entries), "the last reply")

    def action_copy_code(self) -> None:
        self._copy(last_code_block(self.entries), "code block")

    def action_copy_dialog(self) -> None:
        items = copyables(self.entries)
        if not items:
            self.notify("nothing to copy yet", markup=False, timeout=3)
            return
        self.push_screen(CopyDialog(items), lambda text: self._copy(text, "the selection") if text else None)

    # ---- export ---------------------------------------------------------------------------------
    def export_text(self, fmt: str) -> str:
        """The conversation on screen as ``chatapp sessions export`` writes it."""
        from chatapp.store.db import ConversationInfo, StoredMessage
        from chatapp.store.export import to_json, to_markdown

        now = time.time()
        info = ConversationInfo(self.conversation_id or 0, self.conversation_title, self.model_id, "", "",
                                self.info.fmt if self.info else "", now, now, len(self.entries), 0)
        msgs = [StoredMessage(i, e.role, e.text,
                              "interrupted" if e.widget is not None and e.widget.has_class("interrupted")
                              else "complete", now, now)
                for i, e in enumerate(self.entries)]
        return to_markdown(info, msgs) if fmt == "markdown" else to_json(info, msgs)

    def _export_to(self, fmt: str, path: Path) -> str:
        try:
            if path.is_dir():
                return f"{path} is a folder: give a file name"
            path.write_text(self.export_text(fmt), encoding="utf-8")
        except OSError as e:
            return f"cannot write {path}: {e.strerror or e}"
        self.notify(f"exported the conversation to {path}", markup=False, timeout=5)
        return ""

    def action_export(self) -> None:
        if not self.entries:
            self.notify("nothing to export yet", markup=False, timeout=3)
            return
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.conversation_title or "").strip("-").lower()[:40]
        stem = "chatapp-" + (str(self.conversation_id) if self.conversation_id else "chat") + (f"-{slug}" if slug
                                                                                             else "")
        self.push_screen(ExportDialog(stem, self._export_to))

    # ---- themes ---------------------------------------------------------------------------------
    def watch_theme(self, name: str) -> None:
        """A theme chosen from the palette ("Change theme") is remembered in the user config."""
        if not getattr(self, "loaded", False) or name == self.config.ui.theme:
            return
        from chatapp.config_write import ConfigWriteError, remember

        try:
            path = remember("ui", "theme", name)
        except ConfigWriteError as e:
            self.notify(f"theme {name}: not remembered ({e})", severity="warning", markup=False)
            return
        self.config.ui.theme = name
        self.notify(f"theme {name}, remembered in {path}", markup=False, timeout=3)

    # ---- system prompt --------------------------------------------------------------------------
    def action_system_prompt(self) -> None:
        if self._refuse_busy("system prompt"):
            return
        current = next((e.text for e in self.entries[:1] if e.role == "system"), "")

        def done(text: str | None) -> None:
            if text is not None:
                self.set_system_prompt(text)

        self.push_screen(SystemPromptDialog(current), done)

    def set_system_prompt(self, text: str) -> None:
        self.submit(SetSystemPrompt(text))  # SystemChange brings the session's description

    async def _system_changed(self, change) -> None:
        self.notify(change.line(), title="system prompt", markup=False, timeout=8)
        if not change.changed:
            return
        self.config.chat.system = change.text  # Ctrl+N keeps it, as the session does
        chat = self.query_one(ChatView)
        first = self.entries[0] if self.entries else None
        if first is not None and first.role == "system":
            if change.text:
                first.text = change.text
                if first.widget is not None:
                    first.widget.set_text(change.text)
            else:
                self.entries.pop(0)
                if first.widget is not None and first.widget.is_attached:
                    await first.widget.remove()
        elif change.text:
            widget = SystemMessage(change.text, 0)
            if first is None:
                await self._add_message(widget, "system")
            else:
                self.entries.insert(0, dataclasses.replace(first, role="system", text=change.text, widget=widget))
                await chat.mount(widget, before=chat.children[0] if chat.children else None)
        for i, e in enumerate(self.entries):
            if e.widget is not None:
                e.widget.conv_index = i
        self._describe(change.info)

    # ---- switch model ---------------------------------------------------------------------------
    def recent_models(self) -> list[str]:
        """Models of the saved conversations (latest first), then .gguf files in the current folder."""
        from chatapp.store import ChatStore, StoreError

        seen: list[str] = []
        try:
            with ChatStore.open(self.bridge.data_dir(), write=False) as store:
                for c in store.list_conversations():
                    if c.model_spec and c.model_spec not in seen:
                        seen.append(c.model_spec)
        except (StoreError, OSError):
            pass
        try:
            seen += sorted(str(p) for p in Path.cwd().glob("*.gguf") if str(p) not in seen)
        except OSError:
            pass
        current = self.config.model.id
        return [s for s in seen if s != current][:RECENT_MODELS]

    def action_switch_model(self) -> None:
        if self._refuse_busy("switch model"):
            return
        self.model_dialog = ModelDialog(self.model_id, self.recent_models(), self.switch_model)
        self.push_screen(self.model_dialog)

    def switch_model(self, spec: str) -> None:
        """Load ``spec`` and move the conversation onto it (engine thread); the old model stays on failure."""
        if self._refuse_busy("switch model"):
            dialog = self.model_dialog
            if dialog is not None and dialog.is_attached:  # let the dialog take another Enter
                dialog.failed("not switched: wait for the reply to finish (Esc stops it), then press Enter again")
            return
        self.submit(SwitchModel(spec))  # ModelSwitch brings the new session's description
        self.phase = f"loading {spec}"
        self._update_status()

    async def _model_switched(self, result) -> None:
        self.phase = ""
        dialog = self.model_dialog
        if not result.ok:
            if dialog is not None and dialog.is_attached:
                dialog.failed(result.line())
            else:
                self.notify(result.line(), severity="error", markup=False, timeout=10)
            return
        self.config = result.config if result.config is not None else self.config
        self.model_id = result.model_id
        self.store_notes.append(("note", result.line()))
        if dialog is not None and dialog.is_attached:
            dialog.dismiss(None)
        self.model_dialog = None
        self.notify(result.line(), title="model switched", markup=False, timeout=12)
        for note in result.notes:
            self._notice(note)
        self._describe(result.info)

    # ---- the command palette ----------------------------------------------------------------------
    def comfort_commands(self) -> Iterable[SystemCommand]:
        yield SystemCommand("Copy the last reply", "F8: to the clipboard (OSC 52)", self.action_copy_last_reply)
        yield SystemCommand("Copy the last code block", "the last fenced block of the replies",
                            self.action_copy_code)
        yield SystemCommand("Copy a message or code block…", "F9: choose what to copy", self.action_copy_dialog)
        yield SystemCommand("Export the conversation…", "Ctrl+S: Markdown or JSON, to a file", self.action_export)
        yield SystemCommand("System prompt…", "F10: this conversation's system prompt", self.action_system_prompt)
        yield SystemCommand("Switch model…", "F12: load another model and keep the conversation",
                            self.action_switch_model)


__all__ = ["COMFORT_ACTIONS", "COMFORT_BINDINGS", "COMFORT_KEYS", "ComfortActions"]
