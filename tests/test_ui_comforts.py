"""The comforts (ui/comforts.py): copy, export, themes remembered, the system-prompt dialog and
switching the model. Pilot tests on the real stories260K models (skipped without ../shared)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

pytest.importorskip("textual")

from test_ui import async_test, make_app, ready, screen_text, turn, wait_until  # noqa: E402

from chatapp.backend.warmup import compiling_line  # noqa: E402
from chatapp.config import user_config_path  # noqa: E402
from chatapp.config_write import remember, with_value  # noqa: E402
from chatapp.engine.events import LoadProgress  # noqa: E402
from chatapp.store import ChatStore  # noqa: E402
from chatapp.ui.clipboard import code_blocks, copyables, last_code_block  # noqa: E402
from chatapp.ui.dialogs import CopyDialog, ExportDialog, ModelDialog, SystemPromptDialog  # noqa: E402

pytestmark = pytest.mark.shared


class E:  # an entry of the transcript mirror
    def __init__(self, role, text):
        self.role, self.text, self.widget = role, text, None


class FakeHost:
    """The app as the comforts see it (ComfortHost, its parts as the comforts use them): a part
    can be exercised without Textual. Every call lands in ``calls``."""

    def __init__(self, entries, busy=False):
        from types import SimpleNamespace

        self.config = SimpleNamespace(chat=SimpleNamespace(system=""), model=SimpleNamespace(id="old"),
                                      ui=SimpleNamespace(theme="textual-dark"))
        self.busy = busy
        self.calls = []
        self.transcript = FakeTranscript(entries, self.calls)
        self.engine = FakeEngine(self.calls)

    def notify(self, message, **kwargs):
        self.calls.append(("notify", message))

    def copy_to_clipboard(self, text):
        self.calls.append(("copy", text))

    def push_screen(self, screen, callback=None):
        self.calls.append(("screen", type(screen).__name__))

    def refuse_busy(self, what):
        return self.busy


class FakeTranscript:
    """The transcript mirror as the comforts use it (``host.transcript``)."""

    def __init__(self, entries, calls):
        self.entries, self.calls = entries, calls

    async def show_system_prompt(self, text):
        self.calls.append(("system", text))


class FakeEngine:
    """The engine client as the comforts use it (``host.engine``, comforts.EngineView)."""

    def __init__(self, calls):
        self.calls = calls
        self.conversation_id, self.conversation_title, self.model_id = 7, "Cats", "old"
        self.info, self.store_notes, self.loaded = None, [], True

    def submit(self, request):
        self.calls.append(("submit", request))

    def set_phase(self, phase):
        self.calls.append(("phase", phase))

    def notice(self, note):
        self.calls.append(("notice", note))

    def show_session(self, info):
        self.calls.append(("session", info))


def test_the_comforts_are_a_part_that_reaches_the_app_only_through_its_host():
    """Comforts owns its state (the model dialog) and uses only the host's public face: copy,
    export, the system prompt and a model switch's result, with no Textual app behind it."""
    import asyncio

    from chatapp.engine.events import ModelSwitch, SystemChange
    from chatapp.engine.requests import SetSystemPrompt, SwitchModel
    from chatapp.ui.comforts import Comforts

    host = FakeHost([E("user", "hi"), E("assistant", "```\nls\n```")])
    comforts = Comforts(host, data_dir=lambda: "/nonexistent")
    comforts.copy_last_reply()
    comforts.copy_code()
    assert ("copy", "```\nls\n```") in host.calls and ("copy", "ls\n") in host.calls
    assert "# Cats" in comforts.export_text("markdown") and json.loads(comforts.export_text("json"))
    comforts.export()
    assert host.calls[-1] == ("screen", "ExportDialog")
    comforts.set_system_prompt("Be brief.")
    comforts.switch_model("new")
    assert ("submit", SetSystemPrompt("Be brief.")) in host.calls and ("submit", SwitchModel("new")) in host.calls
    assert ("phase", "loading new") in host.calls and comforts.model_dialog is None
    asyncio.run(comforts.system_changed(SystemChange("Be brief.", changed=True)))
    assert host.config.chat.system == "Be brief." and ("system", "Be brief.") in host.calls
    asyncio.run(comforts.model_switched(ModelSwitch("new", ok=True, model_id="new", notes=["n"])))
    assert host.engine.model_id == "new" and host.engine.store_notes and ("notice", "n") in host.calls
    host.busy = True
    before = list(host.calls)
    comforts.switch_model("other")  # refused while busy: nothing sent
    assert host.calls == before


