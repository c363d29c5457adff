"""How one configuration setting's value is checked: the rules of :mod:`chatapp.config`.

A :class:`Rule` normalises a value read from a TOML file (or parses one given as command-line
text) and raises :class:`Invalid` with the reason when it does not pass; :func:`setting` attaches
a default and its rule to a config dataclass field. :mod:`chatapp.config` adds the file and the
key to the reason (``ConfigError``). No MLX, no other chatapp module: a leaf like ``config``.
"""

from __future__ import annotations

import json
import math
from dataclasses import field
from typing import Any


class Invalid(Exception):
    """Raised by a rule; carries the reason only (file and key are added later)."""


def one_line(text: str) -> str:
    """Replace line breaks (of any kind) with spaces; other whitespace is kept."""
    return " ".join(text.splitlines()) if text else text


def fmt_value(value: Any) -> str:
    """A value as it would be written in TOML, kept short and on one line."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, (int, float)):
        text = repr(value)
    else:
        text = repr(value)
    text = one_line(text)
    return text if len(text) <= 80 else text[:77] + "..."


def _num(x: float) -> str:
    return f"{x:g}"


# --------------------------------------------------------------------------- rules


class Rule:
    """How one setting is checked (and parsed from command-line text)."""

    description = ""
    bounds = ""  # the range alone (">= 0", "> 0 and <= 1"), for messages that name the type elsewhere

    def check(self, value: Any) -> Any:
        """Return the normalised value or raise :class:`Invalid`."""
        raise NotImplementedError

    def parse_text(self, text: str) -> Any:
        """Turn command-line text into a value of the right type (best effort)."""
        return text

    def fail(self, value: Any) -> Invalid:
        return Invalid(f"{self.description} (got {fmt_value(value)})")


class Str(Rule):
    def __init__(self, nonempty: bool = False) -> None:
        self.nonempty = nonempty
        self.description = "must be a non-empty string" if nonempty else "must be a string"

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or (self.nonempty and not value.strip()):
            raise self.fail(value)
        return value


class Bool(Rule):
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


class Int(Rule):
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


class Float(Rule):
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


class Choice(Rule):
    def __init__(self, *choices: str | int) -> None:
        self.choices = choices
        self.description = "must be one of " + ", ".join(fmt_value(c) for c in choices)

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


class Seed(Rule):
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


def setting(default: Any, rule: Rule) -> Any:
    return field(default=default, metadata={"rule": rule})
