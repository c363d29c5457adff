"""Cache settings: each knob declared once (:data:`KNOBS`: its default, rule, help, flag, dialog
field), and :data:`CacheSettings`, one frozen dataclass made from them, validated on construction
with clear messages.

The modes and what they mean:
- ``concat``: the naive per-token ``mx.concatenate`` (O(n^2) copying; kept so users can see the cost).
- ``prealloc``: contiguous buffer grown in whole chunks, written in place.
- ``quantized``: full precision until ``quant_start`` tokens, then K/V quantised in chunks.
- ``window``: ``sinks`` attention-sink tokens plus the most recent ``window`` tokens; older
  tokens are evicted and the kept keys re-positioned.
- ``window-quant``: sinks and a recent window at full precision, older tokens quantised, and
  beyond ``max_kv_tokens`` the oldest non-sink tokens evicted with the same re-positioning.
- ``scored``: sinks and a recent window always kept; beyond ``max_kv_tokens`` the middle tokens
  with the least accumulated attention are evicted and the kept keys re-positioned (scored.py).
- ``scored-quant``: ``scored`` with the middle (past the recent window) held quantised, as
  window-quant's: at equal KV bytes it holds 2-4x the tokens of scored or window.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass, replace
from typing import Any, Callable, Iterable, Mapping

MODES = ("concat", "prealloc", "quantized", "window", "window-quant", "scored", "scored-quant")
# What a user may ask for: a mode, or "auto" (the session's policy: AUTO_STARTS_AS while short, a
# window mode once long). The one list that config, CLI, UI, slash commands and benches use.
AUTO = "auto"
MODE_CHOICES = (AUTO, *MODES)
# What "auto" starts as: every token kept while the conversation is short (the rule, once).
AUTO_STARTS_AS = "prealloc"


def starting_mode(mode: str) -> str:
    """The cache mode a session asked for ``mode`` starts in ("auto" starts as AUTO_STARTS_AS)."""
    return AUTO_STARTS_AS if mode == AUTO else mode


# Which modes evict, quantise, and cap their tokens at max_kv_tokens (window caps at sinks + window).
EVICTING = ("window", "window-quant", "scored", "scored-quant")
QUANTIZING = ("quantized", "window-quant", "scored-quant")
CAPPED = ("window-quant", "scored", "scored-quant")
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize accepts
# How the quantised middle groups its keys: "token" (each token's head_dim in groups, as values
# are) or "channel" (KIVI: each channel over groups of kv_group_size tokens; quant_channel.py).
KEY_LAYOUTS = ("token", "channel")
CHUNK_MULTIPLE = 256  # chunk_size: preallocation grows in whole multiples of this


def one_of(values: Iterable[object]) -> str:
    """(4, 8) -> "4 or 8"; (32, 64, 128) -> "32, 64 or 128"."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass(frozen=True)
class Knob:
    """One cache knob, declared once: CacheSettings' fields, the ``[cache]`` config section, the
    CLI's cache flags, ``/mode``'s keys and the F4 dialog's fields are all made from KNOBS.

    Its rule is one of ``choices``, ``multiple`` (a positive multiple of it) or ``minimum``.
    """

    name: str
    default: int | str  # the [cache] default; its type is the knob's type
    help: str | None = None  # the CLI flag's help; None: a number knob's choices say it ("4 or 8")
    minimum: int | None = None
    multiple: int | None = None
    choices: tuple = ()
    modes: tuple[str, ...] = MODE_CHOICES  # the modes (as asked for, "auto" included) it matters for
    dialog: bool = False  # one of the F4 dialog's fields
    label: str | None = None  # the dialog's label (default: the name)
    hint: str | None = None  # the dialog's one-line hint (default: the flag's help)
    flag: str | None = None  # the CLI flag (default: --name-with-dashes)
    in_settings: bool = True  # a CacheSettings field; False: the session reads it from the config

    @property
    def type(self) -> type:
        return type(self.default)

    @property
    def key(self) -> str:
        """The dotted config key, ``cache.window``."""
        return f"cache.{self.name}"

    @property
    def option(self) -> str:
        """The CLI flag, ``--max-kv-tokens``."""
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        """The flag's argparse destination (``cache_mode`` for ``--cache-mode``)."""
        return self.option.removeprefix("--").replace("-", "_")

    @property
    def flag_help(self) -> str | None:
        # a text knob's flag lists its choices itself ({token,channel}); a number knob's help says them
        if self.help is None and self.choices and self.type is int:
            return one_of(self.choices)
        return self.help

    @property
    def dialog_label(self) -> str:
        return self.label or self.name

    @property
    def dialog_hint(self) -> str:
        return self.hint or self.flag_help or ""

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this knob's ("must be ..."), or None when it can."""
        if self.choices:
            ok = type(value) is self.type and value in self.choices
            return None if ok else f"must be one of {', '.join(map(str, self.choices))}"
        if self.type is str:
            return None if isinstance(value, str) else "must be a string"
        whole = type(value) is int  # not isinstance: a bool is an int too, but never a size
        if self.multiple is not None:
            ok = whole and value > 0 and value % self.multiple == 0
            return None if ok else f"must be a positive integer multiple of {self.multiple}"
        if self.minimum is not None:
            return None if whole and value >= self.minimum else f"must be an integer >= {self.minimum}"
        return None if whole else "must be an integer"


