"""Move a conversation onto another model's session (the TUI's switch-model dialog).

The new session gets a copy of the conversation and prefills it at once, so the cost is paid
and reported when the user switches, not hidden in the next reply's TTFT.
"""

from __future__ import annotations

import gc
import time

import mlx.core as mx


def adopt_conversation(new, old) -> tuple[int, float]:
    """Give session ``new`` a copy of ``old``'s conversation and prefill it; returns (tokens, seconds)."""
    new.load_conversation(old.conversation.copy())
    if not any(m.role == "user" for m in new.conversation.messages):
        return 0, 0.0  # a system prompt alone is prefilled with the first message, as in a new chat
    tokens = new.format.tokens(new.conversation, generation_prompt=False)
    t0 = time.perf_counter()
    new.prefill(tokens)
    return len(tokens), time.perf_counter() - t0


def release_memory() -> int:
    """Free what nothing references any more (the old model's weights and caches); returns MLX's
    active bytes afterwards."""
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def active_memory() -> int:
    return mx.get_active_memory()


__all__ = ["active_memory", "adopt_conversation", "release_memory"]
