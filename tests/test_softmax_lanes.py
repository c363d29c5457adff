"""The online softmax's vector steps (kernels/softmax_lanes.py) against numpy: the max across
rows per lane, exp and its running sum (as accurate as attention.fast_exp, ~0 far below), and
the rescaling of O^T."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.softmax_lanes import lanes_exp, lanes_max, lanes_scale  # noqa: E402


@njit
def _max(s, n, M, mx):  # pragma: no cover - jitted
    lanes_max(s, n, M, mx)


@njit
def _exp(s, n, M, mx, total):  # pragma: no cover - jitted
    lanes_exp(s, n, M, mx, total)


@njit
def _scale(o, n, M, f):  # pragma: no cover - jitted
    lanes_scale(o, n, M, f)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 70), M=st.sampled_from([16, 32, 96, 128]), seed=st.integers(0, 2**16),
       spread=st.sampled_from([0.1, 3.0, 40.0]))
def test_lane_steps_equal_numpy(n, M, seed, spread):
    rng = np.random.default_rng(seed)
    s = rng.normal(0, spread, (n, M)).astype(np.float32)
    start = rng.normal(0, spread, M).astype(np.float32)
    start[::5] = -1e30  # lanes with no max yet (a first block)
    mx = start.copy()
    _max(s.reshape(-1).copy(), n, M, mx)
    np.testing.assert_array_equal(mx, np.maximum(start, s.max(axis=0)) if n else start)
    total0 = rng.uniform(0, 5, M).astype(np.float32)
    total = total0.copy()
    p = s.reshape(-1).copy()
    _exp(p, n, M, mx, total)
    want = np.exp(s.astype(np.float64) - mx.astype(np.float64))
    np.testing.assert_allclose(p.reshape(n, M), want, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(total, total0 + want.sum(axis=0), rtol=1e-5)
    o = rng.normal(0, 1, (n, M)).astype(np.float32)
    f = rng.uniform(0, 1, M).astype(np.float32)
    got = o.reshape(-1).copy()
    _scale(got, n, M, f)
    np.testing.assert_array_equal(got.reshape(n, M), o * f)


def test_exp_far_below_is_zero_not_a_denormal_or_nan():
    s = np.array([-1e30, -200.0, -87.5, -87.0, -20.0, 0.0, 1.0, 88.0] * 2, np.float32)
    total = np.zeros(16, np.float32)
    p = s.copy()
    _exp(p, 1, 16, np.zeros(16, np.float32), total)
    assert np.isfinite(p).all() and (p >= 0).all()
    assert (p[:3] < 1.7e-38).all() and ((p[:3] == 0) | (p[:3] >= np.finfo(np.float32).tiny)).all()
    np.testing.assert_allclose(p[3:8], np.exp(s[3:8].astype(np.float64)), rtol=2e-6)


@settings(max_examples=30, deadline=None)
@given(N=st.integers(1, 90), L=st.integers(1, 16), G=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_attention_mass_rows_equals_the_causal_softmax_summed(N, L, G, seed):
    """Each row a query among the last L of N tokens (causal among themselves), softmax over what
    it sees, summed over the rows into the mass per key: as numpy computes it."""
    from chatapp.kernels.softmax_lanes import attention_mass_rows

    L = min(L, N)
    rng = np.random.default_rng(seed)
    s = rng.normal(0, 4, (G * L, N)).astype(np.float32)
    want = np.zeros(N)
    for r in range(G * L):
        seen = N - L + r % L + 1
        p = np.exp(s[r, :seen].astype(np.float64) - s[r, :seen].max())
        want[:seen] += p / p.sum()
    mass = np.full(N, 0.5, np.float32)
    attention_mass_rows(s.copy(), N, L, mass)
    np.testing.assert_allclose(mass - 0.5, want, rtol=1e-5, atol=1e-6)
    assert abs((mass - 0.5).sum() - G * L) < 1e-3 * G * L
