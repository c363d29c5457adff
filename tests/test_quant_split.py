"""The decode step's attention over a quantised middle (kernels/quant_split.py), on floats and on
integers (kernels/qk_int.py), against numpy over the dequantised rows."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from chatapp.kernels.group_attention import SLOT, pv_shape  # noqa: E402
from chatapp.kernels.microkernels import A_ROWS  # noqa: E402
from chatapp.kernels.qk_int import LAYOUTS, qscores16, quantise_queries  # noqa: E402
from chatapp.kernels.quant_split import attend_quant_split, param_size  # noqa: E402

PAD = 3  # rows of another head before this one's: offsets are not zero


def _middle(rng, n: int, D: int, bits: int, group_size: int, half: bool):
    """A head's quantised rows as the cache holds them (flat, after PAD other rows): packed bytes,
    scales, biases, and the dequantised rows [n, D] in float64."""
    P = D * bits // 8
    ng = D // group_size
    packed = rng.integers(0, 256, (PAD + n) * P, dtype=np.uint8)
    dt = np.float16 if half else np.float32
    scales = rng.uniform(0.001, 0.05, (PAD + n) * ng).astype(dt)
    biases = rng.uniform(-2, 2, (PAD + n) * ng).astype(dt)
    rows = packed[PAD * P:].reshape(n, P)
    if bits == 8:
        q = rows.astype(np.float64)
    else:  # element 2j in the low nibble of byte j
        q = np.stack([rows & 15, rows >> 4], axis=-1).reshape(n, D).astype(np.float64)
    sc = np.repeat(scales[PAD * ng:].astype(np.float64).reshape(n, ng), group_size, axis=1)
    bi = np.repeat(biases[PAD * ng:].astype(np.float64).reshape(n, ng), group_size, axis=1)
    view = (lambda a: a.view(np.uint16)) if half else (lambda a: a)
    return packed, view(scales), view(biases), sc * q + bi


@settings(max_examples=25, deadline=None)
@given(layout=st.sampled_from([(b, gs, ng) for b in (8, 4) for gs, ng in LAYOUTS]), half=st.booleans(),
       seed=st.integers(0, 2**16))
@example(layout=(8, 64, 1), half=True, seed=0)
@example(layout=(4, 64, 2), half=False, seed=1)
def test_integer_scores_equal_the_dequantised_dot(layout, half, seed):
    """qscores16: 16 rows' scores from the 16-bit query planes, the scales and biases applied in
    the kernel, within the planes' rounding (~1/65,000 of each group's largest element)."""
    bits, gs, ng = layout
    D = gs * ng
    G = 2
    rng = np.random.default_rng(seed)
    packed, ks, kb, keys = _middle(rng, 16, D, bits, gs, half)
    qg = rng.normal(0, 1, G * D).astype(np.float32)
    qg[3] = 9.0  # an outlier, as RoPE'd queries have
    x = np.zeros(2 * G * D, np.int8)
    f = np.zeros(param_size(G, D), np.float32)
    quantise_queries(qg, G, D, bits, gs, np.float32(0.125), x, f)
    s = np.full(G * 16 + 1, np.nan, np.float32)
    for g in range(G):
        qscores16(bits, gs, D, x, g * 2 * D, packed, PAD * D * bits // 8, D * bits // 8, ks, kb, PAD * ng, f,
                  g * 2 * ng, s, g * 16)
    want = 0.125 * keys @ qg.reshape(G, D).astype(np.float64).T  # [16, G]
    scale = np.abs(keys).max(axis=1).sum() / 16 * np.abs(qg).sum() * 0.125  # a score's magnitude
    np.testing.assert_allclose(s[:G * 16].reshape(G, 16).T, want, atol=2e-4 * scale, rtol=0)
    assert np.isnan(s[-1])  # nothing past the 16 x G scores is written


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([8, 4]), D_gs=st.sampled_from([(64, 32), (64, 64), (128, 32), (128, 64), (128, 128),
                                                          (96, 32)]),
       G=st.sampled_from([1, 2, 3, 4, 5]), n=st.integers(1, 70), a=st.integers(0, 20), half=st.booleans(),
       ints=st.booleans(), seed=st.integers(0, 2**16))
@example(bits=8, D_gs=(64, 64), G=3, n=37, a=5, half=True, ints=True, seed=0)
@example(bits=4, D_gs=(128, 64), G=1, n=64, a=0, half=True, ints=True, seed=1)
@example(bits=8, D_gs=(128, 64), G=5, n=17, a=2, half=False, ints=False, seed=2)
def test_attend_quant_split_equals_softmax_attention(bits, D_gs, G, n, a, half, ints, seed):
    """One unit's partials (max, sum of exp, unnormalised output per head) over rows a .. a + n - 1
    equal numpy's over the dequantised keys and values: on floats, and on integers (D = 96 is
    no layout qk_int serves: that unit runs on floats whatever it is given)."""
    D, gs = D_gs
    rng = np.random.default_rng(seed)
    rows = PAD + a + n
    kq, ks, kb, keys = _middle(rng, rows - PAD, D, bits, gs, half)
    vq, vs, vb, values = _middle(rng, rows - PAD, D, bits, gs, half)
    qg = rng.normal(0, 1, G * D).astype(np.float32)
    quant = (kq, ks, kb, vq, vs, vb)
    ng = D // gs
    q_base = np.array([PAD * D * bits // 8, PAD * ng, PAD * ng] * 2, np.int64)
    rows_pv, _ = pv_shape(G, D)
    G4 = (G + A_ROWS - 1) // A_ROWS * A_ROWS
    L = (n + 15) // 16 * 16
    s = np.zeros(G4 * L, np.float32)
    o = np.zeros(G4 * D, np.float32)
    w = np.zeros(G4 * L, np.float32)
    part = np.full(1 + G * (D + SLOT), np.nan, np.float32)
    xq = np.zeros(2 * G * D if ints else 0, np.int8)
    qp = np.zeros(param_size(G, D), np.float32)
    attend_quant_split(qg, G, D, quant, q_base, a, a + n, bits, gs, np.float32(0.125), s, L, o, part, 1, w, xq, qp)
    sc = 0.125 * keys[a:a + n] @ qg.reshape(G, D).astype(np.float64).T  # [n, G]
    mx = sc.max(axis=0)
    p = np.exp(sc - mx)
    for g in range(G):
        got = part[1 + g * (D + SLOT):1 + (g + 1) * (D + SLOT)]
        np.testing.assert_allclose(got[0], mx[g], rtol=1e-4, atol=2e-3)
        # the partials are relative to the unit's own max: compare them at the same max
        shift = np.exp(got[0] - mx[g])
        np.testing.assert_allclose(got[1] * shift, p[:, g].sum(), rtol=2e-3)
        np.testing.assert_allclose(got[SLOT:] * shift, p[:, g] @ values[a:a + n], rtol=2e-3,
                                   atol=2e-3 * np.abs(values).max() * p[:, g].sum())
    assert np.isnan(part[0])  # nothing before p0 is written
