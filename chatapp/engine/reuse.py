"""What a turn keeps of the caches: the longest prefix the cached tokens share with the new prompt.

Each turn renders the whole conversation; the caches are trimmed back to the tokens they share
with that rendering, so a new turn prefills only its new tokens and regenerate / edit-last cost
only what changed. Where the caches cannot be trimmed there (the divergence lies in history an
evicting cache already dropped, or mlx-lm layers that cannot drop their last tokens) the
conversation runs again from the start. :meth:`chatapp.engine.session.Session.reply` acts on the
answer (:class:`Reuse`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cache.layers import is_ours, primary, trim_reason
from chatapp.prompt.conversation import common_prefix


@dataclass(frozen=True)
class Reuse:
    tokens: int  # leading cached tokens the turn keeps (the caches are trimmed to them)
    restart: bool = False  # the caches must start over empty: the whole prompt is prefilled
    reason: str = ""  # why, when the user is told (a restart forced by the model's layers)


def trim_to_prompt(caches: list, cached: list[int], prompt: list[int], sinks: int) -> Reuse:
    """Trim ``caches`` (holding the tokens ``cached``, evicted ones included) back to the longest
    prefix they share with ``prompt``, keeping at least its last token to run again (it gives the
    next token's logits). ``sinks``: the leading tokens an evicting cache never evicts (0 for the
    modes that keep every token). ``cached`` itself is left to the caller."""
    common = common_prefix(cached, prompt)
    if common == len(prompt):
        common -= 1  # the last prompt token must run again to give the next token's logits
    first = primary(caches)
    evicted = getattr(first, "evicted", 0)
    # Tokens before this conversation index may have been evicted: the window modes evict
    # the oldest non-sinks; the scored mode anywhere before its contiguous tail.
    tail = getattr(first, "contiguous_tail", None)
    floor = sinks + evicted if tail is None else len(cached) - tail
    if evicted and common < floor:
        return Reuse(0, restart=True)  # the divergence lies in history the window already dropped
    drop = len(cached) - common
    if drop:
        why = trim_reason(caches, drop)
        if why:
            # mlx-lm's own layers that cannot drop their last tokens (recurrent state, a wrapped
            # sliding window): the conversation runs again from the start
            return Reuse(0, True, f"re-prefilled the conversation: the last {drop} cached tokens changed and "
                                  f"this model's {why}")
        short = [c for c in caches if c.trim(drop) != drop and not is_ours(c)]
        if short:
            return Reuse(0, True, f"re-prefilled the conversation: {type(short[0]).__name__} layers could not "
                                  f"drop the last {drop} cached tokens")
    return Reuse(common)
