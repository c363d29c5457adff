"""Cache knobs declared once (cache/settings.py): "auto" starts as one mode, written once; every
CacheSettings knob reaches ``/mode`` (kv_key_layout included) with its type and choices."""

from __future__ import annotations

import dataclasses

import pytest

from cache.settings import (
    AUTO,
    AUTO_STARTS_AS,
    KEY_LAYOUTS,
    MODES,
    CacheSettings,
    knob_choices,
    knob_types,
    starting_mode,
)
from chatapp.slash_commands import CACHE_KEYS, CommandError, apply_command, parse_line, validate_command


def test_auto_starts_as_one_mode_and_every_other_mode_as_itself():
    assert starting_mode(AUTO) == AUTO_STARTS_AS in MODES
    assert all(starting_mode(m) == m for m in MODES)


def test_every_settings_field_but_the_mode_is_a_knob_of_its_type():
    fields = {f.name: f for f in dataclasses.fields(CacheSettings)}
    knobs = knob_types()
    assert set(knobs) == set(fields) - {"mode"} and set(CACHE_KEYS) == set(knobs)
    assert knobs["kv_key_layout"] is str and knobs["window"] is int
    assert knob_choices("kv_key_layout") == KEY_LAYOUTS and knob_choices("window") is None


def test_mode_takes_kv_key_layout_and_refuses_a_layout_it_does_not_know():
    cmd = parse_line("/mode window-quant kv_key_layout=channel kv_bits=4")
    assert cmd.changes == {"kv_key_layout": "channel", "kv_bits": 4}
    with pytest.raises(CommandError, match=r"kv_key_layout: must be one of token, channel \(got 'row'\)"):
        parse_line("/mode window-quant kv_key_layout=row")
    with pytest.raises(CommandError, match="kv_bits: must be an integer"):
        parse_line("/mode window-quant kv_bits=four")


@pytest.mark.shared
def test_a_session_switches_its_key_layout_through_mode(stories):
    from chatapp.engine.session import Session

    model, tok = stories
    s = Session(model, tok, mode=AUTO)
    assert s.mode == AUTO_STARTS_AS and s.requested_mode == AUTO
    cmd = parse_line("/mode prealloc kv_key_layout=channel")
    validate_command(s, cmd)
    line = apply_command(s, cmd)
    assert line.startswith("cache mode prealloc")
    assert s.base_settings.kv_key_layout == "channel" and s.settings.kv_key_layout == "channel"


@pytest.mark.shared
def test_the_mode_dialog_switches_the_key_layout(stories4_path):
    """Pilot: F4's key-layout choice reaches the session (and comes back in its description)."""
    pytest.importorskip("textual")
    from test_ui import async_test, make_app, ready, wait_until

    from chatapp.ui.screens import ModeDialog

    @async_test
    async def run():
        app = make_app(stories4_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await ready(pilot)
            assert app.info.settings["kv_key_layout"] == "token"
            await pilot.press("f4")
            await wait_until(pilot, lambda: isinstance(app.screen, ModeDialog), what="the dialog")
            dialog = app.screen
            dialog.query_one("#mode-select").value = "prealloc"
            dialog.query_one("#f-kv_key_layout").value = "channel"
            await pilot.pause()
            dialog.action_apply()
            await wait_until(pilot, lambda: app.info.settings["kv_key_layout"] == "channel"
                             and not app.bridge.busy, what="the switch")
            assert app.info.mode == "prealloc"

    run()


def test_every_cache_knob_has_a_flag_that_reaches_the_config():
    """Each CacheSettings knob is a chat flag mapped to its [cache] key (kv_key_layout included)."""
    from chatapp.cli import FLAG_KEYS, build_parser, overrides_from

    for name in knob_types():
        assert FLAG_KEYS.get(name) == f"cache.{name}", name
    args = build_parser().parse_args(["--kv-key-layout", "channel", "--kv-bits", "4"])
    assert overrides_from(args)["cache.kv_key_layout"] == "channel"
