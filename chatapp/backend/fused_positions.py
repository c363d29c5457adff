"""Each layer's positions and RoPE angles for the fused steps (backend/fused_decode.py).

Layers need not agree: Gemma 3's sliding-window layers turn keys with a local base (10,000) and
its global ones with another (1,000,000), and a sliding layer's cache counts every token seen
(cache/sliding.py) where a full layer's policy may have compacted positions by evicting. The
kernels take cos/sin per layer; the layers that share a frequency table and a position share
one computation of them.
"""

from __future__ import annotations

import numpy as np


class LayerAngles:
    """The RoPE angles of every layer, from its frequencies ``inv_freqs`` [L, D/2]."""

    def __init__(self, inv_freqs: np.ndarray):
        self.inv_freqs = np.ascontiguousarray(inv_freqs, np.float32)
        # each layer's table's index among the distinct ones (one for Llama, two for Gemma 3)
        uniq, self.kind = np.unique(self.inv_freqs, axis=0, return_inverse=True)
        self.kind = self.kind.reshape(-1)
        self.freqs = [np.ascontiguousarray(u, np.float32) for u in uniq]
        n, half = self.inv_freqs.shape
        self.cos, self.sin = np.ones((n, half), np.float32), np.zeros((n, half), np.float32)

    def freqs_of(self, layer: int) -> np.ndarray:
        """The RoPE frequencies of ``layer`` [D/2]."""
        return self.freqs[self.kind[layer]]

    def step(self, positions: np.ndarray, out: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [L, D/2] of one token at each layer's position (decode_step.rope_angles)."""
        from chatapp.kernels.decode_step import rope_angles

        cos, sin = out if out is not None else (self.cos, self.sin)
        memo: dict[tuple[int, int], tuple] = {}
        for i, p in enumerate(positions):
            key = (int(p), int(self.kind[i]))
            if key not in memo:
                memo[key] = rope_angles(key[0], self.freqs[key[1]])
            cos[i], sin[i] = memo[key]
        return cos, sin

    def table(self, starts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [L, n, D/2] of ``n`` tokens from each layer's start (prefill_step.rope_table)."""
        from chatapp.kernels.prefill_step import rope_table

        L, half = self.inv_freqs.shape
        cos, sin = np.empty((L, n, half), np.float32), np.empty((L, n, half), np.float32)
        memo: dict[tuple[int, int], tuple] = {}
        for i, s in enumerate(starts):
            key = (int(s), int(self.kind[i]))
            if key not in memo:
                memo[key] = rope_table(key[0], n, self.freqs[key[1]])
            cos[i], sin[i] = memo[key]
        return cos, sin


def positions(caches: list) -> np.ndarray:
    """The next token's position in each layer's cache: its ``offset`` (tokens held, compacted
    where a policy evicts; every token seen for a sliding window)."""
    return np.array([c.offset for c in caches], np.int64)


def windows(caches: list) -> np.ndarray:
    """Each layer's attention window (the kernels' ``window``): a sliding cache's, else 0."""
    from cache.base import is_sliding

    return np.array([c.window_size if is_sliding(c) else 0 for c in caches], np.int64)
