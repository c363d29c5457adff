"""Cache knobs declared once (cache/settings.py ``KNOBS``): each reaches CacheSettings, the [cache]
config, a CLI flag, ``/mode`` and (where declared) the F4 dialog with its default, rule and choices;
"auto" starts as one mode, written once."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from cache.settings import (
    AUTO,
    AUTO_STARTS_AS,
    KEY_LAYOUTS,
    KNOBS,
    MODE_KNOB,
    MODES,
    CacheConfigError,
    CacheSettings,
    Knob,
    knob_choices,
    knob_types,
    starting_mode,
)
from chatapp.slash_commands import CACHE_KEYS, CommandError, apply_command, parse_line, validate_command

REPO = Path(__file__).resolve().parent.parent


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
            assert app.engine.info.settings["kv_key_layout"] == "token"
            await pilot.press("f4")
            await wait_until(pilot, lambda: isinstance(app.screen, ModeDialog), what="the dialog")
            dialog = app.screen
            dialog.query_one("#mode-select").value = "prealloc"
            dialog.query_one("#f-kv_key_layout").value = "channel"
            await pilot.pause()
            dialog.action_apply()
            await wait_until(pilot, lambda: app.engine.info.settings["kv_key_layout"] == "channel"
                             and not app.engine.busy, what="the switch")
            assert app.engine.info.mode == "prealloc"

    run()


def _other_value(knob: Knob) -> int | str:
    """A valid value that is not the knob's default (doubling a size keeps every cross rule)."""
    if knob.choices:
        return next(c for c in knob.choices if c != knob.default)
    return knob.default * 2


def _bad_value(knob: Knob) -> int:
    """A whole number the knob's rule refuses."""
    if knob.choices:
        return max(knob.choices) + 1
    return knob.multiple + 1 if knob.multiple else knob.minimum - 1


NUMBER_KNOBS = [k for k in KNOBS if k.type is int]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_each_declared_knob_reaches_settings_config_and_flag(knob):
    """A knob added to KNOBS is a CacheSettings field (unless config-only), a [cache] setting with
    the declared default and rule, and a flag that sets ``cache.<name>`` through to the settings."""
    from chatapp.cli import build_parser, overrides_from
    from chatapp.config import CacheConfig, load_config, valid_setting
    from chatapp.engine.setup import cache_settings_from

    settings = {f.name: f for f in dataclasses.fields(CacheSettings)}
    assert (knob.name in settings) == knob.in_settings
    if knob.in_settings:
        want = starting_mode(knob.default) if knob is MODE_KNOB else knob.default
        assert settings[knob.name].default == want and settings[knob.name].type is knob.type
    config = {f.name: f for f in dataclasses.fields(CacheConfig)}
    assert config[knob.name].default == knob.default and knob.key == f"cache.{knob.name}"
    assert valid_setting(knob.key, knob.default) and valid_setting(knob.key, _other_value(knob))
    if knob.type is int:
        assert not valid_setting(knob.key, _bad_value(knob))

    value = _other_value(knob)
    args = build_parser().parse_args([knob.option, str(value)])
    assert overrides_from(args) == {knob.key: value}
    cfg = load_config(overrides=overrides_from(args))
    assert cfg.get(knob.key) == value and cfg.source(knob.key) == "command line"
    if knob.in_settings:
        assert getattr(cache_settings_from(cfg), knob.name) == starting_mode(value)


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: k.name)
def test_each_declared_knob_reaches_mode_and_the_dialog(knob):
    """``/mode`` takes every CacheSettings knob (the mode as its word), and each knob the dialog
    shows is a field with its label, hint, choices and modes; the dialog refuses a bad value."""
    from chatapp.ui.format import MODE_FIELDS, validate_mode_fields
    from chatapp.ui.screens import ModeDialog

    value = _other_value(knob)
    if knob is MODE_KNOB:
        assert all(parse_line(f"/mode {c}").mode == c for c in knob.choices)
    elif knob.in_settings:
        assert parse_line(f"/mode prealloc {knob.name}={value}").changes == {knob.name: value}
        assert knob_types()[knob.name] is knob.type and knob_choices(knob.name) == (knob.choices or None)
    else:  # the session's own (long_after): not a cache's, so not a /mode key
        with pytest.raises(CommandError, match="unknown setting"):
            parse_line(f"/mode prealloc {knob.name}={value}")

    fields = {name: (label, hint) for name, label, hint in ModeDialog.FIELDS}
    assert (knob.name in fields) == knob.dialog
    if not knob.dialog:
        return
    assert fields[knob.name] == (knob.dialog_label, knob.dialog_hint) and knob.dialog_hint
    assert MODE_FIELDS[knob.name] == knob.modes and set(knob.modes) < set(MODES) | {AUTO}
    assert ModeDialog.CHOICE_FIELDS.get(knob.name) == (knob.choices if knob.type is str else None)
    good = {k.name: str(k.default) for k in KNOBS if k.dialog}
    values, errors = validate_mode_fields("window-quant", {**good, knob.name: str(value)})
    assert errors == {} and values[knob.name] == value
    bad = "nope" if knob.type is str else str(_bad_value(knob))
    _, errors = validate_mode_fields("window-quant", {**good, knob.name: bad})
    assert set(errors) == {knob.name}


