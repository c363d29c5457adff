"""cpu.numerics = fast: the int8 dot-product rows (kernels/int8dot.py) against mx.dequantize then
matmul and against a model of their integer sums, every instruction variant this CPU can run,
the fused decode step with them, and the choice of instruction from the CPU's features
(mocked: no feature is assumed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels import int8dot  # noqa: E402
from chatapp.kernels.int8dot import detect_isa, make_rows_i8, quantise_lanes, quantise_lanes_wide  # noqa: E402
from tests.q4_weights import quantized, runnable_isas  # noqa: E402

# int8 per block: each activation carries at most scale/2 = max|x|/254 of rounding, so against
# the float product a row is off by ~1% of its magnitude at most; we allow 3% of the largest output
REL_TOL = 3e-2


_KERNELS: dict = {}


def _kernel(isa: str, gs: int, planes: int = 1):
    """A jitted caller of the 4-row kernel for (isa, group size, planes), built once per test session."""
    key = (isa, gs, planes)
    if key not in _KERNELS:
        k = make_rows_i8(isa, gs, planes=planes)

        @njit
        def run(w, a, b, c, d, sc, bi, out):
            k(w, 0, a, b, c, d, sc, bi, out)

        _KERNELS[key] = run
    return _KERNELS[key]


def _lanes(x, block):
    k = x.shape[0]
    xq = (np.empty(k // 2, np.int8), np.empty(k // 2, np.int8), np.empty(k // 8, np.float32),
          np.empty(k // 8, np.float32))
    quantise_lanes(x, block, *xq)
    return xq


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), chunks=st.integers(1, 6),
       half=st.booleans(), block=st.sampled_from([8, 16, 32]), spread=st.sampled_from([1.0, 30.0]))
def test_int8_rows_match_dequantize_then_matmul(seed, gs, chunks, half, block, spread):
    """Every ISA this CPU runs: rows of mx.dequantize(w) @ x within the int8 rounding's bound, and
    to float rounding the model of the kernel's sums: the dequantised weights, biases included,
    times the quantised x (the biases' share from the lane sums as quantised, so the error is
    sum w e over the roundings e, bounded by |w|); K % 128 = 64 (a half step) included."""
    k = 64 * chunks if gs != 128 else 128 * chunks
    packed, s, b, deq = quantized(seed, 4, k, gs, half)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(k) * rng.choice([0.01, 1.0, spread], k)).astype(np.float32)
    xq = _lanes(x, block)
    x8 = np.empty(k, np.float32)
    x8[0::2], x8[1::2] = xq[0], xq[1]
    x8 *= np.repeat(xq[2], 8)
    model = deq @ x8
    exact = deq @ x
    # each activation is off by at most half its block's step: the rounding's worst case
    bound = np.abs(deq) @ (np.repeat(xq[2], 8) / 2) * 1.01 + 1e-4 * np.abs(exact).max() + 1e-6
    for isa in runnable_isas():
        out = np.empty(4, np.float32)
        _kernel(isa, gs)(packed, *xq, s, b, out)
        np.testing.assert_allclose(out, model, rtol=1e-4, atol=1e-4 * np.abs(model).max() + 1e-6, err_msg=isa)
        assert np.all(np.abs(out - exact) <= bound), isa


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), chunks=st.integers(1, 6),
       half=st.booleans(), block=st.sampled_from([8, 16, 32]), spread=st.sampled_from([1.0, 30.0]))
def test_16bit_rows_match_their_integers_and_are_about_256_times_finer(seed, gs, chunks, half, block, spread):
    """planes 2 (down_proj in decode): every ISA this CPU runs gives the sums of its model, the
    activations as (hi * 256 + lo) x scale / 256, to float rounding; each activation is within
    scale / 512 of x (half a step of the low plane), so the product is within that bound of the
    float one; K % 128 = 64 included."""
    k = 64 * chunks if gs != 128 else 128 * chunks
    packed, s, b, deq = quantized(seed, 4, k, gs, half)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(k) * rng.choice([0.01, 1.0, spread], k)).astype(np.float32)
    xq = (np.empty(k, np.int8), np.empty(k, np.int8), np.empty(k // 8, np.float32), np.empty(k // 8, np.float32))
    quantise_lanes_wide(x, block, *xq)
    h = k // 2
    x16 = np.empty(k, np.float64)
    x16[0::2] = xq[0][:h] * 256.0 + xq[0][h:]
    x16[1::2] = xq[1][:h] * 256.0 + xq[1][h:]
    step = np.repeat(xq[2], 8).astype(np.float64)  # the block's scale / 256
    assert np.all(np.abs(x16 * step - x) <= step / 2 * 1.001 + np.abs(x) * 2.0**-20 + 1e-30)
    model = deq.astype(np.float64) @ (x16 * step)
    exact = deq @ x
    bound = np.abs(deq) @ (step / 2) * 1.01 + 1e-4 * np.abs(exact).max() + 1e-6
    for isa in runnable_isas():
        out = np.empty(4, np.float32)
        _kernel(isa, gs, 2)(packed, *xq, s, b, out)
        np.testing.assert_allclose(out, model, rtol=1e-4, atol=1e-4 * np.abs(model).max() + 1e-6, err_msg=isa)
        assert np.all(np.abs(out - exact) <= bound), isa


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), block=st.sampled_from([8, 16, 32]), blocks=st.integers(1, 8))
def test_quantise_lanes_rounds_within_half_a_step(seed, block, blocks):
    k = max(64, block * blocks // 64 * 64) if block * blocks % 64 else block * blocks
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(k) * rng.choice([0.0, 1e-3, 1.0, 50.0], k)).astype(np.float32)
    xqe, xqo, ls, sums = _lanes(x, block)
    xq = np.empty(k, np.float32)
    xq[0::2], xq[1::2] = xqe, xqo
    step = np.repeat(ls, 8)
    assert np.all(np.abs(xq * step - x) <= step / 2 * 1.001 + 1e-30)
    assert np.all(step.reshape(-1, block) == step.reshape(-1, block)[:, :1])  # one scale per block
    # the lane sums are of the values as quantised, not as given (int8dot._lane_sums)
    np.testing.assert_allclose(sums, (xq * step).reshape(-1, 8).sum(1), rtol=1e-6, atol=1e-6 * np.abs(x).max())
    assert np.abs(xq).max() <= 127


def test_zero_block_quantises_to_zero():
    x = np.zeros(64, np.float32)
    x[32:] = np.linspace(-1, 1, 32, dtype=np.float32)
    xqe, xqo, ls, _ = _lanes(x, 32)
    assert not xqe[:16].any() and not xqo[:16].any() and not ls[:4].any()
    assert ls[4] == pytest.approx(1 / 127) and np.abs(xqe[16:]).max() <= 127


@pytest.mark.parametrize("features, isa", [
    ({"avx512vnni": True, "avx512bw": True, "avx512f": True, "avx512vl": True, "avx2": True}, "vnni512"),
    ({"avx512vnni": True, "avx512vl": True, "avx2": True}, "vnni"),
    ({"avxvnni": True, "avx2": True}, "vnni"),
    ({"avx512vnni": True, "avx512vl": False, "avx2": True}, "avx2"),  # no 256-bit form without VL
    ({"avx2": True}, "avx2"),
    ({}, "generic"),  # no features known (another architecture, or LLVM could not tell)
])
def test_isa_follows_the_cpu_features(features, isa):
    assert detect_isa(features) == isa


def test_no_features_falls_back_to_portable_code(monkeypatch):
    monkeypatch.setattr(int8dot, "cpu_features", lambda: {})
    assert detect_isa() == "generic"
    packed, s, b, deq = quantized(5, 4, 192, 64, False)
    x = np.random.default_rng(5).standard_normal(192).astype(np.float32)
    out = np.empty(4, np.float32)
    _kernel(detect_isa(), 64)(packed, *_lanes(x, 8), s, b, out)
    assert np.abs(out - deq @ x).max() <= REL_TOL * np.abs(deq @ x).max()
    with pytest.raises(ValueError, match="isa must be one of"):
        make_rows_i8("sse9", 32)
    with pytest.raises(ValueError, match="planes must be 1 or 2"):
        make_rows_i8(detect_isa(), 32, planes=3)


def test_fused_fast_decode_stays_close_to_exact():
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.backend.fused_install import is_fused
    from tests.test_fused_decode import SMOL, _decode, _model

    exact, fast = _model(), _model()
    apply_fast_path(exact, backend="cpu")
    plan = apply_fast_path(fast, backend="cpu", numerics="fast")
    assert is_fused(fast) and "numerics fast" in plan.summary(), plan.summary()
    prompt = [int(t) for t in mx.random.randint(0, SMOL.vocab_size, (12,), key=mx.random.key(3))]
    t_exact, l_exact, _ = _decode(exact, prompt, 6)
    t_fast, l_fast, _ = _decode(fast, prompt, 6)
    # one step from the same history: the logits differ by the int8 rounding only
    assert np.abs(l_fast[0] - l_exact[0]).max() <= REL_TOL * np.abs(l_exact[0]).max()
    assert t_fast[0] == t_exact[0]
    with pytest.raises(ValueError, match="numerics must be one of"):
        apply_fast_path(_model(), backend="cpu", numerics="fastest")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), chunks=st.integers(1, 40),
       half=st.booleans(), calls=st.integers(1, 3))
def test_prefetching_rows_are_the_plain_rows_bit_for_bit(seed, gs, chunks, half, calls):
    """The production kernels (software prefetch of the rows, scales and biases ahead, wrapping into
    the next call's rows and past the weight's end) against dequantize then matmul, and bit-identical
    to the kernel built without prefetch: prefetching changes no arithmetic. Rows long and short
    against the prefetch distance; several 4-row calls."""
    from chatapp.kernels.int8dot import ISA, q4_rows4_i8

    k = 128 * chunks if gs == 128 else 64 * chunks
    n = 4 * calls
    packed, s, b, deq = quantized(seed, n, k, gs, half)
    x = np.random.default_rng(seed).standard_normal(k).astype(np.float32)
    xq = _lanes(x, 8)
    plain = make_rows_i8(ISA, gs)

    @njit
    def both(w, xq, sc, bi, out_pf, out_plain):
        tmp = np.empty(4, np.float32)
        for r in range(0, w.shape[0], 4):
            q4_rows4_i8(w, r, xq, sc, bi, gs, tmp)
            out_pf[r:r + 4] = tmp
            plain(w, r, xq[0], xq[1], xq[2], xq[3], sc, bi, tmp)
            out_plain[r:r + 4] = tmp

    out_pf, out_plain = np.empty(n, np.float32), np.empty(n, np.float32)
    both(packed, xq, s, b, out_pf, out_plain)
    np.testing.assert_array_equal(out_pf, out_plain)
    exact = deq @ x
    # each activation is off by at most half its block's step (as in the test above)
    bound = np.abs(deq) @ (np.repeat(xq[2], 8) / 2) * 1.01 + 1e-4 * np.abs(exact).max() + 1e-6
    assert np.all(np.abs(out_pf - exact) <= bound)
