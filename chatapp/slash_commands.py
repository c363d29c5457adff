"""The stdin command language of ``--no-tui`` and of a distributed job's rank 0 (no MLX here).

Shared by the single-process loop (:mod:`chatapp.stdin_chat`) and the distributed job, so both
behave the same::

    /mode MODE [key=value ...]   switch the cache mode now (auto, concat, prealloc, quantized,
                                 window, window-quant); keys: every CacheSettings knob (window,
                                 sinks, evict_chunk, kv_bits, kv_group_size, max_kv_tokens,
                                 quant_start, chunk_size, kv_key_layout=token|channel)
    /set key=value [...]         change sampling: temp, top_p, top_k, min_p, max_tokens, seed
                                 (-1 = random), repetition_penalty
    /quit  (or /exit)            end the conversation; needed under mlx.launch, which never
                                 passes the end of its stdin on to the ranks
    //text                       a message that starts with "/" (the first "/" is dropped)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache.settings import MODE_CHOICES, knob_choices, knob_types, starting_mode
from chatapp.config import setting_bounds, valid_setting

CACHE_KNOBS = knob_types()  # every CacheSettings knob and its type: kv_key_layout included
CACHE_KEYS = tuple(CACHE_KNOBS)
SAMPLING_KEYS = ("temp", "top_p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty")


class CommandError(ValueError):
    """A stdin command that cannot be run; ``str()`` is one line for the user."""


@dataclass
class Command:
    kind: str  # "send", "mode", "set", "quit"
    text: str = ""
    mode: str = ""
    changes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "text": self.text, "mode": self.mode, "changes": self.changes}

    @classmethod
    def from_json(cls, d: dict) -> "Command":
        return cls(d["kind"], d.get("text", ""), d.get("mode", ""), dict(d.get("changes") or {}))


def _number(key: str, raw: str, integer: bool) -> int | float:
    try:
        return int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise CommandError(f"{key}: must be {kind} (got {raw!r})") from None


def _knob(key: str, raw: str) -> int | str:
    """A /mode value of its knob's type; a choice knob's value must be one of its choices."""
    if CACHE_KNOBS[key] is int:
        return _number(key, raw, True)
    choices = knob_choices(key)
    if choices is not None and raw not in choices:
        raise CommandError(f"{key}: must be one of {', '.join(map(str, choices))} (got {raw!r})")
    return raw


def _pairs(words: list[str], allowed: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for w in words:
        key, eq, value = w.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key or not value:
            raise CommandError(f"{what}: expected key=value, got {w!r}")
        if key not in allowed:
            raise CommandError(f"{what}: unknown setting {key!r} (choose from {', '.join(allowed)})")
        out[key] = value.strip()
    return out


def _check_sampling(changes: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in changes.items():
        integer = key in ("top_k", "max_tokens", "seed")
        v = _number(key, raw, integer)
        if not valid_setting(f"sampling.{key}", v):  # the [sampling] rules of config.py
            raise CommandError(f"{key}: must be {setting_bounds(f'sampling.{key}')} (got {raw})")
        out[key] = v
    return out


def parse_line(line: str) -> Command | None:
    """One stdin line as a command; None for a blank line. Raises CommandError.

    ``/mode MODE [key=value ...]``, ``/set key=value ...``, ``//text`` (a message starting with
    "/"); anything else is a message to send.
    """
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    if line.startswith("//"):
        return Command("send", text=line[1:])
    if not line.startswith("/"):
        return Command("send", text=line)
    words = line[1:].split()
    name, args = (words[0].lower(), words[1:]) if words else ("", [])
    if name == "mode":
        if not args:
            raise CommandError(f"/mode: name a mode ({', '.join(MODE_CHOICES)})")
        mode = args[0].lower()
        if mode not in MODE_CHOICES:
            raise CommandError(f"/mode: unknown cache mode {args[0]!r} (choose from {', '.join(MODE_CHOICES)})")
        raw = _pairs(args[1:], CACHE_KEYS, "/mode")
        changes = {k: _knob(k, v) for k, v in raw.items()}
        return Command("mode", mode=mode, changes=changes)
    if name in ("quit", "exit"):
        if args:
            raise CommandError(f"/{name} takes no arguments")
        return Command("quit")
    if name == "set":
        if not args:
            raise CommandError(f"/set: give key=value ({', '.join(SAMPLING_KEYS)})")
        return Command("set", changes=_check_sampling(_pairs(args, SAMPLING_KEYS, "/set")))
    raise CommandError(f"unknown command /{name} (commands: /mode, /set, /quit; start a message with // "
                       "to send one that begins with '/')")


def validate_command(session, cmd: Command) -> None:
    """Refuse, before anything changes, a command this session cannot run (CommandError)."""
    if cmd.kind == "mode":
        from cache import CacheConfigError, check_settings

        target = starting_mode(cmd.mode)
        try:
            settings = session.base_settings.with_(mode=target, **cmd.changes)
            settings, _ = settings.fitted(session.geometry.max_positions)
            check_settings(settings, session.geometry)
        except CacheConfigError as e:
            raise CommandError(f"/mode {cmd.mode}: {e}") from None
        except TypeError as e:  # a key CacheSettings does not have
            raise CommandError(f"/mode {cmd.mode}: {e}") from None


def apply_command(session, cmd: Command) -> str:
    """Run a ``mode`` or ``set`` command on ``session``; returns the line to show the user.

    (``send`` commands are turns: the caller runs ``session.send(cmd.text)``.)
    """
    if cmd.kind == "mode":
        report = session.switch_mode(cmd.mode, **cmd.changes)
        return report.line()
    if cmd.kind == "set":
        changes = dict(cmd.changes)
        if "seed" in changes and changes["seed"] == -1:
            changes["seed"] = None
        session.set_generation(**changes)
        shown = ", ".join(f"{k}={cmd.changes[k]}" for k in cmd.changes)
        return f"sampling: {shown}"
    raise ValueError(f"apply_command does not run {cmd.kind!r} commands")


# =============================================================================================
# Errors
