"""Warm starts from stored prefixes: the engine's side of the shared-prefix KV store.

The store (``chatapp/store/prefixes.py``) keeps the full-precision K/V of conversation prefixes
on disk. The session sees it only through a :class:`PrefixSource`: when a turn starts with empty
caches (a new conversation, ``Ctrl+N``, a resume without a usable snapshot), ``lookup`` returns
the K/V of the longest stored prefix of the prompt; :func:`warm_start` rebuilds prealloc caches
from them and hands them to ``Session.restore_state``, which converts them into the session's own
cache mode exactly as a live mode switch converts (quantising, windowing).

The other direction, :func:`full_precision_kv`, gives the K/V a prefix would have in a prealloc
cache prefilled from empty: taken from the live caches when they hold those tokens exactly, else
computed by running the tokens through the model into fresh prealloc caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from cache import CacheConfigError, make_caches
from cache.factory import restore_caches
from cache.layers import uniform
from chatapp.backend.qlinear import last_position_only
from chatapp.prompt.conversation import common_prefix

from .stats import TurnStats

# engine.session.Session: that module imports this one, so the name is only an alias here (no circle).
Session = Any

KV = list[tuple[mx.array, mx.array]]  # per layer: keys, values [1, kv_heads, tokens, head_dim]


@dataclass
class PrefixHit:
    tokens: int  # how many leading prompt tokens ``kv`` covers
    kv: KV


class PrefixSource(Protocol):
    def lookup(self, tokens: list[int]) -> PrefixHit | None:
        """The K/V of the longest stored prefix of ``tokens`` (None when nothing useful is stored)."""


def prealloc_settings(session: "Session"):
    """The settings a full-precision, never-evicting cache of this session uses."""
    return session.base_settings.with_(mode="prealloc")


def warm_start(session: "Session", prompt: list[int], stats: TurnStats) -> None:
    """Fill the session's empty caches from the prefix store, when it holds part of ``prompt``.

    The last prompt token is never taken from the store: it must run to give the next token's
    logits. Time spent (lookup, reading, conversion) is the turn's, so it counts in the TTFT.
    """
    source = session.prefix_source
    if source is None or session.cached or len(prompt) < 2 or not session.stores_kv:
        return
    t0 = time.perf_counter()
    hit = source.lookup(prompt[:-1])
    if hit is None or not hit.tokens:
        return
    settings = prealloc_settings(session)
    try:
        caches = restore_caches(session.model, settings, [[k, v] for k, v in hit.kv],
                                [("0", "0")] * len(hit.kv), session.geometry)
    except (CacheConfigError, ValueError) as e:  # CacheStateError is a ValueError
        stats.notices.append(f"prefix store: the stored prefix does not fit this model ({e}); prefilling instead")
        return
    report = session.restore_state(caches, prompt[: hit.tokens], settings, exact=True)
    stats.prefix_tokens = hit.tokens
    stats.prefix_seconds = time.perf_counter() - t0
    if report is not None:
        stats.notices.append(f"prefix store: {report.line()}")


def exact_length(session: "Session", tokens: list[int]) -> int:
    """How many leading ``tokens`` the live caches hold exactly as a prealloc prefill would have
    made them (full precision, nothing evicted, never converted lossily); 0 when they do not."""
    if not session.kv_exact or not session.caches:
        return 0
    if not uniform(session.caches):  # mlx-lm's own layers: their state is not per-layer K/V
        return 0
    for c in session.caches:
        usage = c.usage()
        if usage.evicted or usage.quant_tokens:
            return 0
    return common_prefix(session.cached, tokens)


def full_precision_kv(session: "Session", tokens: list[int], chunk: int = 512) -> tuple[KV, int]:
    """The K/V of ``tokens`` at full precision, as a prealloc cache prefilled from empty holds
    them; also returns how many tokens had to be run through the model for it (0 when the live
    caches held them all)."""
    have = exact_length(session, tokens)
    caches = make_caches(session.model, prealloc_settings(session), session.geometry)
    if have:
        for live, new in zip(session.caches, caches):
            k, v = live.content()
            new.absorb(k[:, :, :have], v[:, :, :have])
    rest = tokens[have:]
    for i in range(0, len(rest), chunk):
        with last_position_only():  # no logits are read: the CPU head computes the least it can
            session.model(mx.array([rest[i : i + chunk]]), cache=caches)
        mx.eval([c.state for c in caches])
    kv = [c.content() for c in caches]
    mx.eval(kv)
    return kv, len(rest)


__all__ = ["KV", "PrefixHit", "PrefixSource", "exact_length", "full_precision_kv", "prealloc_settings", "warm_start"]
