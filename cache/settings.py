"""Cache settings: one frozen dataclass, validated on construction, with clear messages.

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

from dataclasses import dataclass, replace
from typing import Callable, Mapping

MODES = ("concat", "prealloc", "quantized", "window", "window-quant", "scored", "scored-quant")
# What a user may ask for: a mode, or "auto" (the session's policy: prealloc while short, a
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

# The rules of the cache settings, written once: config, the mode dialog and CacheSettings.validate
# each word them (dotted keys, dialog fields, setting names) but none restates them.
MINIMUM = {"chunk_size": 1, "window": 1, "evict_chunk": 1, "max_kv_tokens": 1, "sinks": 0, "quant_start": 0}
CHUNK_MULTIPLE = 256  # chunk_size: preallocation grows in whole multiples of this
CHOICES = {"kv_bits": QUANT_BITS, "kv_group_size": QUANT_GROUP_SIZES}


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


@dataclass(frozen=True)
class CacheSettings:
    mode: str = "prealloc"
    chunk_size: int = 256  # preallocation growth step; a multiple of 256
    sinks: int = 4  # attention-sink tokens kept at the start (window modes)
    window: int = 1024  # recent tokens kept at full precision (window modes)
    evict_chunk: int = 256  # tokens evicted / quantised at a time, so the cost is amortised
    kv_bits: int = 8
    kv_group_size: int = 64
    quant_start: int = 512  # quantized mode: tokens held at full precision before converting
    max_kv_tokens: int = 4096  # window-quant, scored: token budget; older non-sink tokens are evicted
    kv_key_layout: str = "token"  # quantised keys grouped per token or per channel (KEY_LAYOUTS)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise CacheConfigError(f"mode: unknown cache mode {self.mode!r} (choose from {', '.join(MODES)})")
        for name, lowest in MINIMUM.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < lowest:
                what = "a positive integer" if lowest == 1 else f"an integer >= {lowest}"
                raise CacheConfigError(f"{name}: must be {what} (got {value!r})")
        if self.chunk_size % CHUNK_MULTIPLE:
            raise CacheConfigError(f"chunk_size: must be a multiple of {CHUNK_MULTIPLE} (got {self.chunk_size})")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise CacheConfigError(f"{name}: must be one of {choices} (got {value!r})")
        if self.kv_key_layout not in KEY_LAYOUTS:
            raise CacheConfigError(
                f"kv_key_layout: must be one of {', '.join(KEY_LAYOUTS)} (got {self.kv_key_layout!r})"
            )
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


def knob_types() -> dict[str, type]:
    """Every cache knob a user may set, with its type, read from :class:`CacheSettings`' fields (the
    mode is chosen on its own): a knob added there reaches ``/mode`` with nothing restated."""
    from dataclasses import fields

    return {f.name: type(f.default) for f in fields(CacheSettings) if f.name != "mode"}


def knob_choices(name: str) -> tuple | None:
    """The values a choice knob takes (``kv_bits``, ``kv_key_layout``...), None for a free one."""
    return {**CHOICES, "kv_key_layout": KEY_LAYOUTS}.get(name)
