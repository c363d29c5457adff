"""Tests for chatapp.config: layering, sources, validation and default drift."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from chatapp import config as cfgmod
from chatapp.config import (
    SECTIONS,
    Config,
    ConfigError,
    default_config_path,
    load_config,
    setting_keys,
    user_config_path,
)

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config.toml"


@pytest.fixture(autouse=True)
def user_dir(tmp_path, monkeypatch) -> Path:
    """Point the user config dir at an empty temporary directory for every test."""
    d = tmp_path / "userconf"
    d.mkdir()
    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(d))
    return d


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def error_of(**kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    err = info.value
    assert "\n" not in str(err)
    assert str(err).startswith("config error: ")
    return err


# ----------------------------------------------------------------- defaults & drift


def test_defaults_load():
    cfg = load_config()
    assert cfg.to_dict() == Config().to_dict()
    assert cfg.model.id == "SmolLM2-135M-Instruct"
    assert cfg.model.dtype == "auto"
    assert cfg.cache.mode == "auto"
    assert cfg.cache.window == 1024
    assert cfg.cache.max_kv_tokens == 4096
    assert cfg.sampling.temp == 0.7
    assert cfg.sampling.seed is None  # -1 in TOML means random
    assert cfg.cpu.dense_prefill_threshold == 16
    assert cfg.ui.theme == "textual-dark"
    assert cfg.data.snapshot_cap_mb == 2048
    assert all(src == "default" for _, _, src in cfg.describe())


def _dataclass_defaults_as_toml() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for section, cls in SECTIONS.items():
        out[section] = {}
        for f in dataclasses.fields(cls):
            value = f.default
            if section == "sampling" and f.name == "seed" and value is None:
                value = -1
            out[section][f.name] = value
    return out


def test_config_toml_matches_dataclass_defaults_exactly():
    toml_data = tomllib.loads(REPO_CONFIG.read_text(encoding="utf-8"))
    expected = _dataclass_defaults_as_toml()
    assert list(toml_data) == list(expected), "sections differ or are out of order"
    for section in expected:
        assert list(toml_data[section]) == list(expected[section]), section
        for key, default in expected[section].items():
            got = toml_data[section][key]
            assert got == default, f"{section}.{key}: config.toml {got!r} != dataclass {default!r}"
            assert type(got) is type(default), f"{section}.{key}: type {type(got)} != {type(default)}"


def test_every_setting_documented_with_its_default():
    """Each assignment in config.toml has a comment block ending in 'Default: <same literal>'."""
    lines = REPO_CONFIG.read_text(encoding="utf-8").splitlines()
    section = None
    seen = []
    for i, line in enumerate(lines):
        m = re.match(r"^\[(\w+)\]\s*$", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^(\w+)\s*=\s*(.+?)\s*$", line)
        if not m:
            continue
        key, literal = m.groups()
        comments = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#"):
            comments.insert(0, lines[j])
            j -= 1
        dotted = f"{section}.{key}"
        assert len(comments) >= 2, f"{dotted}: needs a description and a Default: line"
        assert comments[-1] == f"# Default: {literal}", f"{dotted}: {comments[-1]!r}"
        seen.append(dotted)
    assert seen == setting_keys()


def test_packaged_default_file_is_the_repo_config():
    path = default_config_path()
    assert path.is_file()
    assert path.resolve() == REPO_CONFIG.resolve()
    link = Path(cfgmod.__file__).parent / "default_config.toml"
    assert link.is_symlink()
    assert str(link.readlink()) == "../config.toml"


def test_defaults_follow_the_packaged_file(tmp_path, monkeypatch):
    """The packaged file is a real layer: its values are used (with source 'default')."""
    fake = write(tmp_path / "defaults.toml", "[cache]\nwindow = 2000\n")
    monkeypatch.setattr(cfgmod, "default_config_path", lambda: fake)
    cfg = load_config()
    assert cfg.cache.window == 2000
    assert cfg.sources["cache.window"] == "default"
    # ...and the dataclass defaults stand in if the packaged file is missing.
    monkeypatch.setattr(cfgmod, "default_config_path", lambda: tmp_path / "absent.toml")
    assert load_config().to_dict() == Config().to_dict()


# ----------------------------------------------------------------- paths


def test_user_config_path_from_env(user_dir):
    assert user_config_path() == user_dir / "config.toml"


def test_user_config_path_platform(monkeypatch):
    import platformdirs

    monkeypatch.delenv("CHATAPP_CONFIG_DIR", raising=False)
    assert user_config_path() == Path(platformdirs.user_config_dir("chatapp")) / "config.toml"
    monkeypatch.setenv("CHATAPP_CONFIG_DIR", "")
    assert user_config_path() == Path(platformdirs.user_config_dir("chatapp")) / "config.toml"


# ----------------------------------------------------------------- layering & sources


def test_user_file_overrides_defaults(user_dir):
    user = write(user_dir / "config.toml", '[cache]\nwindow = 512\n[model]\nid = "my/model"\n')
    cfg = load_config()
    assert cfg.cache.window == 512
    assert cfg.model.id == "my/model"
    assert cfg.cache.sinks == 4
    assert cfg.sources["cache.window"] == f"user file {user}"
    assert cfg.sources["cache.sinks"] == "default"


def test_config_file_overrides_user_file(user_dir, tmp_path):
    user = write(user_dir / "config.toml", "[cache]\nwindow = 512\nsinks = 8\n")
    extra = write(tmp_path / "extra.toml", "[cache]\nwindow = 768\n")
    cfg = load_config(config_file=str(extra))
    assert cfg.cache.window == 768
    assert cfg.cache.sinks == 8
    assert cfg.sources["cache.window"] == f"--config {extra}"
    assert cfg.sources["cache.sinks"] == f"user file {user}"


def test_overrides_beat_everything(user_dir, tmp_path):
    user = write(user_dir / "config.toml", "[cache]\nwindow = 512\n[sampling]\ntemp = 0.1\n")
    extra = write(tmp_path / "extra.toml", "[cache]\nwindow = 768\n[ui]\nshow_panel = true\n")
    cfg = load_config(config_file=extra, overrides={"cache.window": 300, "sampling.top_k": 40})
    assert cfg.cache.window == 300
    assert cfg.sampling.top_k == 40
    assert cfg.sampling.temp == 0.1
    assert cfg.ui.show_panel is True
    assert cfg.sources == {
        **{k: "default" for k in setting_keys()},
        "cache.window": "command line",
        "sampling.top_k": "command line",
        "sampling.temp": f"user file {user}",
        "ui.show_panel": f"--config {extra}",
    }


def test_describe_reports_values_and_sources(user_dir, tmp_path):
    user = write(user_dir / "config.toml", '[chat]\nsystem = "Be brief."\n')
    extra = write(tmp_path / "extra.toml", "[sampling]\nseed = 7\n")
    cfg = load_config(config_file=extra, overrides={"cache.mode": "window"})
    rows = cfg.describe()
    assert [k for k, _, _ in rows] == setting_keys()
    by_key = {k: (v, s) for k, v, s in rows}
    assert by_key["chat.system"] == ("Be brief.", f"user file {user}")
    assert by_key["sampling.seed"] == (7, f"--config {extra}")
    assert by_key["cache.mode"] == ("window", "command line")
    assert by_key["cache.window"] == (1024, "default")
    text = cfg.describe_text().splitlines()
    assert len(text) == len(setting_keys())
    assert any(re.match(r'^chat\.system\s+= "Be brief\."\s+# user file ', ln) for ln in text)
    assert any(re.match(r"^cache\.mode\s+= \"window\"\s+# command line$", ln) for ln in text)


def test_get_and_to_dict():
    cfg = load_config(overrides={"ui.render_interval_ms": 20})
    assert cfg.get("ui.render_interval_ms") == 20
    assert cfg.to_dict()["ui"]["render_interval_ms"] == 20
    assert set(cfg.to_dict()) == set(SECTIONS)
    with pytest.raises(KeyError):
        cfg.get("ui.nope")
    with pytest.raises(KeyError):
        cfg.get("sources")
    # to_dict is a copy
    d = cfg.to_dict()
    d["ui"]["render_interval_ms"] = 999
    assert cfg.ui.render_interval_ms == 20


def test_plain_config_reports_defaults():
    cfg = Config()
    assert cfg.source("cache.window") == "default"
    assert len(cfg.describe()) == len(setting_keys())


def test_overrides_none_skipped_and_text_parsed(user_dir):
    write(user_dir / "config.toml", "[sampling]\nseed = 5\n")
    cfg = load_config(overrides={
        "sampling.seed": None,           # flag not given: user file's seed stays
        "cache.window": "2048",
        "cache.max_kv_tokens": "8192",
        "ui.show_panel": "true",
        "sampling.temp": "0",
        "cache.kv_bits": "4",
        "chat.system": "42",            # strings stay strings
    })
    assert cfg.sampling.seed == 5
    assert cfg.cache.window == 2048
    assert cfg.ui.show_panel is True
    assert cfg.sampling.temp == 0.0 and isinstance(cfg.sampling.temp, float)
    assert cfg.cache.kv_bits == 4
    assert cfg.chat.system == "42"
    assert "sampling.seed" not in [k for k, v in cfg.sources.items() if v == "command line"]
    assert load_config(overrides={"sampling.seed": -1}).sampling.seed is None
    assert load_config(overrides={"sampling.seed": "random"}).sampling.seed is None


def test_int_accepted_for_float_settings(tmp_path):
    f = write(tmp_path / "c.toml", "[sampling]\ntemp = 1\nrepetition_penalty = 2\n")
    cfg = load_config(config_file=f)
    assert cfg.sampling.temp == 1.0 and isinstance(cfg.sampling.temp, float)
    assert cfg.sampling.repetition_penalty == 2.0


def test_window_below_sinks_fixed_by_later_layer(user_dir):
    """Cross-field checks run on the merged result, not per file."""
    write(user_dir / "config.toml", "[cache]\nwindow = 2\n")
    cfg = load_config(overrides={"cache.sinks": 0})
    assert (cfg.cache.window, cfg.cache.sinks) == (2, 0)


# ----------------------------------------------------------------- errors


def test_malformed_toml(tmp_path):
    f = write(tmp_path / "bad.toml", "[cache\nwindow = 3\n")
    err = error_of(config_file=f)
    assert str(err).startswith(f"config error: {f}: invalid TOML: ")
    assert "line 1" in str(err)
    assert err.file == str(f) and err.key is None


def test_malformed_user_file(user_dir):
    f = write(user_dir / "config.toml", "cache.window = = 3\n")
    err = error_of()
    assert str(err).startswith(f"config error: {f}: invalid TOML: ")


def test_not_utf8(tmp_path):
    f = tmp_path / "bin.toml"
    f.write_bytes(b"[chat]\nsystem = \"\xff\xfe\"\n")
    assert str(error_of(config_file=f)).startswith(f"config error: {f}: not valid UTF-8")


def test_unknown_key_with_suggestion(tmp_path):
    f = write(tmp_path / "c.toml", "[cache]\nwindw = 512\n")
    err = error_of(config_file=f)
    assert str(err) == f"config error: {f}: cache.windw: unknown setting (did you mean cache.window?)"
    assert err.key == "cache.windw"


def test_unknown_key_in_wrong_section(tmp_path):
    f = write(tmp_path / "c.toml", "[cache]\ntemp = 0.5\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: cache.temp: unknown setting (did you mean sampling.temp?)")


def test_unknown_key_at_top_level(tmp_path):
    f = write(tmp_path / "c.toml", "window = 512\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: window: unknown setting (did you mean cache.window?)")


def test_unknown_key_without_suggestion(tmp_path):
    f = write(tmp_path / "c.toml", "[cache]\nzzzzqqq = 1\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: cache.zzzzqqq: unknown setting"


def test_unknown_section(tmp_path):
    f = write(tmp_path / "c.toml", "[modle]\nid = \"x\"\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: modle: unknown section (did you mean model?)")


def test_section_not_a_table(tmp_path):
    f = write(tmp_path / "c.toml", "cache = 5\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: cache: must be a table ([cache]) (got 5)"


def test_nested_table_in_section(tmp_path):
    f = write(tmp_path / "c.toml", "[cache.window]\nsize = 5\n")
    err = error_of(config_file=f)
    assert str(err).startswith(f"config error: {f}: cache.window: must be an integer >= 1 (got ")


def test_wrong_type(tmp_path):
    f = write(tmp_path / "c.toml", '[cache]\nwindow = "big"\n')
    assert str(error_of(config_file=f)) == (
        f'config error: {f}: cache.window: must be an integer >= 1 (got "big")')
    f = write(tmp_path / "c.toml", "[ui]\nshow_panel = 1\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: ui.show_panel: must be true or false (got 1)"
    f = write(tmp_path / "c.toml", "[cache]\nwindow = true\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: cache.window: must be an integer >= 1 (got true)"
    f = write(tmp_path / "c.toml", "[cache]\nwindow = 512.0\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: cache.window: must be an integer >= 1 (got 512.0)"
    f = write(tmp_path / "c.toml", "[model]\nid = 3\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: model.id: must be a non-empty string (got 3)"


def test_out_of_range(tmp_path):
    f = write(tmp_path / "c.toml", "[cache]\nwindow = -3\n")
    err = error_of(config_file=f)
    assert str(err) == f"config error: {f}: cache.window: must be an integer >= 1 (got -3)"
    assert (err.file, err.key) == (str(f), "cache.window")


@pytest.mark.parametrize(
    "toml_text, message",
    [
        ('[model]\ndtype = "float64"',
         'model.dtype: must be one of "auto", "float32", "float16", "bfloat16" (got "float64")'),
        ('[cache]\nmode = "fast"', 'cache.mode: must be one of "auto", "concat", "prealloc", '
         '"quantized", "window", "window-quant", "scored", "scored-quant" (got "fast")'),
        ("[cache]\nkv_bits = 6", "cache.kv_bits: must be one of 4, 8 (got 6)"),
        ('[cache]\nkv_bits = "8"', 'cache.kv_bits: must be one of 4, 8 (got "8")'),
        ("[cache]\nkv_group_size = 16", "cache.kv_group_size: must be one of 32, 64, 128 (got 16)"),
        ("[cache]\nsinks = -1", "cache.sinks: must be an integer >= 0 (got -1)"),
        ("[cache]\nevict_chunk = 0", "cache.evict_chunk: must be an integer >= 1 (got 0)"),
        ("[cache]\nquant_start = -5", "cache.quant_start: must be an integer >= 0 (got -5)"),
        ("[cache]\nlong_after = 0", "cache.long_after: must be an integer >= 1 (got 0)"),
        ("[sampling]\ntemp = -0.1", "sampling.temp: must be a number >= 0 (got -0.1)"),
        ("[sampling]\ntemp = inf", "sampling.temp: must be a number >= 0 (got inf)"),
        ("[sampling]\ntop_p = 0", "sampling.top_p: must be a number > 0 and <= 1 (got 0)"),
        ("[sampling]\ntop_p = 1.5", "sampling.top_p: must be a number > 0 and <= 1 (got 1.5)"),
        ("[sampling]\ntop_p = nan", "sampling.top_p: must be a number > 0 and <= 1 (got nan)"),
        ("[sampling]\ntop_k = -1", "sampling.top_k: must be an integer >= 0 (got -1)"),
        ("[sampling]\nmin_p = 1.0", "sampling.min_p: must be a number >= 0 and < 1 (got 1.0)"),
        ("[sampling]\nseed = -2", "sampling.seed: must be an integer >= 0, or -1 for a random seed (got -2)"),
        ("[sampling]\nmax_tokens = 0", "sampling.max_tokens: must be an integer >= 1 (got 0)"),
        ("[sampling]\nrepetition_penalty = 0.9",
         "sampling.repetition_penalty: must be a number >= 1 (got 0.9)"),
        ("[chat]\nsystem = false", "chat.system: must be a string (got false)"),
        ('[cpu]\nblas = ""', 'cpu.blas: must be a non-empty string (got "")'),
        ('[cpu]\ndense_weights = "yes"', 'cpu.dense_weights: must be one of "auto", "on", "off" (got "yes")'),
        ("[cpu]\ndense_budget_fraction = 1.5",
         "cpu.dense_budget_fraction: must be a number >= 0 and <= 1 (got 1.5)"),
        ("[cpu]\ndense_prefill_threshold = 0",
         "cpu.dense_prefill_threshold: must be an integer >= 1 (got 0)"),
        ('[ui]\ntheme = "  "', 'ui.theme: must be a non-empty string (got "  ")'),
        ("[ui]\nrender_interval_ms = 5", "ui.render_interval_ms: must be an integer >= 10 (got 5)"),
        ("[data]\ndir = 1", "data.dir: must be a string (got 1)"),
        ("[data]\nsnapshot_cap_mb = -1", "data.snapshot_cap_mb: must be an integer >= 0 (got -1)"),
    ],
)
def test_invalid_values(tmp_path, toml_text, message):
    f = write(tmp_path / "c.toml", toml_text + "\n")
    assert str(error_of(config_file=f)) == f"config error: {f}: {message}"


@pytest.mark.parametrize("value", [0, 128, 300, -256])
def test_chunk_size_must_be_multiple_of_256(tmp_path, value):
    f = write(tmp_path / "c.toml", f"[cache]\nchunk_size = {value}\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: cache.chunk_size: must be a positive integer multiple of 256 (got {value})")


def test_chunk_size_multiples_accepted():
    assert load_config(overrides={"cache.chunk_size": 1024}).cache.chunk_size == 1024


def test_window_below_sinks(tmp_path):
    f = write(tmp_path / "c.toml", "[cache]\nsinks = 4\nwindow = 2\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: cache.window: must be >= cache.sinks (4) (got 2)")


def test_sinks_above_window_blames_the_later_layer(user_dir, tmp_path):
    write(user_dir / "config.toml", "[cache]\nwindow = 16\n")
    f = write(tmp_path / "c.toml", "[cache]\nsinks = 32\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: cache.sinks: must be <= cache.window (16) (got 32)")


def test_max_kv_tokens_below_sinks_plus_window(tmp_path):
    f = write(tmp_path / "c.toml", "[cache]\nmax_kv_tokens = 1000\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: cache.max_kv_tokens: must be >= cache.sinks + cache.window (1028) (got 1000)")
    f = write(tmp_path / "c.toml", "[cache]\nwindow = 5000\n")
    assert str(error_of(config_file=f)) == (
        f"config error: {f}: cache.window: must be <= cache.max_kv_tokens - cache.sinks (4092) (got 5000)")
    f = write(tmp_path / "c.toml", "[cache]\nwindow = 4000\n")
    assert str(error_of(config_file=f, overrides={"cache.sinks": 200})) == (
        "config error: command line: cache.sinks: must be <= cache.max_kv_tokens - cache.window (96) (got 200)")


def test_override_errors():
    assert str(error_of(overrides={"cache.window": -3})) == (
        "config error: command line: cache.window: must be an integer >= 1 (got -3)")
    assert str(error_of(overrides={"cache.window": "lots"})) == (
        'config error: command line: cache.window: must be an integer >= 1 (got "lots")')
    assert str(error_of(overrides={"cache.windw": 3})) == (
        "config error: command line: cache.windw: unknown setting (did you mean cache.window?)")
    assert str(error_of(overrides={"cache.window": 2})) == (
        "config error: command line: cache.window: must be >= cache.sinks (4) (got 2)")


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    err = error_of(config_file=str(missing))
    assert str(err) == f"config error: {missing}: file not found"


def test_config_file_is_directory(tmp_path):
    assert str(error_of(config_file=tmp_path)) == f"config error: {tmp_path}: is a directory, not a file"


def test_missing_user_file_is_fine(user_dir):
    assert not (user_dir / "config.toml").exists()
    assert load_config().cache.window == 1024


def test_error_value_kept_on_one_line(tmp_path):
    f = write(tmp_path / "c.toml", '[cache]\nmode = """multi\nline"""\n')
    msg = str(error_of(config_file=f))
    assert msg.endswith('(got "multi\\nline")')
