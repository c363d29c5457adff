"""The decode step's grouped, split attention (kernels/group_attention.py) and the micro-kernels
it runs on (kernels/microkernels.py) against numpy."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.group_attention import (  # noqa: E402
    MIN_SPLIT,
    SLOT,
    attend_split,
    merge_splits,
    n_splits,
    part_size,
)
from chatapp.kernels.microkernels import A_ROWS, dots16, outer4x64  # noqa: E402


@njit
def _dots16(q, k, length, s):  # pragma: no cover - jitted
    dots16(q, 3, k, 5, length + 2, length, np.float32(0.5), s, 1)


@settings(max_examples=20, deadline=None)
@given(chunks=st.integers(0, 9), half=st.booleans(), seed=st.integers(0, 2**16))
def test_dots16_scores_16_rows(chunks, half, seed):
    rng = np.random.default_rng(seed)
    D = 16 * chunks
    q = rng.normal(0, 1, D + 3).astype(np.float32)
    k = rng.normal(0, 1, 5 + 16 * (D + 2)).astype(np.float16 if half else np.float32)
    s = np.full(18, np.nan, np.float32)
    _dots16(q, k.view(np.uint16) if half else k, D, s)
    rows = k[5:].astype(np.float64).reshape(16, D + 2)[:, :D]
    np.testing.assert_allclose(s[1:17], 0.5 * rows @ q[3:3 + D], rtol=1e-5, atol=1e-4)
    assert np.isnan(s[0]) and np.isnan(s[17])  # nothing outside the 16 sums is written


@njit
def _outer64(a, b, c, r_len, accumulate):  # pragma: no cover - jitted
    outer4x64(a, 1, r_len, 1, b, 2, 70, c, 3, 66, r_len, accumulate)


@settings(max_examples=10, deadline=None)
@given(r_len=st.integers(0, 20), half=st.booleans(), accumulate=st.booleans(), seed=st.integers(0, 2**16))
def test_outer4x64_equals_matmul(r_len, half, accumulate, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, 1 + 4 * r_len).astype(np.float32)
    b = rng.normal(0, 1, 2 + 70 * max(r_len, 1)).astype(np.float16 if half else np.float32)
    c = rng.normal(0, 1, 3 + 4 * 66).astype(np.float32)
    got = c.copy()
    _outer64(a, b.view(np.uint16) if half else b, got, r_len, int(accumulate))
    A = a[1:].reshape(4, r_len).astype(np.float64)
    B = b[2:2 + 70 * r_len].astype(np.float64).reshape(r_len, 70)[:, :64]
    want = c.copy()
    block = want[3:].reshape(4, 66)
    block[:, :64] = block[:, :64] + A @ B if accumulate else A @ B
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _reference(q, k, v, kr, vn, scale):
    """softmax(scale q [H, D] . [k; kr]^T) [v; vn] with H = G query heads of one KV head."""
    keys = np.concatenate([k, kr[None]]).astype(np.float64)
    vals = np.concatenate([v, vn[None]]).astype(np.float64)
    s = scale * q.astype(np.float64) @ keys.T
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ vals


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_cached=st.integers(0, 3 * MIN_SPLIT + 40), G=st.sampled_from([1, 3, 4, 6]),
       D=st.sampled_from([16, 48, 64, 128]), kv_heads=st.sampled_from([1, 2, 3]), half=st.booleans(),
       seed=st.integers(0, 2**16))
@example(n_cached=2 * MIN_SPLIT + 3, G=3, D=64, kv_heads=1, half=True, seed=0)
def test_split_attention_merges_to_the_softmax_over_all_keys(n_cached, G, D, kv_heads, half, seed):
    rng = np.random.default_rng(seed)
    dt = np.float16 if half else np.float32
    cap = n_cached + 5
    k = rng.normal(0, 1, (kv_heads, cap, D)).astype(dt)
    v = rng.normal(0, 1, (kv_heads, cap, D)).astype(dt)
    k[:, n_cached:] = np.nan  # rows at and past n_cached are never read
    v[:, n_cached:] = np.nan
    q = rng.normal(0, 1, (kv_heads * G, D)).astype(np.float32)
    kr = rng.normal(0, 1, (kv_heads, D)).astype(np.float32)
    vn = rng.normal(0, 1, (kv_heads, D)).astype(np.float32)
    scale = np.float32(D ** -0.5)
    n_keys = n_cached + 1
    S = n_splits(kv_heads, n_keys)
    per = (n_keys + S - 1) // S
    G4 = (G + A_ROWS - 1) // A_ROWS * A_ROWS
    L = per + 1
    part = np.full(part_size(kv_heads * G, kv_heads, D), np.nan, np.float32)
    kf = (k.view(np.uint16) if half else k).reshape(-1)
    vf = (v.view(np.uint16) if half else v).reshape(-1)
    for kh in range(kv_heads):
        for sp in range(S):
            a, b = sp * per, min(n_keys, (sp + 1) * per)
            s = np.full(G4 * L, np.nan, np.float32)
            o = np.full(G4 * D, np.nan, np.float32)
            attend_split(q[kh * G:(kh + 1) * G].reshape(-1), G, D, kf, kh * cap * D, vf, kh * cap * D, a,
                         min(b, n_cached), kr[kh], vn[kh], b == n_keys, scale, s, L, o, part,
                         (kh * S + sp) * G * (D + SLOT))
    attn = np.full(kv_heads * G * D, np.nan, np.float32)
    merge_splits(part, kv_heads * G, kv_heads, S, D, attn)
    for kh in range(kv_heads):
        want = _reference(q[kh * G:(kh + 1) * G], k[kh, :n_cached], v[kh, :n_cached], kr[kh], vn[kh], scale)
        np.testing.assert_allclose(attn[kh * G * D:(kh + 1) * G * D].reshape(G, D), want, rtol=0, atol=2e-5)


def test_splits_keep_both_cores_busy_but_never_go_below_min_split():
    assert n_splits(3, 4097) == 3 and n_splits(32, 4097) == 1 and n_splits(1, 4097) == 8
    assert n_splits(3, MIN_SPLIT - 1) == 1 and n_splits(3, 2 * MIN_SPLIT) == 2
