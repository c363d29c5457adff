"""Which rendering of a generated reply re-tokenises into what the cache holds.

Streaming detokenisers drop the leading space of a reply's first token (SentencePiece's "▁", a
byte-level BPE's "Ġ"); a byte-level model's reply may have none. So the text shown is not always
the text whose rendering gives back the generated tokens, and a next turn that rendered it would
find its prompt diverging from the cache inside the reply and prefill the reply again.
"""

from __future__ import annotations

from .conversation import Conversation, common_prefix
from .formats import PromptFormat


def render_as_generated(fmt: PromptFormat, conversation: Conversation, cached: list[int], raw: str) -> None:
    """Set ``raw`` on the conversation's last message (the reply just added): of the default
    rendering (None), the decoded text and the text with its leading space restored, the first
    whose transcript shares the longest prefix with ``cached``. Candidates that render the same
    are tokenised once (usually two tokenisations in all, after the reply)."""
    msg = conversation.messages[-1]
    best, best_common, tried = None, -1, set()
    for candidate in (None, raw, " " + raw):
        msg.raw = candidate
        rendering = fmt.rendering(conversation, generation_prompt=False)
        if rendering in tried:
            continue
        tried.add(rendering)
        common = common_prefix(cached, fmt.tokens(conversation, generation_prompt=False))
        if common > best_common:
            best, best_common = candidate, common
    msg.raw = best
