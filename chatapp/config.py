"""Configuration: layered TOML files plus command-line overrides, validated.

Layers, lowest priority first:

1. the packaged defaults (``config.toml`` at the repository root, shipped in the
   wheel as ``chatapp/default_config.toml``), which also documents every setting;
2. the user file, ``<user config dir>/config.toml`` where the directory is
   ``$CHATAPP_CONFIG_DIR`` when set, else ``platformdirs.user_config_dir("chatapp")``;
3. the file named by ``--config FILE``;
4. command-line flags, passed to :func:`load_config` as dotted ``overrides``.

Every value is checked; a bad file or value raises :class:`ConfigError`, whose
``str()`` is one line naming the file, the key and the reason, e.g.::

    config error: /path/config.toml: cache.window: must be an integer >= 1 (got -3)

The defaults live twice, in the dataclasses below (``[cache]``'s made from the knobs of
``cache.settings.KNOBS``) and in ``config.toml``; a test asserts that they agree exactly.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

import platformdirs

from cache.settings import CROSS_RULES, KNOBS, Knob

__all__ = [
    "APP_NAME",
    "CONFIG_DIR_ENV",
    "NUMERICS",
    "DENSE_WEIGHT_MODES",
    "KERNEL_MODES",
    "CHAT_FORMATS",
    "SOURCE_DEFAULT",
    "SOURCE_COMMAND_LINE",
    "ConfigError",
    "ModelConfig",
    "CacheConfig",
    "SamplingConfig",
    "ChatConfig",
    "CpuConfig",
    "UiConfig",
    "DataConfig",
    "MemoryConfig",
    "Config",
    "SECTIONS",
    "setting_keys",
    "default_config_path",
    "user_config_dir",
    "user_config_path",
    "load_config",
]

APP_NAME = "chatapp"
CONFIG_DIR_ENV = "CHATAPP_CONFIG_DIR"
CONFIG_FILE_NAME = "config.toml"

# cpu.numerics: the fused decode and prefill steps' 4-bit products (backend/cpu.py validates against
# this too); auto is fast where the CPU has vector int8 products (VNNI, AVX2), else exact (fused_decode.py)
NUMERICS = ("auto", "exact", "fast")
# cpu.kv_dtype: the K/V buffers the fused CPU routes make (backend/fused_decode.py validates against
# this too); auto is float16 where the CPU converts half precision in vector instructions (F16C)
KV_DTYPES = ("auto", "float16", "float32")
DENSE_WEIGHT_MODES = ("auto", "on", "off")  # cpu.dense_weights (backend/cpu.py validates against these too)
KERNEL_MODES = ("auto", "off")  # cpu.kernels
# The prompt formats ("auto" plus prompt.formats.FORMAT_NAMES).
CHAT_FORMATS = ("auto", "template", "llama-2", "mistral", "chatml", "plain", "raw")

SOURCE_DEFAULT = "default"
SOURCE_COMMAND_LINE = "command line"


def _user_source(path: Path | str) -> str:
    return f"user file {path}"


def _config_flag_source(path: Path | str) -> str:
    return f"--config {path}"


# --------------------------------------------------------------------------- errors


class ConfigError(Exception):
    """A refused configuration file or value; ``str()`` is a single line.

    ``file`` is the file path (or ``"command line"``), ``key`` the dotted setting
    name (``None`` for whole-file problems such as malformed TOML) and ``reason``
    what is wrong.
    """

    def __init__(self, file: str, key: str | None, reason: str) -> None:
        self.file = str(file)
        self.key = key
        self.reason = reason
        parts = ["config error", self.file]
        if key:
            parts.append(key)
        parts.append(reason)
        self.message = _one_line(": ".join(parts))
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class _Invalid(Exception):
    """Raised by a rule; carries the reason only (file and key are added later)."""


def _one_line(text: str) -> str:
    """Replace line breaks (of any kind) with spaces; other whitespace is kept."""
    return " ".join(text.splitlines()) if text else text


def _fmt_value(value: Any) -> str:
    """A value as it would be written in TOML, kept short and on one line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = repr(value)
    text = _one_line(text)
    return text if len(text) <= 80 else text[:77] + "..."


def _num(x: float) -> str:
    return f"{x:g}"