# Every cache knob, in the order the CLI's --help and the F4 dialog list them (and config.toml).
MODE_KNOB = Knob("mode", AUTO, choices=MODE_CHOICES, flag="--cache-mode")
KNOBS: tuple[Knob, ...] = (
    MODE_KNOB,
    Knob("window", 1024, "recent tokens kept at full precision (window modes)", minimum=1,
         modes=(*EVICTING, AUTO), dialog=True, hint="recent tokens kept at full precision"),
    Knob("sinks", 4, "attention-sink tokens kept at the start (window modes)", minimum=0,
         modes=(*EVICTING, AUTO), dialog=True, hint="first tokens never evicted"),
    Knob("kv_bits", 8, choices=QUANT_BITS, modes=(*QUANTIZING, AUTO), dialog=True),
    Knob("kv_group_size", 64, choices=QUANT_GROUP_SIZES, modes=(*QUANTIZING, AUTO), dialog=True),
    Knob("max_kv_tokens", 4096, "token budget of window-quant", minimum=1,
         modes=(*CAPPED, AUTO), dialog=True, hint="window-quant budget"),
    Knob("chunk_size", 256, f"preallocation step (multiple of {CHUNK_MULTIPLE})", multiple=CHUNK_MULTIPLE),
    Knob("evict_chunk", 256, "tokens evicted or quantised at a time", minimum=1),
    Knob("quant_start", 512, "quantized mode: full precision until this many tokens", minimum=0,
         modes=("quantized",)),
    Knob("kv_key_layout", "token", "quantised keys grouped per token or per channel", choices=KEY_LAYOUTS,
         modes=(*QUANTIZING, AUTO), dialog=True, label="key layout", hint="quantised keys per token or channel"),
    # auto's switch point: the session's own, not a cache's, so no CacheSettings field
    Knob("long_after", 2048, "auto mode: switch to the long-history policy after this many tokens", minimum=1,
         modes=(AUTO,), in_settings=False),
)
SETTINGS_KNOBS = tuple(k for k in KNOBS if k.in_settings)
DIALOG_KNOBS = tuple(k for k in KNOBS if k.dialog)


@dataclass(frozen=True)
class Violation:
    """A cross-field rule broken: ``field`` must be ``op`` ``bound``, a bound made of ``terms``.

    For ``>=`` the bound is the sum of ``terms``; for ``<=`` it is the first term less the rest
    (the same rule read from one of its parts). ``value`` is what ``field`` holds.
    """

    field: str
    op: str
    terms: tuple[str, ...]
    bound: int
    value: int

    def words(self, name: Callable[[str], str] = str) -> str:
        """The reason, as ``must be >= sinks + window (132)``; ``name`` names each field (a dotted key...)."""
        joined = (" + " if self.op == ">=" else " - ").join(name(t) for t in self.terms)
        return f"must be {self.op} {joined} ({self.bound})"


