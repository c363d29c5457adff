"""What the KV cache holds of each message: a per-message map for the transcript's markers.

MLX-free: :func:`layout_of` reads a few integers from the first layer's cache object (every
layer holds the same positions), :func:`message_map` is plain arithmetic on token spans, so the
result (:class:`MessageCache` rows) can cross the engine thread and be tested without a model.

Where each conversation position lives, for the segmented caches (cache/kv.py) in sequence
order: ``sinks`` at full precision | the ``evicted`` run | the quantised middle | the recent
tokens at full precision. The scored mode (cache/scored.py) evicts anywhere in the middle, so
its evicted tokens are known only as a count within ``[sinks, scattered_end)``: each message
there gets its share of them (``approximate``). Positions past the tokens the cache
represents are not yet prefilled. Tokens a restore put in (prefix store, KV snapshot) and
still held are counted as restored.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from cache.usage import layer_usage

# The states a message's marker shows, in the order the legend lists them.
STATES = ("held", "restored", "quantised", "partly evicted", "evicted", "pending")
STATE_HELP = {
    "held": "in the KV cache at full precision",
    "restored": "in the KV cache, loaded from the prefix store or the conversation's KV snapshot",
    "quantised": "in the KV cache, part or all of it quantised (8- or 4-bit)",
    "partly evicted": "some of its tokens were evicted: the model no longer sees them",
    "evicted": "outside the model's window: the model no longer sees it",
    "pending": "not yet prefilled: the next turn runs it through the model",
}


@dataclass(frozen=True)
class CacheLayout:
    """Where the cache's positions lie, in conversation token positions."""

    tokens: int  # conversation tokens the cache represents (evicted ones included)
    sinks: int = 0  # leading tokens always held at full precision
    evicted: int = 0
    quant: int = 0  # tokens held quantised (right after the evicted run)
    quant_bits: int = 0
    scattered_end: int | None = None  # scored: evicted tokens lie anywhere in [sinks, scattered_end)
    restored: int = 0  # leading tokens a restore put in, still held as restored


@dataclass
class MessageCache:
    """One message: its token span and how many of its tokens are where."""

    index: int
    start: int
    end: int
    full: int = 0
    quant: int = 0
    evicted: int = 0
    pending: int = 0
    restored: int = 0
    quant_bits: int = 0
    approximate: bool = False  # scored mode: the evicted count is this message's share, not exact

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def state(self) -> str:
        n = self.tokens
        if n <= 0 or self.pending >= n:
            return "pending" if self.pending else "held"
        if self.evicted >= n:
            return "evicted"
        if self.evicted:
            return "partly evicted"
        if self.quant:
            return "quantised"
        if self.restored and 2 * self.restored >= self.full:  # most of it (a turn re-runs the last token or two)
            return "restored"
        return "held"

    def text(self) -> str:
        """The marker's text form (screen readers, snapshot tests): ``kv held``, ``kv 8-bit 40/60``…"""
        state, n = self.state, self.tokens
        if state == "quantised":
            share = "" if self.quant >= n else f" {self.quant}/{n} tok"
            return f"kv {self.quant_bits}-bit{share}" if self.quant_bits else f"kv quantised{share}"
        if state == "partly evicted":
            about = "~" if self.approximate else ""
            return f"kv {about}{self.evicted}/{n} tok evicted"
        if state == "restored":
            return "kv restored"
        if state == "pending":
            return "kv not yet prefilled"
        return f"kv {state}"

    def to_json(self) -> dict:
        return {**asdict(self), "state": self.state}


def layout_of(caches: Sequence[Any], tokens: int, restored: int = 0) -> CacheLayout:
    """The layout of a session's caches (``session.caches``) representing ``tokens`` positions."""
    if not caches:
        return CacheLayout(tokens=0)
    from cache.layers import primary  # here: it imports mlx-lm, which the UI's first screen need not wait for

    c = primary(caches)
    usage = layer_usage(c)
    evicted = int(usage.evicted)
    quant = int(usage.quant_tokens)
    sinks = min(int(getattr(c, "sinks", 0) or 0), tokens)
    tail = getattr(c, "contiguous_tail", None)
    bits = int(getattr(getattr(c, "quant", None), "bits", 0) or 0)
    scattered = None
    if tail is not None and evicted:
        scattered = max(sinks, tokens - int(tail))
    return CacheLayout(tokens=tokens, sinks=sinks, evicted=evicted, quant=quant, quant_bits=bits,
                       scattered_end=scattered, restored=max(0, min(restored, tokens)))


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