# --------------------------------------------------------------------------- rules


class _Rule:
    """How one setting is checked (and parsed from command-line text)."""

    description = ""
    bounds = ""  # the range alone (">= 0", "> 0 and <= 1"), for messages that name the type elsewhere

    def check(self, value: Any) -> Any:
        """Return the normalised value or raise :class:`_Invalid`."""
        raise NotImplementedError

    def parse_text(self, text: str) -> Any:
        """Turn command-line text into a value of the right type (best effort)."""
        return text

    def fail(self, value: Any) -> _Invalid:
        return _Invalid(f"{self.description} (got {_fmt_value(value)})")


class _Str(_Rule):
    def __init__(self, nonempty: bool = False) -> None:
        self.nonempty = nonempty
        self.description = "must be a non-empty string" if nonempty else "must be a string"

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or (self.nonempty and not value.strip()):
            raise self.fail(value)
        return value


class _Bool(_Rule):
    description = "must be true or false"
    _TEXT = {"true": True, "yes": True, "on": True, "1": True,
             "false": False, "no": False, "off": False, "0": False}

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(value)
        return value

    def parse_text(self, text: str) -> Any:
        return self._TEXT.get(text.strip().lower(), text)


def _parse_int_text(text: str) -> Any:
    try:
        return int(text.strip())
    except ValueError:
        return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Int(_Rule):
    def __init__(self, minimum: int | None = None, multiple_of: int | None = None) -> None:
        self.minimum = minimum
        self.multiple_of = multiple_of
        if multiple_of is not None:
            self.description = f"must be a positive integer multiple of {multiple_of}"
        elif minimum is not None:
            self.bounds = f">= {minimum}"
            self.description = f"must be an integer {self.bounds}"
        else:
            self.description = "must be an integer"

    def check(self, value: Any) -> int:
        if not _is_int(value):
            raise self.fail(value)
        if self.minimum is not None and value < self.minimum:
            raise self.fail(value)
        if self.multiple_of is not None and (value <= 0 or value % self.multiple_of):
            raise self.fail(value)
        return value

    def parse_text(self, text: str) -> Any:
        return _parse_int_text(text)


