"""The host sampler (chatapp/engine/sampling.py) against mlx-lm's sampling rules: the same tokens
kept by top_p, min_p and top_k, the argmax at temperature 0, draws distributed as softmax(x / temp),
and a seed giving the same draws."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from chatapp.engine.generate import GenerationSettings, TokenPicker
from chatapp.engine.sampling import TOP_P_FIRST, HostSampler, _top_k, _top_p


def _logits(seed: int, n: int, spread: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * spread).astype(np.float32)


def _mlx_kept(fn, x: np.ndarray, *args) -> np.ndarray:
    lg = mx.array(x[None])
    return np.isfinite(np.array(fn(lg - mx.logsumexp(lg, axis=-1, keepdims=True), *args)))[0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.sampled_from([7, 300, 5000]), spread=st.sampled_from([0.3, 2.0, 8.0]),
       top_p=st.sampled_from([0.1, 0.5, 0.9, 0.95, 0.999]))
def test_top_p_keeps_what_mlx_lm_keeps(seed, n, spread, top_p):
    """The nucleus is mlx-lm's, also when it reaches past the first TOP_P_FIRST candidates (a flat
    distribution over 5,000 tokens at top_p 0.999)."""
    x = _logits(seed, n, spread)
    mine = x - x.max()
    _top_p(mine, top_p)
    want = _mlx_kept(apply_top_p, x, top_p)
    # the cut may land on the other side of one token where float32 and float64 sums differ
    assert np.count_nonzero(np.isfinite(mine) != want) <= 1
    assert np.isfinite(mine).sum() >= 1


def test_a_wide_nucleus_is_cut_on_the_whole_row():
    """A flat row needs far more than TOP_P_FIRST tokens for top_p 0.95: all of them are counted."""
    x = np.zeros(4 * TOP_P_FIRST, np.float32)
    x[::2] = 0.01  # two levels, no ties inside a level's cut
    _top_p(x, 0.95)
    assert np.isfinite(x).sum() > TOP_P_FIRST


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), min_p=st.sampled_from([0.01, 0.1, 0.5]), top_k=st.integers(1, 299))
def test_min_p_and_top_k_keep_what_mlx_lm_keeps(seed, min_p, top_k):
    x = _logits(seed, 300, 2.0)
    mine = x - x.max()
    mine[mine < math.log(min_p)] = -np.inf
    assert (np.isfinite(mine) == _mlx_kept(apply_min_p, x, min_p)).all()
    mine = x.copy()
    _top_k(mine, top_k)
    assert (np.isfinite(mine) == _mlx_kept(apply_top_k, x, top_k)).all()


def test_greedy_is_the_argmax_and_draws_follow_the_softmax():
    x = np.array([0.0, 1.0, 2.0, -1.0, 0.5], np.float32)
    assert HostSampler(0.0, 0.0, 0.0, 0, None)(x.copy()) == 2
    s = HostSampler(0.7, 0.0, 0.0, 0, 1234)
    draws = np.bincount([s(x.copy()) for _ in range(20000)], minlength=5) / 20000
    want = np.exp(x / 0.7) / np.exp(x / 0.7).sum()
    np.testing.assert_allclose(draws, want, atol=0.015)


def test_a_seed_repeats_its_draws_and_filters_apply_before_the_draw():
    x = _logits(5, 1000, 3.0)
    a = [HostSampler(1.0, 0.9, 0.05, 40, 7)(x.copy()) for _ in range(1)]
    s1, s2 = HostSampler(1.0, 0.9, 0.05, 40, 7), HostSampler(1.0, 0.9, 0.05, 40, 7)
    seq1 = [s1(x.copy()) for _ in range(50)]
    assert seq1 == [s2(x.copy()) for _ in range(50)] and a[0] == seq1[0]
    kept = np.argsort(-x)[:40]
    assert set(seq1) <= set(kept.tolist())  # top_k 40 bounds every draw


def test_host_picker_bans_end_tokens_and_returns_a_token_array():
    """TokenPicker(host=True) with ignore_eos never picks an end token, even the most likely."""
    gen = GenerationSettings(temp=0.0, ignore_eos=True)
    pick = TokenPicker(gen, {3}, [], host=True)
    lg = mx.array(np.array([[0.0, 1.0, 2.0, 9.0]], np.float32))
    y = pick(lg)
    assert y.shape == (1,) and y.item() == 2
    gen = GenerationSettings(temp=0.0)
    assert TokenPicker(gen, {3}, [], host=True)(lg).item() == 3