def test_code_blocks_and_copyables():
    reply = "Here:\n\n```python\nprint('hi')\n```\n\nand\n\n```\nls -l\n```\n"
    assert code_blocks(reply) == [("python", "print('hi')\n"), ("", "ls -l\n")]
    entries = [E("user", "show me"), E("assistant", reply)]
    assert last_code_block(entries) == "ls -l\n"
    items = copyables(entries)
    assert [i.kind for i in items] == ["message", "code", "code", "message"]
    assert items[1].label.startswith("  code block 1 (python)") and items[-1].text == "show me"


def test_with_value_changes_one_line_only(tmp_path):
    text = "# mine\n[model]\nid = \"x\"  # keep\n\n[ui]\n# comment\ntheme = \"nord\"\nshow_panel = true\n"
    assert with_value(text, "ui", "theme", "gruvbox") == text.replace('"nord"', '"gruvbox"')
    assert with_value("[model]\nid = \"x\"\n", "ui", "theme", "a\"b") == '[model]\nid = "x"\n\n[ui]\ntheme = "a\\"b"\n'
    assert with_value("[ui]\nshow_panel = false\n", "ui", "theme", "t") == '[ui]\ntheme = "t"\nshow_panel = false\n'
    path = tmp_path / "cfg" / "config.toml"
    remember("ui", "theme", "dracula", path)
    assert path.read_text() == '[ui]\ntheme = "dracula"\n'


@async_test
async def test_copy_export_and_theme(stories4_path, tmp_path, monkeypatch):
    # This test's own user config dir: the theme it chooses must not reach other tests' apps.
    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(tmp_path / "config"))
    app = make_app(stories4_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("f8")
        assert app.clipboard == ""  # nothing yet: a note says so
        await turn(pilot, "Tell me about a cat.")
        reply = app.transcript.entries[-1].text
        await pilot.press("f8")
        assert app.clipboard == reply and reply
        await pilot.press("f9")
        assert isinstance(app.screen, CopyDialog)
        await pilot.press("down", "enter")  # the newest first: the reply, then the user's message
        assert app.clipboard == "Tell me about a cat." and not isinstance(app.screen, CopyDialog)

        await pilot.press("ctrl+s")
        dialog = app.screen
        assert isinstance(dialog, ExportDialog)
        dialog.query_one("#export-path").value = str(tmp_path)  # a folder: refused in the dialog
        await pilot.press("enter")
        assert app.screen is dialog and "is a folder" in await screen_text(pilot)
        out = tmp_path / "chat.json"
        dialog.query_one("#export-format").value = "json"
        dialog.query_one("#export-path").value = str(out)
        await pilot.press("enter")
        assert not isinstance(app.screen, ExportDialog)
        data = json.loads(out.read_text())
        assert [(m["role"], m["content"]) for m in data["messages"]] == [("user", "Tell me about a cat."),
                                                                          ("assistant", reply)]

        app.theme = "nord"  # what the palette's "Change theme" does
        await pilot.pause()
        assert user_config_path() == tmp_path / "config" / "config.toml"
        assert 'theme = "nord"' in user_config_path().read_text()
        assert app.config.ui.theme == "nord"


@async_test
async def test_system_prompt_dialog_reprefills_and_warm_starts_from_the_prefix_store(stories4_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await turn(pilot, "Once upon a time")
        await pilot.press("f10")
        assert isinstance(app.screen, SystemPromptDialog)
        app.screen.query_one("#system-text").text = "You tell short stories about cats and dogs."
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: not app.engine.busy and app.transcript.entries[0].role == "system",
                         what="the change")
        assert [e.role for e in app.transcript.entries] == ["system", "user", "assistant"]
        assert app.transcript.entries[0].widget.cache_state == "pending"  # not prefilled until the next turn
        assert app.engine.bridge.chat.session.cached == []
        await turn(pilot, "The dog")
        stats = app.engine.last_stats
        assert stats.reused_tokens == 0 and stats.prefill_tokens == stats.prompt_tokens
        cid = app.engine.conversation_id or app.engine.bridge.chat.conversation_id
        with ChatStore.open(app.engine.bridge.data_dir(), write=False) as store:
            assert [m.role for m in store.messages(cid)][:2] == ["system", "user"]

        # Another conversation with the same system prompt: its first turn stored the system
        # prompt in the prefix store, so a new chat starts warm from it.
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.engine.busy, what="the new chat")
        await turn(pilot, "A bird")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.engine.busy, what="the new chat")
        assert app.transcript.entries[0].role == "system"  # kept for the new chat, as the session keeps it
        await turn(pilot, "A fish")
        assert app.engine.last_stats.prefix_tokens > 0