class _Float(_Rule):
    """A finite number within bounds; integers are accepted and made floats."""

    def __init__(self, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False) -> None:
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        bounds = []
        if lo is not None:
            bounds.append(f"{'>' if lo_open else '>='} {_num(lo)}")
        if hi is not None:
            bounds.append(f"{'<' if hi_open else '<='} {_num(hi)}")
        self.bounds = " and ".join(bounds)
        self.description = "must be a number" + (" " + self.bounds if bounds else "")

    def check(self, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(value)
        x = float(value)
        if not math.isfinite(x):
            raise self.fail(value)
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            raise self.fail(value)
        if self.hi is not None and (x >= self.hi if self.hi_open else x > self.hi):
            raise self.fail(value)
        return x

    def parse_text(self, text: str) -> Any:
        try:
            return float(text.strip())
        except ValueError:
            return text


class _Choice(_Rule):
    def __init__(self, *choices: str | int) -> None:
        self.choices = choices
        self.description = "must be one of " + ", ".join(_fmt_value(c) for c in choices)

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise self.fail(value)
        if type(value) is not type(self.choices[0]) or value not in self.choices:
            raise self.fail(value)
        return value

    def parse_text(self, text: str) -> Any:
        if isinstance(self.choices[0], int):
            return _parse_int_text(text)
        return text


class _Seed(_Rule):
    """An integer seed; -1 (or None) means a random seed and is stored as None."""

    description = "must be an integer >= 0, or -1 for a random seed"
    bounds = ">= 0, or -1 for a random seed"

    def check(self, value: Any) -> int | None:
        if value is None or (_is_int(value) and value == -1):
            return None
        if not _is_int(value) or value < 0:
            raise self.fail(value)
        return value

    def parse_text(self, text: str) -> Any:
        if text.strip().lower() in ("random", "none"):
            return None
        return _parse_int_text(text)


def _setting(default: Any, rule: _Rule) -> Any:
    return field(default=default, metadata={"rule": rule})


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """``[model]``: which model to load and how."""

    # the default model (DEFAULT_MODEL in chatapp/model/default_model.py): SmolLM2, fetched on first use
    id: str = _setting("SmolLM2-135M-Instruct", _Str(nonempty=True))
    dtype: str = _setting("auto", _Choice("auto", "float32", "float16", "bfloat16"))
    trust_remote_code: bool = _setting(False, _Bool())


def _knob_rule(knob: Knob) -> _Rule:
    """The config rule of a cache knob, from its declaration (cache/settings.py)."""
    if knob.choices:
        return _Choice(*knob.choices)
    if knob.type is str:
        return _Str()
    return _Int(minimum=knob.minimum, multiple_of=knob.multiple)


# ``[cache]``: the key/value cache strategy and its sizes (in tokens), a setting per knob of
# cache.settings.KNOBS (made, not written: a knob added there is a setting here).
CacheConfig = make_dataclass(
    "CacheConfig", [(k.name, k.type, _setting(k.default, _knob_rule(k))) for k in KNOBS],
    namespace={"__module__": __name__, "__doc__": "``[cache]``: the key/value cache strategy and its sizes."},
)


@dataclass
class SamplingConfig:
    """``[sampling]``: how the next token is chosen. ``seed`` None = random."""

    temp: float = _setting(0.7, _Float(lo=0.0))
    top_p: float = _setting(0.95, _Float(lo=0.0, hi=1.0, lo_open=True))
    top_k: int = _setting(0, _Int(minimum=0))
    min_p: float = _setting(0.0, _Float(lo=0.0, hi=1.0, hi_open=True))
    seed: int | None = _setting(None, _Seed())
    max_tokens: int = _setting(512, _Int(minimum=1))
    repetition_penalty: float = _setting(1.0, _Float(lo=1.0))
    ignore_eos: bool = _setting(False, _Bool())


@dataclass
class ChatConfig:
    """``[chat]``: the conversation itself."""

    system: str = _setting("", _Str())
    raw: bool = _setting(False, _Bool())
    format: str = _setting("auto", _Choice(*CHAT_FORMATS))
    template: str = _setting("", _Str())


@dataclass
class CpuConfig:
    """``[cpu]``: CPU-only speed-ups."""

    blas: str = _setting("auto", _Str(nonempty=True))
    kernels: str = _setting("auto", _Choice(*KERNEL_MODES))
    threads: int = _setting(0, _Int(minimum=0))
    kernel_max_tokens: int = _setting(4, _Int(minimum=1))
    dense_weights: str = _setting("auto", _Choice(*DENSE_WEIGHT_MODES))
    dense_budget_fraction: float = _setting(0.25, _Float(lo=0.0, hi=1.0))
    dense_prefill_threshold: int = _setting(16, _Int(minimum=1))
    fast_attention: bool = _setting(True, _Bool())
    numpy_matvec: bool = _setting(True, _Bool())
    fused_decode: bool = _setting(True, _Bool())
    numerics: str = _setting("auto", _Choice(*NUMERICS))
    kv_dtype: str = _setting("auto", _Choice(*KV_DTYPES))
    # off: a first start with the prefill kernel compiled in a child answered wrongly (issue 37)
    precompile: bool = _setting(False, _Bool())


@dataclass
class UiConfig:
    """``[ui]``: the terminal interface."""

    theme: str = _setting("textual-dark", _Str(nonempty=True))
    render_interval_ms: int = _setting(50, _Int(minimum=10))
    show_panel: bool = _setting(False, _Bool())


@dataclass
class DataConfig:
    """``[data]``: where conversations and snapshots are kept."""

    dir: str = _setting("", _Str())
    snapshot_cap_mb: int = _setting(2048, _Int(minimum=0))
    prefix_cap_mb: int = _setting(2048, _Int(minimum=0))


@dataclass
class MemoryConfig:
    """``[memory]``: MLX's allocator limits (0 / -1 keep MLX's own defaults)."""

    limit_mb: int = _setting(0, _Int(minimum=0))
    cache_limit_mb: int = _setting(-1, _Int(minimum=-1))


#: Section name -> section dataclass, in file order.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "sampling": SamplingConfig,
    "chat": ChatConfig,
    "cpu": CpuConfig,
    "ui": UiConfig,
    "data": DataConfig,
    "memory": MemoryConfig,
}