@dataclass(frozen=True)
class CrossRule:
    """``field >= sum(parts)``: a rule between settings."""

    field: str
    parts: tuple[str, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field the rule involves: ``field`` first, then the parts from the last."""
        return (self.field, *reversed(self.parts))

    def holds(self, values: Mapping[str, int]) -> bool:
        return values[self.field] >= sum(values[p] for p in self.parts)

    def violation(self, values: Mapping[str, int], blamed: str | None = None) -> Violation | None:
        """None when the rule holds; else how it is broken, read from ``blamed`` (default ``field``)."""
        if self.holds(values):
            return None
        blamed = blamed or self.field
        if blamed == self.field:
            return Violation(blamed, ">=", self.parts, sum(values[p] for p in self.parts), values[blamed])
        others = tuple(p for p in self.parts if p != blamed)
        bound = values[self.field] - sum(values[p] for p in others)
        return Violation(blamed, "<=", (self.field, *others), bound, values[blamed])


# In the order they are checked: a later rule is read only once the earlier ones hold.
CROSS_RULES = (CrossRule("window", ("sinks",)), CrossRule("max_kv_tokens", ("sinks", "window")))


def first_violation(values: Mapping[str, int]) -> Violation | None:
    """The first broken cross-field rule, read from its own ``field``; None when all hold."""
    for rule in CROSS_RULES:
        broken = rule.violation(values)
        if broken is not None:
            return broken
    return None


class CacheConfigError(ValueError):
    """A cache setting that cannot work; the message names the setting and the reason."""


class _SettingsRules:
    """What :data:`CacheSettings` does; its fields, one per knob of SETTINGS_KNOBS, are made below."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:  # "auto" is the session's policy: a cache runs one of MODES
            raise CacheConfigError(f"mode: unknown cache mode {self.mode!r} (choose from {', '.join(MODES)})")
        for knob in SETTINGS_KNOBS:
            value = getattr(self, knob.name)
            problem = None if knob is MODE_KNOB else knob.problem(value)
            if problem is not None:
                raise CacheConfigError(f"{knob.name}: {problem} (got {value!r})")
        broken = first_violation(vars(self))
        if broken is not None:
            raise CacheConfigError(f"{broken.field}: {broken.words()} (got {broken.value})")

    @property
    def evicts(self) -> bool:
        return self.mode in EVICTING

    @property
    def quantizes(self) -> bool:
        return self.mode in QUANTIZING

    @property
    def budget(self) -> int | None:
        """Most tokens held after maintenance, or None when the cache keeps everything."""
        if self.mode == "window":
            return self.sinks + self.window
        if self.mode in CAPPED:
            return self.max_kv_tokens
        return None

    def pinning(self, n: int) -> "CacheSettings":
        """These settings with the first ``n`` tokens (the system prompt) never evicted.

        The evicting modes keep their ``sinks`` forever, so pinning raises ``sinks`` to cover
        them, within the same budget: at most half of it (and no more than the recent window,
        which validate() asks), so the prompt never crowds out the recent turns. ``window``
        gives the extra pinned tokens from its recent window (its budget is sinks + window);
        the budgeted modes keep ``max_kv_tokens`` and shrink the window only where it no
        longer fits. Modes that never evict are returned unchanged.
        """
        if not self.evicts or n <= self.sinks:
            return self
        budget = self.budget
        if self.mode == "window":
            keep = min(n, budget // 2)
            return replace(self, sinks=keep, window=budget - keep) if keep > self.sinks else self
        keep = min(n, budget // 2, self.window)
        if keep <= self.sinks:
            return self
        return replace(self, sinks=keep, window=min(self.window, budget - keep))

    def with_(self, **changes) -> "CacheSettings":
        return replace(self, **changes)

    def fitted(self, max_positions: int | None) -> tuple["CacheSettings", list[str]]:
        """Shrink the window settings so an evicting cache never passes the trained context.

        An evicting cache holds at most budget + evict_chunk tokens before it evicts, and the
        engine prefills evicting caches in steps of at most evict_chunk, so positions stay below
        budget + 2 * evict_chunk. Returns the fitted settings and a note for each change.
        """
        if not self.evicts or max_positions is None:
            return self, []
        if self.budget + 2 * self.evict_chunk <= max_positions:
            return self, []
        notes = []
        chunk = self.evict_chunk
        if 8 * chunk > max_positions:
            chunk = max(1, max_positions // 8)
            notes.append(f"evict_chunk {self.evict_chunk} -> {chunk}")
        room = max_positions - 2 * chunk
        sinks = min(self.sinks, room // 2)
        if sinks != self.sinks:
            notes.append(f"sinks {self.sinks} -> {sinks}")
        window, budget = self.window, self.max_kv_tokens
        if self.mode == "window":
            window = min(window, room - sinks)
            budget = max(budget, sinks + window)
        else:
            budget = min(budget, room)
            window = min(window, budget - sinks)
        if window != self.window:
            notes.append(f"window {self.window} -> {window}")
        if self.mode != "window" and budget != self.max_kv_tokens:
            notes.append(f"max_kv_tokens {self.max_kv_tokens} -> {budget}")
        fitted = replace(self, evict_chunk=chunk, sinks=sinks, window=window, max_kv_tokens=budget)
        why = f"to stay inside the model's trained context of {max_positions} positions"
        return fitted, [f"{n} {why}" for n in notes]


# The settings of one cache, frozen and validated on construction: a field per knob of
# SETTINGS_KNOBS with its default, the mode's being what the default config's mode starts as.
CacheSettings = make_dataclass(
    "CacheSettings",
    [(k.name, k.type, field(default=starting_mode(k.default) if k is MODE_KNOB else k.default))
     for k in SETTINGS_KNOBS],
    bases=(_SettingsRules,), frozen=True,
    # __module__ by hand: make_dataclass's module= is Python 3.12's (pickle finds the class by it)
    namespace={"__module__": __name__,
               "__doc__": "The settings of one cache: a field per knob of SETTINGS_KNOBS, validated."},
)


def knob_types() -> dict[str, type]:
    """Every knob ``/mode`` may set (CacheSettings' fields but the mode, which is chosen on its own),
    with its type: a knob added to KNOBS reaches ``/mode`` with nothing restated."""
    return {k.name: k.type for k in SETTINGS_KNOBS if k is not MODE_KNOB}


def knob_choices(name: str) -> tuple | None:
    """The values a choice knob takes (``kv_bits``, ``kv_key_layout``...), None for a free one."""
    return next((k.choices or None for k in KNOBS if k.name == name), None)


def knob_values(source: object, knobs: Iterable[Knob] = SETTINGS_KNOBS) -> dict[str, Any]:
    """``{name: value}`` of ``knobs`` read from ``source``: a CacheSettings, the ``[cache]`` config..."""
    return {k.name: getattr(source, k.name) for k in knobs}
