"""The next token on the host, in numpy, with mlx-lm's sampling rules: for the native decode step.

mlx-lm's samplers are MLX graphs. On MLX's CPU backend each of their ops is a dispatch over the
whole vocabulary, and the default chat settings (temperature 0.7, top_p 0.95) sort it: with
SmolLM2's 49,152 logits that took 5.5 ms a token on the Xeon (greedy's logsumexp and argmax
0.8 ms), against a ~9-11 ms fused decode step. There the logits already sit in host memory
(the fused step's head writes them), and the step runs synchronously (nothing to overlap), so
the session samples them here: 0.01 ms greedy, 0.2 ms at a temperature, ~0.6 ms with top_p
0.95 on a peaked row (a nucleus wider than 4,096 tokens sorts the whole row: ~2.2 ms).

The rules are mlx-lm's ``make_sampler``'s, in its order, on log-probabilities (all of them
unchanged by the normalisation, so the raw logits do): top_p (0 < top_p < 1: drop the tokens
whose descending cumulative probability before them already reaches top_p, ties at the cut
kept), min_p (drop those below max x min_p), top_k (keep the k largest), then a categorical
draw at ``temp`` (0: the argmax, the first of ties). The draws come from numpy's generator
seeded with the settings' seed, so a seed still gives the same reply, though not MLX's.
"""

from __future__ import annotations

import math

import numpy as np

TOP_P_FIRST = 256  # candidates a top_p cut looks at first: the nucleus is usually well inside them


class HostSampler:
    """``sampler(logits)`` -> token id, for one row of float32 logits (the caller's copy: it is
    overwritten). temp, top_p, min_p, top_k as GenerationSettings holds them (top_p 0 or >= 1: off)."""

    def __init__(self, temp: float, top_p: float, min_p: float, top_k: int, seed: int | None):
        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k
        self._rng = np.random.default_rng(seed)

    def __call__(self, x: np.ndarray) -> int:
        if self.temp == 0:
            return int(np.argmax(x))
        x -= x.max()
        if 0 < self.top_p < 1.0:
            _top_p(x, self.top_p)
        if self.min_p != 0.0:
            x[x < math.log(self.min_p)] = -np.inf  # the max is 0 now
        if self.top_k > 0:
            _top_k(x, self.top_k)
        return self._categorical(x)

    def _categorical(self, x: np.ndarray) -> int:
        p = np.exp(x / np.float32(self.temp), dtype=np.float64)  # -inf: 0; the max: 1
        cum = np.cumsum(p)
        return int(min(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"), len(x) - 1))


def _top_p(x: np.ndarray, top_p: float) -> None:
    """Drop (to -inf) the tokens whose descending cumulative probability before them reaches
    top_p of the total: among the top TOP_P_FIRST candidates first, then 16 times as many, then
    the whole row, until the cut falls inside them (sorting the whole row is ~2 ms)."""
    p = np.exp(x, dtype=np.float64)
    need = top_p * p.sum()
    n = len(x)
    k = min(n, TOP_P_FIRST)
    while True:
        idx = np.argpartition(x, n - k)[n - k:] if k < n else np.arange(n)
        order = idx[np.argsort(-x[idx])]
        before = np.cumsum(p[order]) - p[order]  # the mass above each, exclusive
        kept = int(np.count_nonzero(before < need))
        if kept < k or k == n:
            break
        k = min(n, 16 * k)  # the nucleus reaches past the candidates
    x[x < x[order[kept - 1]]] = -np.inf


def _top_k(x: np.ndarray, top_k: int) -> None:
    """Keep the top_k largest (mlx-lm's range check: 0 < top_k < vocabulary)."""
    if not 0 < top_k < len(x):
        raise ValueError(f"`top_k` has to be an integer in the (0, {len(x)}) interval, but is {top_k}.")
    x[np.argpartition(-x, top_k - 1)[top_k:]] = -np.inf