async def open_model_dialog(pilot) -> ModelDialog:
    """Wait for the model to load, then open the model dialog (F12)."""
    await ready(pilot)
    await pilot.press("f12")
    dialog = pilot.app.screen
    assert isinstance(dialog, ModelDialog)
    return dialog


@async_test
async def test_the_model_dialog_shows_the_kernels_compiling_during_a_switch(stories4_path):
    """A switch to a model whose kernels compile (a first start of its bits, group or K/V dtype)
    says so under the model's name, as the loading screen does at start; with no load under way
    the line is not shown."""
    app = make_app(stories4_path)
    async with app.run_test(size=(160, 30)) as pilot:
        dialog = await open_model_dialog(pilot)
        app.engine.bridge.on_event(LoadProgress("kernels", compiling_line(12)))
        await pilot.pause()
        assert "compiling the CPU" not in await screen_text(pilot)
        dialog.loading_spec = "other.gguf"  # as choose() leaves it while the worker loads
        app.engine.bridge.on_event(LoadProgress("kernels", compiling_line(12)))
        await pilot.pause()
        text = await screen_text(pilot)
        assert "loading other.gguf" in text and "compiling the CPU" in text and "12 s so far" in text


@async_test
async def test_a_switch_refused_while_busy_leaves_the_dialog_ready_for_another_try(stories4_path, stories_path,
                                                                                   monkeypatch):
    app = make_app(stories4_path)
    async with app.run_test(size=(100, 30)) as pilot:
        dialog = await open_model_dialog(pilot)
        monkeypatch.setattr(app, "refuse_busy", lambda what: True)  # as while a reply streams
        dialog.query_one("#model-input").value = str(stories_path)
        await pilot.press("enter")
        await pilot.pause()
        assert not dialog.loading_spec and "not switched" in await screen_text(pilot)
        monkeypatch.undo()
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.engine.busy
                         and (app.comforts.model_dialog is None or not dialog.loading_spec),
                         what="the switch")
        assert app.comforts.model_dialog is None and app.engine.model_id.endswith("stories260K")


@async_test
async def test_switch_model_keeps_the_conversation_and_survives_a_bad_path(stories4_path, stories_path, tmp_path):
    app = make_app(stories4_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await turn(pilot, "Once upon a time")
        before = [(e.role, e.text) for e in app.transcript.entries]
        old_session = weakref.ref(app.engine.bridge.chat.session)
        old_model = weakref.ref(app.engine.bridge.chat.session.model)
        dialog = await open_model_dialog(pilot)
        dialog.query_one("#model-input").value = str(tmp_path / "no-such-model")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not app.engine.busy and not dialog.loading_spec, what="the failed load")
        text = await screen_text(pilot)
        assert "cannot load" in text and app.screen is dialog
        assert app.engine.bridge.chat.session is old_session()
        assert [(e.role, e.text) for e in app.transcript.entries] == before

        dialog.query_one("#model-input").value = str(stories_path)
        await pilot.press("enter")
        # The switch has ended when its result is in: the dialog let go (loaded) or shows why not
        # (failed). A failed load fails here with its line, not as a wait for a dialog that stays.
        # (The switch compiles no kernels: neither stories model reaches them at load; 0.3 s.)
        await wait_until(pilot, lambda: not app.engine.busy
                         and (app.comforts.model_dialog is None or not dialog.loading_spec),
                         what="the switch")
        assert app.comforts.model_dialog is None, f"the switch failed:\n{await screen_text(pilot)}"
        await wait_until(pilot, lambda: not isinstance(app.screen, ModelDialog), what="the dialog to close")
        assert app.engine.model_id.endswith("stories260K") and app.engine.bridge.chat.session is not old_session()
        assert [(e.role, e.text) for e in app.transcript.entries] == before
        await wait_until(pilot, lambda: "old model released" in app.engine.store_notes[-1][1], what="the release")
        assert "switched to" in app.engine.store_notes[-2][1] and "re-prefilled" in app.engine.store_notes[-2][1]
        assert "MLX active memory" in app.engine.store_notes[-1][1]
        assert len(app.engine.bridge.chat.session.cached) > 0
        gc.collect()
        assert old_model() is None and old_session() is None  # the old model's memory was released
        await turn(pilot, "The end")
        assert app.engine.last_stats.reused_tokens > 0  # the re-prefilled conversation is reused
        cid = app.engine.bridge.chat.conversation_id
        with ChatStore.open(app.engine.bridge.data_dir(), write=False) as store:
            assert store.get(cid).model_spec == str(stories_path.resolve())
