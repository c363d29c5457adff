"""The prefill chunk's blocked causal attention (kernels/prefill_attention.py) against a plain
numpy softmax(QK^T)V over [cache | chunk], and its micro-kernel against numpy's matmul."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.attention import heads_view  # noqa: E402
from chatapp.kernels.decode_step import LINE  # noqa: E402
from chatapp.kernels.microkernels import outer4x32  # noqa: E402
from chatapp.kernels.prefill_attention import KBLOCK, QBLOCK, chunk_attention  # noqa: E402
from chatapp.kernels.prefill_step import rope_table  # noqa: E402


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool) -> np.ndarray:
    """x [T, D] rotated per position, as decode_step.apply_rope does."""
    out = x.copy()
    if traditional:
        a, b = x[:, 0::2], x[:, 1::2]
        out[:, 0::2], out[:, 1::2] = a * cos - b * sin, a * sin + b * cos
    else:
        h = x.shape[1] // 2
        a, b = x[:, :h], x[:, h:]
        out[:, :h], out[:, h:] = a * cos - b * sin, a * sin + b * cos
    return out


def _reference(q, k_raw, v_new, k_cache, v_cache, cos, sin, traditional, heads, kv_heads, scale):
    T, D = q.shape[0], cos.shape[1] * 2
    n_cached = k_cache.shape[1]
    G = heads // kv_heads
    out = np.zeros((T, heads * D), np.float64)
    for h in range(heads):
        kh = h // G
        qh = _rope(q[:, h * D:(h + 1) * D], cos, sin, traditional).astype(np.float64)
        kc = np.concatenate([k_cache[kh].astype(np.float64),
                             _rope(k_raw[:, kh * D:(kh + 1) * D], cos, sin, traditional)])
        vc = np.concatenate([v_cache[kh].astype(np.float64), v_new[:, kh * D:(kh + 1) * D]])
        s = scale * qh @ kc.T
        s[np.arange(n_cached + T)[None, :] > n_cached + np.arange(T)[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h * D:(h + 1) * D] = (p / p.sum(axis=1, keepdims=True)) @ vc
    return out


def _middle(rng, kv_heads: int, n: int, D: int, bits: int, group: int, half: bool):
    """A random quantised middle in MLX's affine layout (packed bytes; 4 bits: element 2j in the
    low nibble of byte j), with room past its n rows (NaN scales: never read): its three flat
    buffers with their head strides, and its float64 dequantisation [kv_heads, n, D]."""
    cap = n + 3
    packed = rng.integers(0, 256, (kv_heads, cap, D * bits // 8), dtype=np.uint8)
    sdt = np.float16 if half else np.float32
    scales = np.full((kv_heads, cap, D // group), np.nan, sdt)
    biases = np.full((kv_heads, cap, D // group), np.nan, sdt)
    scales[:, :n] = rng.uniform(0.001, 2.0 / 2**bits, (kv_heads, n, D // group))
    biases[:, :n] = rng.uniform(-1, 1, (kv_heads, n, D // group))
    p = packed[:, :n]
    if bits == 4:
        x = np.empty((kv_heads, n, D))
        x[..., 0::2], x[..., 1::2] = p & 15, p >> 4
    else:
        x = p.astype(np.float64)
    sc, bi = (a[:, :n].astype(np.float64).repeat(group, axis=2) for a in (scales, biases))
    bufs = [heads_view(a.view(np.uint16) if half and a.dtype == np.float16 else a) for a in (packed, scales, biases)]
    return bufs, x * sc + bi


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_cached=st.integers(0, 3 * KBLOCK + 5), tokens=st.integers(1, 2 * QBLOCK + 3),
       shape=st.sampled_from([(4, 4, 32), (9, 3, 64), (2, 1, 128), (6, 2, 16)]), half=st.booleans(),
       traditional=st.booleans(), seed=st.integers(0, 2**16), q_from=st.integers(0, 2 * QBLOCK + 3),
       n_quant=st.sampled_from([0, 0, 1, 7, KBLOCK + 9, 2 * KBLOCK + 40]), bits=st.sampled_from([4, 8]),
       delta=st.integers(0, 900), int_pv=st.booleans())
@example(n_cached=KBLOCK - 1, tokens=QBLOCK + 1, shape=(9, 3, 64), half=True, traditional=False, seed=1, q_from=0,
         n_quant=0, bits=8, delta=0, int_pv=False)
@example(n_cached=59, tokens=48, shape=(9, 3, 64), half=True, traditional=False, seed=7276,
         q_from=47, n_quant=0, bits=8, delta=0, int_pv=False)  # the last row alone, with rows before it never computed
@example(n_cached=5, tokens=2 * QBLOCK + 3, shape=(4, 4, 32), half=False, traditional=False, seed=3,
         q_from=2 * QBLOCK + 2, n_quant=0, bits=8, delta=0,
         int_pv=False)  # a prefill chunk's last layer: the last row alone
@example(n_cached=40, tokens=QBLOCK + 5, shape=(9, 3, 64), half=True, traditional=False, seed=11, q_from=0,
         n_quant=KBLOCK + 9, bits=4, delta=517, int_pv=False)  # a window-quant cache after evictions
@example(n_cached=40, tokens=QBLOCK + 5, shape=(9, 3, 64), half=True, traditional=False, seed=12, q_from=0,
         n_quant=2 * KBLOCK + 39, bits=8, delta=517, int_pv=True)  # its 8-bit middle's P V on integers
def test_chunk_attention_matches_softmax_qkt_v(n_cached, tokens, shape, half, traditional, seed, q_from, n_quant,
                                               bits, delta, int_pv):
    """attn's rows from q_from on equal softmax(q k^T) v (the rows before it neither read from q,
    which holds NaN there, nor written: they keep their 7s), and every key and value is handed on whatever q_from is.
    With a quantised middle (n_quant rows, read as stored) the keys are [middle dequantised and
    turned back by its rotation delta | cache rows | chunk rows], the chunk's rows go after the
    cache rows. ``int_pv`` (an 8-bit middle's P V on integers, pv_prefill_int.py): within the
    16-bit weights' rounding (1.4e-5 to 2.8e-5 over six seeds, against ~0.1 with the bias term dropped or
    a wrong scale)."""
    q_from = min(q_from, tokens - 1)
    heads, kv_heads, D = shape
    rng = np.random.default_rng(seed)
    dt = np.float16 if half else np.float32
    group = min(32, D)
    k_mid, k_deq = _middle(rng, kv_heads, n_quant, D, bits, group, half)
    v_mid, v_deq = _middle(rng, kv_heads, n_quant, D, bits, group, half)
    inv_freq = (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)
    cos_u, sin_u = (a[0] for a in rope_table(-delta, 1, inv_freq))
    k_deq = np.stack([_rope(m, cos_u[None].astype(np.float64), sin_u[None].astype(np.float64), traditional)
                      for m in k_deq]) if n_quant else k_deq
    quant = tuple(f for f, _ in k_mid + v_mid)
    q_stride = np.array([stride for _, stride in k_mid + v_mid], np.int64)
    capacity = n_cached + 7  # rows past n_cached are never read: fill them with NaN
    k_buf = np.full((kv_heads, capacity, D), np.nan, dt)
    v_buf = np.full((kv_heads, capacity, D), np.nan, dt)
    k_buf[:, :n_cached] = rng.normal(0, 1, (kv_heads, n_cached, D))
    v_buf[:, :n_cached] = rng.normal(0, 1, (kv_heads, n_cached, D))
    q = rng.normal(0, 1, (tokens, heads * D)).astype(np.float32)
    want_q = q.copy()
    q[:q_from] = np.nan
    k_raw = rng.normal(0, 1, (tokens, kv_heads * D)).astype(np.float32)
    v_new = rng.normal(0, 1, (tokens, kv_heads * D)).astype(np.float32)
    cos, sin = rope_table(n_quant + n_cached, tokens, inv_freq)
    k_out = np.zeros((tokens, kv_heads * D), dt)
    v_out = np.zeros((tokens, kv_heads * D), dt)
    attn = np.full((tokens, heads * D), 7.0, np.float32)  # no softmax of V gives 7 here
    (kf, ks), (vf, vs) = heads_view(k_buf.view(np.uint16) if half else k_buf), \
        heads_view(v_buf.view(np.uint16) if half else v_buf)
    ctl = np.zeros(2 * LINE * 2, np.int64)
    scale = np.float32(D ** -0.5)
    chunk_attention(ctl, 1, q, k_raw, v_new, cos, sin, traditional, heads, kv_heads, kf, ks, vf, vs,
                    n_quant + n_cached, scale, k_out.view(np.uint16) if half else k_out,
                    v_out.view(np.uint16) if half else v_out, attn, quant, q_stride, n_quant, bits, group, cos_u, sin_u,
                    np.empty(0, np.float32), np.float32(1e-6), q_from, False, 0, int_pv)
    want = _reference(want_q, k_raw, v_new, np.concatenate([k_deq, k_buf[:, :n_cached]], 1),
                      np.concatenate([v_deq, v_buf[:, :n_cached]], 1), cos, sin, traditional, heads, kv_heads, scale)
    on_ints = int_pv and bits == 8 and n_quant > 0
    np.testing.assert_allclose(attn[q_from:], want[q_from:], rtol=0, atol=1e-4 if on_ints else 2e-5)
    assert (attn[:q_from] == 7.0).all()
    roped = np.concatenate([_rope(k_raw[:, g * D:(g + 1) * D], cos, sin, traditional) for g in range(kv_heads)], 1)
    # the kernel's float32 rotation differs from numpy's in the last bits, so its fp16 rounding may land on the
    # neighbouring value: compare with the unrounded rotation, within one ulp of the stored type
    ulp = 2.0**-9 if half else 2.0**-22
    np.testing.assert_allclose(k_out.astype(np.float32), roped, rtol=ulp, atol=1e-6)
    np.testing.assert_array_equal(v_out, v_new.astype(dt))


@njit
def _outer(a, a_si, a_sr, b, c, r_len, accumulate):  # pragma: no cover - jitted
    outer4x32(a, 0, a_si, a_sr, b, 3, 40, c, 57, 50, r_len, accumulate)


@settings(max_examples=20, deadline=None)
@given(r_len=st.integers(0, 70), a_transposed=st.booleans(), accumulate=st.booleans(), seed=st.integers(0, 2**16))
def test_outer4x32_equals_matmul(r_len, a_transposed, accumulate, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(0, 1, (4, r_len)).astype(np.float32)
    b = rng.normal(0, 1, (r_len, 40)).astype(np.float32)  # 40 columns: the kernel reads 32 of them from 3
    c = rng.normal(0, 1, (6, 50)).astype(np.float32)
    flat_a = np.ascontiguousarray(a.T if a_transposed else a).reshape(-1)
    a_si, a_sr = (1, 4) if a_transposed else (r_len, 1)
    want = c.copy()
    got = c.copy()
    prod = a.astype(np.float64) @ b[:, 3:35]
    want[1:5, 7:39] = want[1:5, 7:39] + prod if accumulate else prod
    _outer(flat_a if flat_a.size else np.zeros(1, np.float32), a_si, a_sr,
           b.reshape(-1) if b.size else np.zeros(1, np.float32), got.reshape(-1), r_len, int(accumulate))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
