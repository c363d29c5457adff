"""Compare cache modes on the conversation's last turn (F5 in the TUI): a copy of the session per mode."""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx

from cache import CacheConfigError, CacheSettings, make_caches
from cache.layers import position
from cache.usage import total_usage

from .events import CompareRow, TurnDone
from .generate import GenerationSettings
from .route import decode_route
from .session import Session


def compare_modes(session: Session, modes: list[str], max_tokens: int = 64) -> Iterator[CompareRow]:
    """Replay the conversation's last turn in each mode on a copy of the session.

    Each copy first prefills the history before the last user message (not timed), then runs
    the last turn greedily and reports its TTFT and decode rate, so the modes are compared on
    the same context.
    """
    conv = session.conversation.copy()
    if conv.last and conv.last.role == "assistant":
        conv.messages.pop()
    i = conv.last_index("user")
    if i is None:
        return
    history = conv.copy()
    del history.messages[i:]
    gen = GenerationSettings(temp=0.0, max_tokens=max_tokens)
    session.start_request()
    # Warm up (first-call kernel set-up would otherwise be charged to the first mode).
    warm = make_caches(session.model, CacheSettings(mode="prealloc"), session.geometry)
    mx.eval(session.model(mx.array([[0, 1]]), cache=warm))
    for mode in modes:
        if session.cancel_token.is_set():
            return
        try:
            # Cancelling the session stops the comparison too: the twin shares its cancel token.
            twin = Session(session.model, session.tokenizer, cache_settings=session.base_settings, mode=mode,
                           long_after=session.long_after, generation=gen, prompt_format=session.format,
                           cancel=session.cancel_token)
        except CacheConfigError as e:
            yield CompareRow(mode, 0, 0, 0.0, 0.0, 0.0, 0, "", error=str(e))
            continue
        twin.conversation = history.copy()
        if history.messages:
            twin.prefill(twin.format.tokens(history, generation_prompt=False))
        twin.conversation = conv.copy()
        context = position(twin.caches)
        done = None
        for ev in twin.reply():
            if isinstance(ev, TurnDone):
                done = ev
        s = done.stats
        usage = total_usage(twin.caches)
        yield CompareRow(mode, context, s.prompt_tokens, s.ttft, s.prefill_tps, s.decode_tps,
                         s.generated_tokens, done.text, kv_held=usage.bytes_held,
                         kv_allocated=usage.bytes_allocated, route=decode_route(twin.model, twin.caches))
        del twin
