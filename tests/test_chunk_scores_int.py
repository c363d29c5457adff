"""The prefill chunk's scores on integers (kernels/chunk_scores_int.py): the byte product against
numpy on the same bytes, the key rows' rounding, and chunk_attention with int_scores against a
float64 softmax(QK^T)V within the rounding of 8-bit keys and int8 queries."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.attention import heads_view  # noqa: E402
from chatapp.kernels.chunk_scores_int import (  # noqa: E402
    LANES,
    ROWS,
    quantise_key_rows,
    quantise_query_lane,
    scores8x32,
    zero_query_lane,
)
from chatapp.kernels.decode_step import LINE  # noqa: E402
from chatapp.kernels.prefill_attention import KBLOCK, QBLOCK, chunk_attention  # noqa: E402
from chatapp.kernels.prefill_step import rope_table  # noqa: E402
from tests.test_prefill_attention import _middle, _reference  # noqa: E402


@njit
def _lanes(q, scale, M, x, lsc, lsu, zero_from):  # pragma: no cover - jitted
    for m in range(M):
        if m < zero_from:
            quantise_query_lane(q[m], q.shape[1], scale, m, M, x, lsc, lsu)
        else:
            zero_query_lane(q.shape[1], m, M, x, lsc, lsu)


@njit
def _scores(k8, ksc, kbi, x, M, D, lsc, lsu, s, n_rows, k_row0):  # pragma: no cover - jitted
    for mc in range(0, M, LANES):
        for i in range(0, n_rows, ROWS):
            scores8x32(k8, (k_row0 + i) * D, k_row0 + i, ksc, kbi, x, 4 * mc, 4 * M, D // 4, lsc, lsu, mc, s,
                       i * M + mc, M)


def _unpack_lanes(x: np.ndarray, D: int, M: int) -> np.ndarray:
    """x laid out [D/4][M][4] back to [M, D]."""
    return x.reshape(D // 4, M, 4).transpose(1, 0, 2).reshape(M, D)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(D=st.sampled_from([16, 32, 64, 128]), n_rows=st.sampled_from([8, 16, 24]), M=st.sampled_from([32, 64, 96]),
       live=st.integers(0, 96), k_row0=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_scores_equal_the_byte_products(D, n_rows, M, live, k_row0, seed):
    """s = ksc lsc (u . x) + kbi lsu exactly as numpy computes it on the same bytes and scales:
    rows at an offset, several lane chunks, lanes past ``live`` zeroed (they score 0)."""
    rng = np.random.default_rng(seed)
    rows = k_row0 + n_rows
    k8 = rng.integers(0, 256, rows * D, dtype=np.uint8)
    ksc = rng.uniform(0.001, 0.1, rows).astype(np.float32)
    kbi = rng.uniform(-2, 2, rows).astype(np.float32)
    q = rng.normal(0, 1, (M, D)).astype(np.float32)
    q[3 % M] *= 1e-3  # a small lane keeps its own scale
    x = np.empty(D * M, np.int8)
    lsc = np.empty(M, np.float32)
    lsu = np.empty(M, np.float32)
    scale = np.float32(0.3)
    _lanes(q, scale, M, x, lsc, lsu, min(live, M))
    s = np.full(n_rows * M, np.nan, np.float32)
    _scores(k8, ksc, kbi, x, M, D, lsc, lsu, s, n_rows, k_row0)
    xl = _unpack_lanes(x, D, M).astype(np.int64)
    u = k8.reshape(rows, D)[k_row0:].astype(np.int64)
    raw = (u @ xl.T).astype(np.float64)
    want = ksc[k_row0:, None] * lsc[None, :].astype(np.float64) * raw + kbi[k_row0:, None] * lsu[None, :].astype(
        np.float64)
    np.testing.assert_allclose(s.reshape(n_rows, M), want, rtol=1e-5, atol=1e-5)
    assert (s.reshape(n_rows, M)[:, min(live, M):] == 0).all()
    # and the lanes are what they stand for: scale * q within half a step of int8 per element
    live_m = min(live, M)
    if live_m:
        sq = lsc[:live_m] / scale
        back = xl[:live_m] * sq[:, None]
        assert (np.abs(back - q[:live_m]) <= sq[:, None] * 0.5 + 1e-7).all()
        np.testing.assert_allclose(lsu[:live_m], lsc[:live_m] * xl[:live_m].sum(axis=1), rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(D=st.sampled_from([16, 32, 64, 128]), n=st.integers(1, 9), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 50.0]))
def test_key_rows_round_within_half_a_step(D, n, seed, spread):
    """Each row as bytes: kbi its min, ksc its range / 255, every element within half a step of
    ksc u + kbi, the min at 0 and the max at 255; a constant row: scale 0, every byte 0, exact."""
    rng = np.random.default_rng(seed)
    kb = (rng.normal(0, spread, (n, D)) + rng.normal(0, 3)).astype(np.float32)
    kb[n // 2] = np.float32(1.25)  # a constant row
    u = np.empty(n * D, np.uint8)
    ksc = np.empty(n, np.float32)
    kbi = np.empty(n, np.float32)
    quantise_key_rows(kb.reshape(-1), n, D, u, ksc, kbi)
    u = u.reshape(n, D)
    np.testing.assert_array_equal(kbi, kb.min(axis=1))
    np.testing.assert_allclose(ksc, (kb.max(axis=1) - kb.min(axis=1)) / 255, rtol=1e-6)
    back = u.astype(np.float64) * ksc[:, None] + kbi[:, None]
    assert (np.abs(back - kb) <= ksc[:, None] * (0.5 + 1e-3) + 1e-6).all()
    assert ksc[n // 2] == 0 and (u[n // 2] == 0).all() and kbi[n // 2] == np.float32(1.25)
    varied = ksc > 0
    assert (u[varied].min(axis=1) == 0).all() and (u[varied].max(axis=1) == 255).all()


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_cached=st.integers(0, 2 * KBLOCK + 5), tokens=st.integers(1, QBLOCK + 3),
       shape=st.sampled_from([(4, 4, 32), (9, 3, 64), (2, 1, 128), (6, 2, 16)]), traditional=st.booleans(),
       seed=st.integers(0, 2**16), q_from=st.integers(0, QBLOCK + 3))
def test_chunk_attention_on_int_scores_stays_near_softmax(n_cached, tokens, shape, traditional, seed, q_from):
    """int_scores=True: attn within the rounding of u8 keys and int8 queries of the float64
    softmax(QK^T)V (outputs within 8e-2: 0.011-0.051 over 60 seeds here, 0.41-3.6 with the keys'
    bias term dropped), the rows before q_from untouched, the values handed on as they came."""
    q_from = min(q_from, tokens - 1)
    heads, kv_heads, D = shape
    rng = np.random.default_rng(seed)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    k_buf = np.full((kv_heads, n_cached + 7, D), np.nan, np.float32)
    v_buf = np.full((kv_heads, n_cached + 7, D), np.nan, np.float32)
    k_buf[:, :n_cached] = rng.normal(0.5, 1, (kv_heads, n_cached, D))  # an offset: the keys' bias term matters
    v_buf[:, :n_cached] = rng.normal(0, 1, (kv_heads, n_cached, D))
    # queries and keys scaled so the scores reach ~3 (peaked enough that a lost bias term shows)
    q = (2.0 * rng.normal(0, 1, (tokens, heads * D))).astype(np.float32)
    want_q = q.copy()
    q[:q_from] = np.nan
    k_raw = rng.normal(0.5, 1, (tokens, kv_heads * D)).astype(np.float32)
    v_new = rng.normal(0, 1, (tokens, kv_heads * D)).astype(np.float32)
    cos, sin = rope_table(n_cached, tokens, inv_freq)
    k_out = np.zeros((tokens, kv_heads * D), np.float32)
    v_out = np.zeros((tokens, kv_heads * D), np.float32)
    attn = np.full((tokens, heads * D), 7.0, np.float32)
    ctl = np.zeros(2 * LINE * 2, np.int64)
    scale = np.float32(D ** -0.5)
    k_mid, _ = _middle(rng, kv_heads, 0, D, 8, min(32, D), False)  # no quantised middle
    quant = tuple(f for f, _ in k_mid + k_mid)
    q_stride = np.array([stride for _, stride in k_mid + k_mid], np.int64)
    (kf, ks), (vf, vs) = heads_view(k_buf), heads_view(v_buf)
    chunk_attention(ctl, 1, q, k_raw, v_new, cos, sin, traditional, heads, kv_heads, kf, ks, vf, vs, n_cached, scale,
                    k_out, v_out, attn, quant, q_stride, 0, 8, min(32, D), cos[0], sin[0], np.empty(0, np.float32),
                    np.float32(1e-6), q_from, True)
    want = _reference(want_q, k_raw, v_new, k_buf[:, :n_cached], v_buf[:, :n_cached], cos, sin, traditional,
                      heads, kv_heads, scale)
    np.testing.assert_allclose(attn[q_from:], want[q_from:], rtol=0, atol=8e-2)
    assert (attn[:q_from] == 7.0).all()
    np.testing.assert_array_equal(v_out, v_new)
