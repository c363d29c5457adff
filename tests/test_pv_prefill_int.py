"""The prefill's P V over an 8-bit middle on integers (kernels/pv_prefill_int.py) against float64:
within the 16-bit weights' rounding, with value scales of either sign (MLX's affine rows may hold
negative ones), odd row counts and several value groups a row."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from chatapp.kernels.pv_prefill_int import LANES, MAX_ROWS, WMAX, middle_pv, value_pairs  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, MAX_ROWS), lanes=st.sampled_from([LANES, 3 * LANES]), shape=st.sampled_from([(64, 64), (64, 32),
       (128, 64), (16, 16)]), r0=st.sampled_from([0, 2, 64]), seed=st.integers(0, 2**16), signed=st.booleans())
def test_middle_pv_equals_float64_within_the_weights_rounding(n, lanes, shape, r0, seed, signed):
    D, group = shape
    ng = D // group
    rng = np.random.default_rng(seed)
    rows = r0 + n
    vq = rng.integers(0, 256, rows * D + 7).astype(np.uint8)  # one head's bytes (a little room after)
    scales = rng.uniform(0.001, 0.02, rows * ng).astype(np.float32)
    if signed:
        scales *= rng.choice(np.array([-1, 1], np.float32), rows * ng)
    biases = rng.uniform(-1, 1, rows * ng).astype(np.float32)
    vp = np.zeros((rows + 1) // 2 * D, np.int32)
    vsc, vbi = np.full(rows * ng, np.nan, np.float32), np.full(rows * ng, np.nan, np.float32)
    value_pairs(vq, scales, biases, 0, 0, r0, n, D, ng, rows - 1, vp, vsc, vbi)
    p = rng.exponential(0.2, (n, lanes)).astype(np.float32)  # softmax numerators: >= 0, one peak or several
    ot0 = rng.normal(0, 1, (D, lanes)).astype(np.float32)
    ot = ot0.ravel().copy()
    w = np.zeros(MAX_ROWS // 2 * lanes, np.int32)
    middle_pv(p.ravel(), n, lanes, ot, D, group, vp, r0, vsc, vbi, w, np.zeros(lanes, np.float32),
              np.zeros(lanes, np.float32))
    x = vq[:rows * D].reshape(rows, D)[r0:].astype(np.float64)
    sc = scales.reshape(rows, ng)[r0:].astype(np.float64).repeat(group, axis=1)
    bi = biases.reshape(rows, ng)[r0:].astype(np.float64).repeat(group, axis=1)
    want = ot0 + (x * sc + bi).T @ p.astype(np.float64)
    # each weight rounds by at most half a step: (largest |p s| of its lane and group) / 2 WMAX,
    # times a byte (<= 255), over the n rows
    step = np.abs(p.astype(np.float64)[:, None, :] * np.abs(scales.reshape(rows, ng)[r0:])[:, :, None]).max(axis=0)
    bound = step.repeat(group, axis=0) / (2 * WMAX) * 255 * n + 1e-4 * (1 + np.abs(want))
    got = ot.reshape(D, lanes)
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() < 0.05 * np.abs((x * sc + bi).T @ p).max() + 1e-3


def test_value_pairs_interleave_two_rows_and_repeat_the_last():
    D = 32
    vq = np.arange(3 * D, dtype=np.uint8)
    vp = np.zeros(2 * D, np.int32)
    s = np.arange(3, dtype=np.float32)
    vsc, vbi = np.zeros(3, np.float32), np.zeros(3, np.float32)
    value_pairs(vq, s, -s, 0, 0, 0, 3, D, 1, 2, vp, vsc, vbi)
    halves = vp.view(np.uint16).reshape(2, D, 2)
    assert (halves[0, :, 0] == vq[:D]).all() and (halves[0, :, 1] == vq[D:2 * D]).all()
    assert (halves[1, :, 0] == vq[2 * D:]).all() and (halves[1, :, 1] == vq[2 * D:]).all()  # row 2 again
    assert (vsc == s).all() and (vbi == -s).all()
