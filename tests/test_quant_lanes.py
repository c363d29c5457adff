"""The quantised middle's decode attention with several query heads per pass: the scores with the
keys in lanes (kernels/qk_lanes.py) against qk_int's per-head kernel, P V on 16-bit integer
weights (kernels/pv_int.py) against float64 over the dequantised rows, each on this CPU's
instructions and on the portable IR a CPU without VNNI compiles."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels import pv_int, qk_lanes  # noqa: E402
from chatapp.kernels.group_attention import SLOT  # noqa: E402
from chatapp.kernels.microkernels import A_ROWS  # noqa: E402
from chatapp.kernels.pv_int import BLOCK, PERM, WMAX, pv_lanes  # noqa: E402
from chatapp.kernels.qk_int import qscores16, quantise_queries  # noqa: E402
from chatapp.kernels.qk_lanes import heads_at, qscores_lanes  # noqa: E402
from chatapp.kernels.quant_split import attend_quant_split, param_size  # noqa: E402

PAD = 5  # rows of another head before this one's: offsets are not zero


def _rows(rng, n: int, D: int, half: bool):
    """8-bit rows in groups of 64 after PAD others: bytes, scales (either sign, as MLX's affine
    rows hold them), biases, and the dequantised rows [n, D] in float64."""
    ng = D // 64
    packed = rng.integers(0, 256, (PAD + n) * D, dtype=np.uint8)
    dt = np.float16 if half else np.float32
    scales = (rng.uniform(0.001, 0.05, (PAD + n) * ng) * rng.choice([-1, 1], (PAD + n) * ng)).astype(dt)
    biases = rng.uniform(-2, 2, (PAD + n) * ng).astype(dt)
    q = packed[PAD * D:].reshape(n, D).astype(np.float64)
    sc = np.repeat(scales[PAD * ng:].astype(np.float64).reshape(n, ng), 64, axis=1)
    bi = np.repeat(biases[PAD * ng:].astype(np.float64).reshape(n, ng), 64, axis=1)
    view = (lambda a: a.view(np.uint16)) if half else (lambda a: a)
    return packed, view(scales), view(biases), sc * q + bi, scales[PAD * ng:].astype(np.float64).reshape(n, ng)


@settings(max_examples=20, deadline=None)
@given(G=st.integers(2, 9), D=st.sampled_from([64, 128]), half=st.booleans(), seed=st.integers(0, 2**16))
@example(G=3, D=64, half=True, seed=0)
def test_lane_scores_are_qk_ints_bit_for_bit(G, D, half, seed):
    """qscores_lanes over 16 rows, G heads in calls of up to 4, gives the very floats qscores16
    gives head by head: the same integer dots, scaled by the same expression."""
    rng = np.random.default_rng(seed)
    packed, ks, kb, _, _ = _rows(rng, 16, D, half)
    ng = D // 64
    qg = rng.normal(0, 1, G * D).astype(np.float32)
    x = np.zeros(2 * G * D, np.int8)
    f = np.zeros(param_size(G, D), np.float32)
    quantise_queries(qg, G, D, 8, 64, np.float32(0.125), x, f)
    L = 21  # rows of s apart: not a multiple of 16
    want = np.full(G * L, np.nan, np.float32)
    got = want.copy()
    for g in range(G):
        qscores16(8, 64, D, x, g * 2 * D, packed, PAD * D, D, ks, kb, PAD * ng, f, g * 2 * ng, want, g * L)
    g0 = 0
    while g0 < G:
        hc = heads_at(G - g0)
        qscores_lanes(hc, D, x, g0 * 2 * D, packed, PAD * D, ks, kb, PAD * ng, f, g0 * 2 * ng, got, g0 * L, L)
        g0 += hc
    np.testing.assert_array_equal(got, want)  # NaN where nothing is written, in both


def _pv_bound(p: np.ndarray, sc: np.ndarray, n: int) -> np.ndarray:
    """What rounding the weights to integers may cost each output [G, ng]: per block of BLOCK rows,
    half an integer step (the block's largest |p x scale| / WMAX) times 255 per row."""
    G, ng = p.shape[0], sc.shape[1]
    out = np.zeros((G, ng))
    for r0 in range(0, n, BLOCK):
        w = np.abs(p[:, r0:r0 + BLOCK, None] * sc[None, r0:r0 + BLOCK, :])  # [G, rows, ng]
        out += w.max(axis=1) / WMAX * 0.5 * 255 * w.shape[1]
    return out


@settings(max_examples=30, deadline=None)
@given(G=st.integers(2, 9), D=st.sampled_from([64, 128]), n=st.integers(1, 3 * BLOCK + 5), half=st.booleans(),
       spread=st.sampled_from([0.1, 3.0, 12.0]), seed=st.integers(0, 2**16))
@example(G=3, D=64, n=2 * BLOCK, half=True, spread=3.0, seed=0)
@example(G=5, D=128, n=BLOCK + 1, half=False, spread=12.0, seed=1)
def test_pv_lanes_equals_the_dequantised_product(G, D, n, half, spread, seed):
    """o = P V over the dequantised rows, within what the 16-bit weights' rounding allows (blocks of
    BLOCK rows each with its own step; the last block short and an odd row count included)."""
    rng = np.random.default_rng(seed)
    vq, vs, vb, values, sc = _rows(rng, n, D, half)
    L = n + 7
    s = np.full(G * L, np.nan, np.float32)  # past each head's n rows: never read
    p = np.exp(rng.normal(0, spread, (G, n)) - spread * 3).astype(np.float32)
    for g in range(G):
        s[g * L:g * L + n] = p[g]
    o = np.full(G * D + 3, np.nan, np.float32)
    pv_lanes(G, D, s, L, n, vq, PAD * D, vs, vb, PAD * (D // 64), o)
    want = p.astype(np.float64) @ values  # [G, D]
    bound = np.repeat(_pv_bound(p.astype(np.float64), sc, n), 64, axis=1)
    err = np.abs(o[:G * D].reshape(G, D) - want)
    assert (err <= 1.01 * bound + 2e-6 * np.abs(p).sum(axis=1, keepdims=True) * np.abs(values).max()).all()
    assert np.isnan(o[G * D:]).all()  # nothing past G x D is written


def test_perm_is_the_interleaves_column_order():
    """PERM names every column of a group once: the accumulators' order is a permutation."""
    assert sorted(PERM.tolist()) == list(range(64))


def test_heads_are_cut_into_calls_of_two_to_four():
    """Every query group of 2 or more heads is cut into calls the kernels are built for."""
    for G in range(2, 40):
        calls, left = [], G
        while left:
            calls.append(heads_at(left))
            left -= calls[-1]
        assert sum(calls) == G and all(2 <= c <= qk_lanes.HEADS for c in calls), (G, calls)


@settings(max_examples=15, deadline=None)
@given(G=st.integers(2, 6), D=st.sampled_from([64, 128]), n=st.integers(1, 150), a=st.integers(0, 9),
       half=st.booleans(), seed=st.integers(0, 2**16))
@example(G=3, D=64, n=100, a=3, half=True, seed=0)
def test_integer_unit_matches_the_float_unit(G, D, n, a, half, seed):
    """attend_quant_split on integers (the lanes kernels for G >= 2) leaves the partials its float
    route leaves, within the queries' and weights' rounding, with scales of either sign."""
    rng = np.random.default_rng(seed)
    kq, ks, kb, _, _ = _rows(rng, a + n, D, half)
    vq, vs, vb, _, _ = _rows(rng, a + n, D, half)
    ng = D // 64
    quant = (kq, ks, kb, vq, vs, vb)
    q_base = np.array([PAD * D, PAD * ng, PAD * ng] * 2, np.int64)
    qg = rng.normal(0, 1, G * D).astype(np.float32)
    G4 = (G + A_ROWS - 1) // A_ROWS * A_ROWS
    L = (n + 15) // 16 * 16
    parts = []
    for ints in (True, False):
        part = np.zeros(G * (D + SLOT), np.float32)
        attend_quant_split(qg, G, D, quant, q_base, a, a + n, 8, 64, np.float32(0.125), np.zeros(G4 * L, np.float32),
                           L, np.zeros(G4 * D, np.float32), part, 0, np.zeros(G4 * L, np.float32),
                           np.zeros(2 * G * D if ints else 0, np.int8), np.zeros(param_size(G, D), np.float32))
        parts.append(part.reshape(G, D + SLOT))
    got, want = parts
    np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=1e-4, atol=2e-3)  # the maxima
    shift = np.exp(got[:, :1] - want[:, :1])
    np.testing.assert_allclose(got[:, 1:2] * shift, want[:, 1:2], rtol=2e-3)
    np.testing.assert_allclose(got[:, SLOT:] * shift, want[:, SLOT:], rtol=2e-3,
                               atol=2e-3 * np.abs(want[:, SLOT:]).max())


# ---- the portable IR (what a CPU without VNNI compiles), called directly -------------------------
_QS3 = qk_lanes.make_qscores_lanes("generic", 3, 1)
_PV3 = pv_int.make_pv_block("generic", 3, 1)


@njit
def _generic_scores(x, k, ks, kb, f, s, L):  # pragma: no cover - jitted
    _QS3(x, 0, k, PAD * 64, ks, kb, PAD, f, 0, s, 0, L)


@njit
def _generic_pv(s, L, vs, vb, v, nb, w, o, bsum):  # pragma: no cover - jitted
    _PV3(s, 0, L, vs, vb, PAD, 0, v, PAD * 64, 64, nb, w, o, 0, bsum)


def test_portable_ir_gives_the_same_results():
    """The generic builds of both kernels: the scores bit for bit as qscores16's, P V within its
    rounding bound, so a CPU without VNNI that compiles them is tested here too."""
    rng = np.random.default_rng(3)
    G, D = 3, 64
    packed, ks, kb, _, _ = _rows(rng, 16, D, True)
    qg = rng.normal(0, 1, G * D).astype(np.float32)
    x = np.zeros(2 * G * D, np.int8)
    f = np.zeros(param_size(G, D), np.float32)
    quantise_queries(qg, G, D, 8, 64, np.float32(0.125), x, f)
    want = np.zeros(G * 16, np.float32)
    for g in range(G):
        qscores16(8, 64, D, x, g * 2 * D, packed, PAD * D, D, ks, kb, PAD, f, g * 2, want, g * 16)
    got = np.zeros(G * 16, np.float32)
    _generic_scores(x, packed, ks, kb, f, got, 16)
    np.testing.assert_array_equal(got, want)

    nb = BLOCK - 3  # a short block: odd, its last pair's second row not read
    vq, vs, vb, values, sc = _rows(rng, BLOCK, D, True)
    p = np.zeros((G, BLOCK), np.float32)
    p[:, :nb] = rng.uniform(0, 1, (G, nb))
    o = np.zeros(G * D, np.float32)
    bsum = np.zeros(G, np.float32)
    _generic_pv(p.reshape(-1), BLOCK, vs, vb, vq, nb, np.zeros(pv_int.HEADS * BLOCK, np.int16), o, bsum)
    plain = np.zeros((G, D))
    for k in range(64):
        plain[:, k] = o.reshape(G, D)[:, k]
    got_pv = np.zeros((G, D))
    got_pv[:, PERM] = plain  # the accumulators hold PERM's order
    got_pv += bsum[:, None]
    want_pv = p[:, :nb].astype(np.float64) @ values[:nb]
    bound = np.repeat(_pv_bound(p[:, :nb].astype(np.float64), sc[:nb], nb), 64, axis=1)
    assert (np.abs(got_pv - want_pv) <= 1.01 * bound + 1e-5 * np.abs(want_pv).max()).all()