_RULES: dict[str, _Rule] = {
    f"{section}.{f.name}": f.metadata["rule"]
    for section, cls in SECTIONS.items()
    for f in fields(cls)
}


def valid_setting(dotted: str, value: Any) -> bool:
    """Whether ``value`` passes the rule of setting ``dotted`` (``"sampling.temp"``): the one place
    each rule is written, also used by the stdin ``/set`` command."""
    try:
        _RULES[dotted].check(value)
    except _Invalid:
        return False
    return True


def setting_bounds(dotted: str) -> str:
    """The range the rule of ``dotted`` allows, as a phrase (``"> 0 and <= 1"``)."""
    return _RULES[dotted].bounds


def setting_keys() -> list[str]:
    """Every dotted setting name (``"cache.window"``...), in file order."""
    return list(_RULES)


def _defaults() -> dict[str, Any]:
    return {f"{s}.{f.name}": f.default for s, cls in SECTIONS.items() for f in fields(cls)}


@dataclass
class Config:
    """The effective configuration: one attribute per section.

    ``sources`` maps each dotted key to where its value came from: ``"default"``,
    ``"user file PATH"``, ``"--config PATH"`` or ``"command line"``; keys missing
    from it are defaults.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    ui: UiConfig = field(default_factory=UiConfig)
    data: DataConfig = field(default_factory=DataConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def get(self, dotted: str) -> Any:
        """The value of a dotted key such as ``"cache.window"``; KeyError if unknown."""
        if dotted not in _RULES:
            raise KeyError(dotted)
        section, name = dotted.split(".", 1)
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}`` (a fresh, TOML-shaped copy; seed may be None)."""
        return {
            section: {f.name: getattr(getattr(self, section), f.name) for f in fields(cls)}
            for section, cls in SECTIONS.items()
        }

    def source(self, dotted: str) -> str:
        """Where the value of ``dotted`` came from."""
        if dotted not in _RULES:
            raise KeyError(dotted)
        return self.sources.get(dotted, SOURCE_DEFAULT)

    def describe(self) -> list[tuple[str, Any, str]]:
        """``(dotted key, value, source)`` for every setting, in file order."""
        return [(key, self.get(key), self.source(key)) for key in _RULES]

    def describe_text(self) -> str:
        """:meth:`describe` as aligned text lines, ``key = value  # source``."""
        rows = [(k, "random" if v is None else _fmt_value(v), s) for k, v, s in self.describe()]
        kw = max(len(k) for k, _, _ in rows)
        vw = max(len(v) for _, v, _ in rows)
        return "\n".join(f"{k:<{kw}} = {v:<{vw}}  # {s}" for k, v, s in rows)


# --------------------------------------------------------------------------- paths


def default_config_path() -> Path:
    """The packaged defaults file (``chatapp/default_config.toml``)."""
    return Path(__file__).resolve().parent / "default_config.toml"


def user_config_dir() -> Path:
    """``$CHATAPP_CONFIG_DIR`` when set (and non-empty), else the platform's config dir."""
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_config_dir(APP_NAME))


def user_config_path() -> Path:
    """The user's ``config.toml`` (it need not exist)."""
    return user_config_dir() / CONFIG_FILE_NAME


# --------------------------------------------------------------------------- loading


