"""The exact route's 4-row float kernel (kernels/rows4.py, software prefetch ahead included)
against mx.dequantize then matmul, and bit-identical to simd.q4_row_dot row by row."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.rows4 import q4_rows4_dot  # noqa: E402
from chatapp.kernels.simd import q4_row_dot  # noqa: E402
from tests.q4_weights import as_f32, quantized  # noqa: E402


@njit
def _both(w, xe, xo, s, gs, out4, out1):
    tmp = np.empty(4, np.float32)
    for r in range(0, w.shape[0], 4):
        q4_rows4_dot(w, r, xe, xo, s, gs, tmp)
        out4[r:r + 4] = tmp
    for r in range(w.shape[0]):
        out1[r] = q4_row_dot(w[r], xe, xo, s[r], gs)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), blocks=st.integers(1, 40),
       half=st.booleans(), calls=st.integers(1, 3))
def test_rows4_equal_single_rows_and_dequantize_then_matmul(seed, gs, blocks, half, calls):
    """Rows short and long against the prefetch distance, several calls (the prefetch wraps into
    the next call's rows and past the weight's end): the same bits as one row at a time, and
    (with the biases' part added) mx.dequantize(w) @ x to float rounding."""
    k = 128 * blocks if gs == 128 else 64 * blocks
    n = 4 * calls
    packed, s, b, deq = quantized(seed, n, k, gs, half)
    x = np.random.default_rng(seed).standard_normal(k).astype(np.float32)
    out4, out1 = np.empty(n, np.float32), np.empty(n, np.float32)
    _both(packed, x[0::2].copy(), x[1::2].copy(), s, gs, out4, out1)
    np.testing.assert_array_equal(out4, out1)
    full = out4 + np.repeat(as_f32(b), gs, 1) @ x
    exact = deq @ x
    np.testing.assert_allclose(full, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max() + 1e-5)