def message_map(layout: CacheLayout, starts: Sequence[int], end: int | None = None) -> list[MessageCache]:
    """One :class:`MessageCache` per message; ``starts``: each message's first token position in
    the rendered conversation; ``end``: where the last message ends (default: the cache's tokens)."""
    L = layout
    n = len(starts)
    last = max(L.tokens, starts[-1] if starts else 0) if end is None else end
    bounds = list(starts) + [last]
    s = L.sinks
    ev0, ev1 = s, s + L.evicted
    q0, q1 = ev1, ev1 + L.quant
    if L.scattered_end is not None:  # scored: no positional evicted run, no quantised middle
        ev0, ev1, q0, q1 = s, L.scattered_end, 0, 0
    span = max(1, ev1 - ev0)
    out = []
    for i in range(n):
        a, b = bounds[i], max(bounds[i], bounds[i + 1])
        m = MessageCache(index=i, start=a, end=b, quant_bits=L.quant_bits)
        m.pending = max(0, b - max(a, L.tokens))
        held_end = min(b, L.tokens)
        if L.scattered_end is not None:
            part = _overlap(a, held_end, ev0, ev1)
            m.evicted = round(part * L.evicted / span) if part else 0
            m.approximate = bool(m.evicted)
        else:
            m.evicted = _overlap(a, held_end, ev0, ev1)
            m.quant = _overlap(a, held_end, q0, q1)
        m.full = max(0, held_end - a) - m.evicted - m.quant if held_end > a else 0
        # Restored tokens are positions [0, restored) that are still held (not evicted).
        restored = _overlap(a, held_end, 0, L.restored)
        if L.scattered_end is None:
            restored -= _overlap(a, held_end, ev0, min(ev1, L.restored))
        m.restored = max(0, min(restored, m.full + m.quant))
        out.append(m)
    return out


# ---- message starts, memoised per session ---------------------------------------------------------
# Rendering each message's prefix costs one tokenisation per message; a new turn only appends
# messages, so the starts of an unchanged prefix are kept (keyed by the messages themselves).
_STARTS: "weakref.WeakKeyDictionary[Any, list[tuple[tuple, int]]]" = weakref.WeakKeyDictionary()


def message_starts(owner: Any, messages: Sequence[Any], start_of: Callable[[int], int]) -> list[int]:
    """Each message's first token position; ``start_of(i)`` renders messages[:i] and counts its
    tokens. Results for an unchanged prefix of ``messages`` are reused from the last call."""
    keys = [(m.role, m.content, getattr(m, "raw", None), getattr(m, "interrupted", False)) for m in messages]
    try:
        memo = _STARTS.setdefault(owner, [])
    except TypeError:  # not weak-referenceable: no memo
        memo = []
    same = 0
    while same < min(len(memo), len(keys)) and memo[same][0] == keys[same]:
        same += 1
    del memo[same:]
    for i in range(same, len(keys)):
        memo.append((keys[i], start_of(i) if i else 0))
    return [start for _, start in memo]


def session_map(session: Any) -> tuple[list[int], list[MessageCache]]:
    """(message starts, per-message map) of an engine Session as it stands (re-tokenises only
    the messages added since the last call)."""
    from chatapp.prompt.conversation import Conversation

    msgs = list(session.conversation.messages)
    fmt = session.format
    # One more "message" past the last: its start is where the rendered conversation ends, so a
    # last message not yet prefilled (a system prompt after Ctrl+N) shows as pending.
    bounds = message_starts(session, msgs + [_END],
                            lambda i: len(fmt.tokens(Conversation(msgs[:i]), generation_prompt=False)))
    starts = bounds[:-1]
    layout = layout_of(session.caches, len(session.cached), getattr(session, "restored", 0))
    return starts, message_map(layout, starts, end=max(len(session.cached), bounds[-1]) if msgs else None)


class _EndMark:
    role, content = "", ""


_END = _EndMark()


def evicted_turns(rows: Sequence[MessageCache], roles: Sequence[str]) -> tuple[list[int], bool]:
    """(turn numbers with evicted tokens, whether the last of them is only partly evicted). A
    turn is a user message and what follows it; turn 1 is the first user message's."""
    turn, turns, partial = 0, [], False
    touched: dict[int, list[MessageCache]] = {}
    for m, role in zip(rows, roles):
        if role == "user":
            turn += 1
        if role == "system" or turn == 0:
            continue
        touched.setdefault(turn, []).append(m)
    for t, ms in touched.items():
        if any(m.evicted for m in ms):
            turns.append(t)
            partial = not all(m.state == "evicted" for m in ms)
    return turns, partial


def eviction_notice(rows: Sequence[MessageCache], roles: Sequence[str], kept_tokens: int) -> str:
    """The one-time transcript notice when the policy first evicts part of the conversation
    ("" while no turn is touched). ``kept_tokens``: tokens held after the evicted part."""
    turns, partial = evicted_turns(rows, roles)
    if not turns:
        return ""
    first, last = turns[0], turns[-1]
    if first == last:
        head = f"turn {first} is now {'partly ' if partial else ''}outside the window"
    else:
        head = f"turns {first}-{last} are now outside the window" + (f" (turn {last} partly)" if partial else "")
    sys_rows = [m for m, r in zip(rows, roles) if r == "system"]
    kept = ("the system prompt" if sys_rows and all(m.evicted == 0 for m in sys_rows)
            else "the first tokens (attention sinks)")
    return f"{head}; {kept} and the last {kept_tokens:,} tokens are kept"


__all__ = ["CacheLayout", "MessageCache", "STATES", "STATE_HELP", "eviction_notice", "evicted_turns",
           "layout_of", "message_map", "message_starts", "session_map"]
