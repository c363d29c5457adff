"""cpu.numerics = fast, prefill: the panel microkernel (kernels/int8panel.py) against mx.dequantize
then matmul and against a model of its integer sums, for every instruction variant this CPU can
run; row counts that are not a multiple of 16, token counts that are not a multiple of the token
block, groups of 32/64/128, float16 and float32 scales, activation blocks finer and coarser than
the group, int8 (one plane) and 16-bit (two planes) activations."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.int8dot import ISA  # noqa: E402
from chatapp.kernels.int8panel import (  # noqa: E402
    PANEL8,
    PANEL_ROWS,
    PANEL_TOKENS,
    make_panel_tile,
    pack_panel,
    panel_tile,
    panel_token_rows,
    panel_unit,
    quantise_panel_tokens,
)
from chatapp.kernels.panel_avx2 import avx2_panel_tile, make_avx2_panel_tile  # noqa: E402
from tests.q4_weights import quantized, runnable_isas  # noqa: E402

_RUNNERS: dict = {}


def _isas(bits: int) -> list[str]:
    """The instruction sets this CPU runs whose panel reads rows of ``bits`` (AVX2's: 4 only)."""
    return [isa for isa in runnable_isas() if bits == 4 or isa != "avx2"]


@njit
def _pack_all(packed, scales, biases, bits, gs):
    """Every 16-row panel of a weight as pack_panel makes them (float32 scales and biases): one
    compile per scale dtype here, so the runners below see float32 panels only."""
    N = packed.shape[0]
    K = packed.shape[1] * 8 // bits
    n_pan = (N + PANEL_ROWS - 1) // PANEL_ROWS
    pan = np.empty((n_pan, K // 8, PANEL_ROWS * bits // 4), np.uint32)
    ps = np.empty((n_pan, K // gs, PANEL_ROWS), np.float32)
    pb = np.empty((n_pan, K // gs, PANEL_ROWS), np.float32)
    for p in range(n_pan):
        r0 = p * PANEL_ROWS
        pack_panel(packed, scales, biases, bits, r0, min(PANEL_ROWS, N - r0), pan[p], ps[p], pb[p])
    return pan, ps, pb


def _runner(isa: str, planes: int, bits: int = 4):
    """A jitted product of a whole weight (its panels, _pack_all) with T tokens through the panel
    kernel of ``isa``: PANEL_TOKENS tokens a call, results of rows and tokens past the ends
    dropped (as prefill_step does). The host ISA goes through panel_tile's dispatch. One per
    instruction variant (group and unit are arguments; a runner per drawn size and scale dtype
    compiled this test for ~60 s)."""
    key = (isa, planes, bits)
    if key in _RUNNERS:
        return _RUNNERS[key]
    if isa == ISA:
        @njit
        def tile(pan, xq, t0, gs, unit, out):
            panel_tile(pan, xq, t0, gs, unit, out)
    elif isa == "avx2":  # through panel_avx2's own dispatch, as an AVX2 host runs it
        @njit
        def tile(pan, xq, t0, gs, unit, out):
            avx2_panel_tile(pan, xq, t0, gs, unit, out)
    else:
        k = make_panel_tile(isa, bits, planes=planes)

        @njit
        def tile(pan, xq, t0, gs, unit, out):
            k(pan[0], pan[1], pan[2], xq[0], xq[1], xq[2], xq[3], t0, unit, gs, out)

    @njit
    def run_panels(pan, ps, pb, N, xq, T, gs, unit, got):
        out = np.empty(PANEL_TOKENS * PANEL_ROWS, np.float32)
        for p in range(pan.shape[0]):
            r0 = p * PANEL_ROWS
            n = min(PANEL_ROWS, N - r0)
            for t in range(0, T, PANEL_TOKENS):
                tile((pan[p], ps[p], pb[p]), xq, t, gs, unit, out)
                for j in range(min(PANEL_TOKENS, T - t)):
                    for i in range(n):
                        got[t + j, r0 + i] = out[j * PANEL_ROWS + i]

    def run(packed, scales, biases, xq, T, gs, unit, got):
        run_panels(*_pack_all(packed, scales, biases, bits, gs), packed.shape[0], xq, T, gs, unit, got)

    _RUNNERS[key] = run
    return run


def _tokens(x, block, unit, planes):
    """quantise_panel_tokens of x [T, K] (natural order), tokens padded to panel_token_rows."""
    T, K = x.shape
    xp = np.ascontiguousarray(np.concatenate([x[:, 0::2], x[:, 1::2]], 1))
    Tp = panel_token_rows(T)
    assert Tp >= T and Tp % PANEL_TOKENS == 0 and Tp % 32
    xq = (np.zeros((K // 8, Tp, 4 * planes), np.int8), np.zeros((K // 8, Tp, 4 * planes), np.int8),
          np.zeros((K // unit, Tp), np.float32), np.zeros((K // unit, Tp), np.float32))
    quantise_panel_tokens(xp, block, unit, *xq)
    return xq


def _natural(xq, T, K, unit):
    """(integer values [T, K] in natural order, hi * 256 + lo with two planes, and their scales
    [T, K]) from quantise_panel_tokens' layout."""
    planes = xq[0].shape[2] // 4

    def plane(a, p):
        return a[:, :T, 4 * p:4 * p + 4].transpose(1, 0, 2).reshape(T, K // 2).astype(np.float64)

    e = sum(plane(xq[0], p) * 256.0 ** (planes - 1 - p) for p in range(planes))
    o = sum(plane(xq[1], p) * 256.0 ** (planes - 1 - p) for p in range(planes))
    q = np.empty((T, K), np.float64)
    q[:, 0::2], q[:, 1::2] = e, o
    return q, np.repeat(xq[2][:, :T].T, unit, 1).astype(np.float64)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), groups=st.integers(1, 4),
       n=st.integers(1, 40), T=st.integers(1, 19), half=st.booleans(), block=st.sampled_from([8, 16, 32, 64, 128]),
       spread=st.sampled_from([1.0, 30.0]), planes=st.sampled_from([1, 2]), bits=st.sampled_from([4, 8]))
def test_panel_matches_dequantize_then_matmul(seed, gs, groups, n, T, half, block, spread, planes, bits):
    """Every ISA this CPU runs: mx.dequantize(w) @ x within the int8 (or 16-bit) rounding's
    bound, and to float rounding the model of the kernel's sums: the quantised x times the
    dequantised weights, biases included (the biases' share from the unit sums as quantised);
    4- and 8-bit rows (8-bit weights 0..255: the sums' range a 4-bit test never reaches)."""
    k = max(gs, block) * groups
    unit = panel_unit(block, gs)
    packed, s, b, deq = quantized(seed, n, k, gs, half, bits)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, k)) * rng.choice([0.01, 1.0, spread], (T, k))).astype(np.float32)
    xq = _tokens(x, block, unit, planes)
    q, step = _natural(xq, T, k, unit)
    # nearest, one scale per block: max|x| / 127 (/ 256 on two planes, each plane int8); x / scale
    # is a float32 product (x * 127 / max|x|), a few ulps off, which on two planes is 1e-3 of a step
    assert np.all(np.abs(q * step - x) <= step / 2 * 1.001 + np.abs(x) * 2.0**-20 + 1e-30)
    assert np.all(np.abs(q) <= 127 * 256 ** (planes - 1) + 127 * (planes - 1))
    assert np.all(step.reshape(T, -1, block) == step.reshape(T, -1, block)[:, :, :1])
    model = (q * step) @ deq.astype(np.float64).T
    exact = x @ deq.T
    bound = (step / 2) @ np.abs(deq).T * 1.01 + 1e-4 * np.abs(exact).max() + 1e-6
    for isa in _isas(bits):
        got = np.full((T, n), np.nan, np.float32)
        _runner(isa, planes, bits)(packed, s, b, xq, T, gs, unit, got)
        np.testing.assert_allclose(got, model, rtol=1e-4, atol=1e-4 * np.abs(model).max() + 1e-6, err_msg=isa)
        assert np.all(np.abs(got - exact) <= bound), isa


def test_two_planes_are_about_256_times_finer():
    """The 16-bit activations' rounding against the int8 ones' on the same heavy-tailed input
    (silu(gate) x up-like: a few large values per block): the product error falls ~256x."""
    rng = np.random.default_rng(0)
    T, k, gs = 9, 512, 32
    packed, s, b, deq = quantized(1, 24, k, gs, False)
    x = (rng.standard_normal((T, k)) * rng.choice([0.05, 1.0, 40.0], (T, k), p=[0.7, 0.28, 0.02])).astype(np.float32)
    exact = x.astype(np.float64) @ deq.T
    err = {}
    for planes in (1, 2):
        got = np.full((T, 24), np.nan, np.float32)
        _runner(ISA, planes)(packed, s, b, _tokens(x, 32, 32, planes), T, gs, 32, got)
        err[planes] = np.abs(got - exact).max()
    assert err[2] * 50 < err[1]


def test_panel_tiles_reject_what_they_cannot_read():
    with pytest.raises(ValueError):
        make_avx2_panel_tile(64, 32, PANEL_TOKENS, 1)  # a unit that does not divide the group
    with pytest.raises(ValueError):
        make_panel_tile("sse9")
    with pytest.raises(ValueError):
        make_panel_tile("generic", planes=3)
    with pytest.raises(ValueError):
        make_panel_tile("generic", bits=5)
    with pytest.raises(ValueError):
        make_panel_tile("avx2")  # AVX2's tiles are panel_avx2's
    assert panel_unit(8, 64) == 8 and panel_unit(128, 32) == 32
    assert PANEL8 == (ISA != "avx2")


@pytest.mark.parametrize("n, K", [(16, 4096), (5, 160), (16, 352), (1, 128)])
@pytest.mark.parametrize("bits", [4, 8])
def test_pack_panel_is_the_transpose_of_the_rows_dwords(n, K, bits):
    """4-bit: panel[s, i] = dword s of row r0 + i; 8-bit: panel[s, i] the bytes of elements 8s,
    8s + 2, 8s + 4, 8s + 6 and panel[s, 16 + i] of the odd ones; each group's scale and bias, rows
    past n zero, whatever the panel steps (K / 8) and rows."""
    rng = np.random.default_rng(n + K)
    N, gs = 40, 32
    packed = rng.integers(0, 256, (N, K * bits // 8), dtype=np.uint8)
    scales = rng.random((N, K // gs), dtype=np.float32)
    biases = rng.random((N, K // gs), dtype=np.float32)
    width = PANEL_ROWS * bits // 4
    panel = np.full((K // 8, width), 7, np.uint32)
    ps, pb = np.full((K // gs, PANEL_ROWS), 7, np.float32), np.full((K // gs, PANEL_ROWS), 7, np.float32)
    r0 = 21
    pack_panel(packed, scales, biases, bits, r0, n, panel, ps, pb)
    want = np.zeros((K // 8, width), np.uint32)
    rows = packed[r0:r0 + n]
    if bits == 4:
        want[:, :n] = rows.view(np.uint32).T
    else:
        want[:, :n] = np.ascontiguousarray(rows[:, 0::2]).view(np.uint32).T
        want[:, PANEL_ROWS:PANEL_ROWS + n] = np.ascontiguousarray(rows[:, 1::2]).view(np.uint32).T
    np.testing.assert_array_equal(panel, want)
    np.testing.assert_array_equal(ps[:, :n], scales[r0:r0 + n].T)
    np.testing.assert_array_equal(pb[:, :n], biases[r0:r0 + n].T)
    assert not ps[:, n:].any() and not pb[:, n:].any()
