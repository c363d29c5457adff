"""How SentencePiece BPE encodes, as rules a ``tokenizers`` pipeline can follow.

Shared by the GGUF ``llama`` vocabulary (:mod:`chatapp.model.gguf_tokenizer`) and the legacy
``tokenizer.model`` folders (:mod:`chatapp.engine.legacy`), so both give SentencePiece's ids.
"""

from __future__ import annotations

# SentencePiece's split_by_whitespace: a "word" starts at a space ("▁"); with
# allow_whitespace_only_pieces a run of spaces stays with the word that follows it.
SPM_WORDS = {True: "\u2581*[^\u2581]+|\u2581+", False: "\u2581[^\u2581]*|[^\u2581]+"}


def score_ordered_merges(pieces: dict[str, tuple[int, float]]) -> list[tuple[str, str]]:
    """BPE merges ranked as SentencePiece applies them: by the score of the merged piece.

    ``pieces``: the normal pieces, piece -> (id, score). Ranking by piece id instead (as
    transformers does) puts whitespace-only pieces (ids 259+ in Llama 2, score -1e9, merged last
    by SentencePiece) first: "a  b" became "▁a", "▁▁", "b" instead of "▁a", "▁", "▁b".
    """
    ranked = []
    for piece, (i, score) in pieces.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in pieces and right in pieces:
                ranked.append((-score, i, pieces[left][0], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