@pytest.mark.parametrize("knob", NUMBER_KNOBS, ids=lambda k: k.name)
def test_a_bad_number_is_one_line_everywhere(knob, capsys):
    """The flag: exit 2 and one ``config error`` line naming the key; CacheSettings: one line."""
    from chatapp import cli

    bad = _bad_value(knob)
    assert cli.main([knob.option, str(bad), "--show-config"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"chatapp: config error: command line: {knob.key}: must be ")
    if knob.in_settings:
        with pytest.raises(CacheConfigError) as e:
            CacheSettings(**{knob.name: bad})
        assert str(e.value).startswith(f"{knob.name}: must be ") and "\n" not in str(e.value)


def test_the_default_config_starts_as_the_default_settings():
    from chatapp.config import Config
    from chatapp.engine.setup import cache_settings_from

    assert cache_settings_from(Config()) == CacheSettings() and CacheSettings().mode == AUTO_STARTS_AS


def _groups(nodes: list[ast.AST]) -> list[list[ast.AST]]:
    """The expressions under ``nodes`` (not under nested statements) in the groups a rule would sit in:
    each dict item and each element of a tuple, list or set is a group of its own (a table of the
    modes, or a list of them, names "auto" and the mode it starts as without pairing them)."""
    rest: list[ast.AST] = []
    groups: list[list[ast.AST]] = []
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.stmt):
            continue
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                groups += _groups([n for n in (key, value) if n is not None])
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for element in node.elts:
                groups += _groups([element])
        else:
            rest.append(node)
            todo.extend(ast.iter_child_nodes(node))
    return [rest, *groups]


def _statement_groups(stmt: ast.stmt) -> list[list[ast.AST]]:
    """``stmt``'s groups; an ``if``'s test goes with its body's own expressions (``if mode == AUTO: x = ...``)."""
    nodes = list(ast.iter_child_nodes(stmt))
    if isinstance(stmt, ast.If):
        nodes += [n for child in stmt.body for n in ast.iter_child_nodes(child)]
    return _groups(nodes)


def _restates(stmt: ast.stmt, starts_as: str = AUTO_STARTS_AS) -> bool:
    """Whether one of ``stmt``'s groups names "auto" (or AUTO) beside a text with ``starts_as`` in it."""
    word = re.compile(rf"\b{re.escape(starts_as)}\b")

    def auto(n: ast.AST) -> bool:
        return (isinstance(n, ast.Constant) and n.value == AUTO) or (isinstance(n, ast.Name) and n.id == "AUTO")

    def says(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str) and bool(word.search(n.value))

    return any(any(map(auto, g)) and any(map(says, g)) for g in _statement_groups(stmt))


def test_what_auto_starts_as_is_written_once():
    """No expression outside AUTO_STARTS_AS pairs "auto" (or AUTO) with the mode it starts as, as a
    rule (``"prealloc" if mode == "auto"``) or a help text that should read the name instead."""
    from chatapp.ui.format import MODE_HELP

    assert MODE_HELP[AUTO].startswith(f"{AUTO_STARTS_AS} while short")
    found = []
    for path in [*REPO.glob("cache/**/*.py"), *REPO.glob("chatapp/**/*.py")]:
        for stmt in ast.walk(ast.parse(path.read_text(), str(path))):
            # docstrings and comments may say it; code and the texts it shows must read the name
            if isinstance(stmt, ast.stmt) and not isinstance(stmt, ast.Expr) and _restates(stmt):
                found.append(f"{path.relative_to(REPO)}:{stmt.lineno}")
    assert not found, f"what auto starts as, restated (use AUTO_STARTS_AS / starting_mode): {found}"


@pytest.mark.parametrize("source, restated", [
    ('x = "prealloc" if mode == "auto" else mode', True),
    ('HELP = {"auto": "prealloc while short", "prealloc": "full precision"}', True),
    ('if mode == AUTO:\n    mode = "prealloc"', True),
    ('HELP = {"auto": f"{AUTO_STARTS_AS} while short", "prealloc": "full precision"}', False),
    ('MODES = ("auto", "prealloc")', False),
])
def test_the_restatement_check_tells_a_rule_from_a_list(source, restated):
    assert _restates(ast.parse(source).body[0], "prealloc") == restated