def _read_toml(path: Path, label: str) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(label, None, "file not found") from None
    except IsADirectoryError:
        raise ConfigError(label, None, "is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError(label, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(label, None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(label, None, f"invalid TOML: {exc}") from None


def _suggest(word: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _unknown_key(dotted: str) -> str:
    """The reason for an unknown dotted key, with a suggestion when one is close."""
    section, _, name = dotted.rpartition(".")
    by_name: dict[str, list[str]] = {}
    for key in _RULES:
        by_name.setdefault(key.rpartition(".")[2], []).append(key)
    # 1. the same name in another section ("[cache] temp" -> sampling.temp);
    if name in by_name:
        return f"unknown setting (did you mean {by_name[name][0]}?)"
    # 2. a typo within the right section ("cache.windw" -> cache.window);
    if section in SECTIONS:
        names = [f.name for f in fields(SECTIONS[section])]
        match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        if match:
            return f"unknown setting (did you mean {section}.{match[0]}?)"
    # 3. a close name anywhere, then a close dotted key.
    match = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.75)
    if match:
        return f"unknown setting (did you mean {by_name[match[0]][0]}?)"
    return "unknown setting" + _suggest(dotted, list(_RULES))


def _flatten(data: Mapping[str, Any], label: str) -> dict[str, Any]:
    """Check a parsed file's shape and values; return ``{dotted key: value}``."""
    out: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS:
            if isinstance(table, dict):
                raise ConfigError(label, section,
                                  "unknown section" + _suggest(section, list(SECTIONS)))
            raise ConfigError(label, section, _unknown_key(section))
        if not isinstance(table, dict):
            raise ConfigError(label, section,
                              f"must be a table ([{section}]) (got {_fmt_value(table)})")
        for name, value in table.items():
            dotted = f"{section}.{name}"
            out[dotted] = _check(dotted, value, label)
    return out


def _check(dotted: str, value: Any, label: str, from_text: bool = False) -> Any:
    rule = _RULES.get(dotted)
    if rule is None:
        raise ConfigError(label, dotted, _unknown_key(dotted))
    if from_text and isinstance(value, str):
        value = rule.parse_text(value)
    try:
        return rule.check(value)
    except _Invalid as exc:
        raise ConfigError(label, dotted, str(exc)) from None


# Priority of each kind of source, to decide which key a cross-field error blames.
_RANK_DEFAULT, _RANK_USER, _RANK_FILE, _RANK_CLI = range(4)


def _cross_check(values: dict[str, Any], ranks: dict[str, int], labels: dict[str, str]) -> None:
    """Checks that involve several settings; blame the one set most recently."""

    def blame(*keys: str) -> str:
        # Highest-priority source wins; ties go to the first key listed.
        return max(keys, key=lambda k: (ranks[k], -keys.index(k)))

    for rule in CROSS_RULES:
        cache_values = {name: values[f"cache.{name}"] for name in rule.fields}
        if rule.holds(cache_values):
            continue
        key = blame(*(f"cache.{name}" for name in rule.fields))
        broken = rule.violation(cache_values, key.removeprefix("cache."))
        reason = f"{broken.words(lambda name: f'cache.{name}')} (got {broken.value})"
        raise ConfigError(labels[key], key, reason)


def load_config(config_file: str | os.PathLike[str] | None = None,
                overrides: Mapping[str, object] | None = None) -> Config:
    """Build the effective configuration.

    ``config_file`` is the ``--config FILE`` argument (it must exist). ``overrides``
    maps dotted keys to command-line values, e.g. ``{"cache.window": 512}``; a value
    of None means "flag not given" and is skipped (pass -1 for a random seed), and
    string values are parsed to the setting's type (``"512"``, ``"true"``).
    Raises :class:`ConfigError` for any invalid file or value.
    """
    values = _defaults()
    sources = {key: SOURCE_DEFAULT for key in values}
    ranks = {key: _RANK_DEFAULT for key in values}
    default_path = default_config_path()
    labels = {key: str(default_path) for key in values}

    layers: list[tuple[Path, str, int]] = []
    if default_path.is_file():
        layers.append((default_path, SOURCE_DEFAULT, _RANK_DEFAULT))
    user_path = user_config_path()
    if user_path.exists():
        layers.append((user_path, _user_source(user_path), _RANK_USER))
    if config_file is not None:
        path = Path(config_file).expanduser()
        layers.append((path, _config_flag_source(path), _RANK_FILE))

    for path, source, rank in layers:
        label = str(path)
        for key, value in _flatten(_read_toml(path, label), label).items():
            values[key], sources[key], ranks[key], labels[key] = value, source, rank, label

    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        value = _check(key, raw, SOURCE_COMMAND_LINE, from_text=True)
        values[key], sources[key], ranks[key], labels[key] = (
            value, SOURCE_COMMAND_LINE, _RANK_CLI, SOURCE_COMMAND_LINE)

    _cross_check(values, ranks, labels)

    sections = {}
    for section, cls in SECTIONS.items():
        kwargs = {f.name: values[f"{section}.{f.name}"] for f in fields(cls)}
        sections[section] = cls(**kwargs)
    return Config(**sections, sources=sources)
