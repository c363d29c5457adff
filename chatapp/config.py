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

from .config_rules import Bool, Choice, Float, Int, Invalid, Rule, Seed, Str, fmt_value, one_line, setting

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
        self.message = one_line(": ".join(parts))
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


# --------------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """``[model]``: which model to load and how."""

    # the default model (DEFAULT_MODEL in chatapp/model/default_model.py): SmolLM2, fetched on first use
    id: str = setting("SmolLM2-135M-Instruct", Str(nonempty=True))
    dtype: str = setting("auto", Choice("auto", "float32", "float16", "bfloat16"))
    trust_remote_code: bool = setting(False, Bool())


def _knob_rule(knob: Knob) -> Rule:
    """The config rule of a cache knob, from its declaration (cache/settings.py)."""
    if knob.choices:
        return Choice(*knob.choices)
    if knob.type is str:
        return Str()
    return Int(minimum=knob.minimum, multiple_of=knob.multiple)


# ``[cache]``: the key/value cache strategy and its sizes (in tokens), a setting per knob of
# cache.settings.KNOBS (made, not written: a knob added there is a setting here).
CacheConfig = make_dataclass(
    "CacheConfig", [(k.name, k.type, setting(k.default, _knob_rule(k))) for k in KNOBS],
    namespace={"__module__": __name__, "__doc__": "``[cache]``: the key/value cache strategy and its sizes."},
)


@dataclass
class SamplingConfig:
    """``[sampling]``: how the next token is chosen. ``seed`` None = random."""

    temp: float = setting(0.7, Float(lo=0.0))
    top_p: float = setting(0.95, Float(lo=0.0, hi=1.0, lo_open=True))
    top_k: int = setting(0, Int(minimum=0))
    min_p: float = setting(0.0, Float(lo=0.0, hi=1.0, hi_open=True))
    seed: int | None = setting(None, Seed())
    max_tokens: int = setting(512, Int(minimum=1))
    repetition_penalty: float = setting(1.0, Float(lo=1.0))
    ignore_eos: bool = setting(False, Bool())


@dataclass
class ChatConfig:
    """``[chat]``: the conversation itself."""

    system: str = setting("", Str())
    raw: bool = setting(False, Bool())
    format: str = setting("auto", Choice(*CHAT_FORMATS))
    template: str = setting("", Str())


@dataclass
class CpuConfig:
    """``[cpu]``: CPU-only speed-ups."""

    blas: str = setting("auto", Str(nonempty=True))
    kernels: str = setting("auto", Choice(*KERNEL_MODES))
    threads: int = setting(0, Int(minimum=0))
    kernel_max_tokens: int = setting(4, Int(minimum=1))
    dense_weights: str = setting("auto", Choice(*DENSE_WEIGHT_MODES))
    dense_budget_fraction: float = setting(0.25, Float(lo=0.0, hi=1.0))
    dense_prefill_threshold: int = setting(16, Int(minimum=1))
    fast_attention: bool = setting(True, Bool())
    numpy_matvec: bool = setting(True, Bool())
    fused_decode: bool = setting(True, Bool())
    numerics: str = setting("auto", Choice(*NUMERICS))
    kv_dtype: str = setting("auto", Choice(*KV_DTYPES))
    # off: a first start with the prefill kernel compiled in a child answered wrongly (issue 37)
    precompile: bool = setting(False, Bool())


@dataclass
class UiConfig:
    """``[ui]``: the terminal interface."""

    theme: str = setting("textual-dark", Str(nonempty=True))
    render_interval_ms: int = setting(50, Int(minimum=10))
    show_panel: bool = setting(False, Bool())


@dataclass
class DataConfig:
    """``[data]``: where conversations and snapshots are kept."""

    dir: str = setting("", Str())
    snapshot_cap_mb: int = setting(2048, Int(minimum=0))
    prefix_cap_mb: int = setting(2048, Int(minimum=0))


@dataclass
class MemoryConfig:
    """``[memory]``: MLX's allocator limits (0 / -1 keep MLX's own defaults)."""

    limit_mb: int = setting(0, Int(minimum=0))
    cache_limit_mb: int = setting(-1, Int(minimum=-1))


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

_RULES: dict[str, Rule] = {
    f"{section}.{f.name}": f.metadata["rule"]
    for section, cls in SECTIONS.items()
    for f in fields(cls)
}


def valid_setting(dotted: str, value: Any) -> bool:
    """Whether ``value`` passes the rule of setting ``dotted`` (``"sampling.temp"``): the one place
    each rule is written, also used by the stdin ``/set`` command."""
    try:
        _RULES[dotted].check(value)
    except Invalid:
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
        rows = [(k, "random" if v is None else fmt_value(v), s) for k, v, s in self.describe()]
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
                              f"must be a table ([{section}]) (got {fmt_value(table)})")
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
    except Invalid as exc:
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
