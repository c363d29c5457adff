"""The output head on int8 activations (kernels/int8head.py): the 8-bit rows against a model of
their integer sums and against mx.dequantize then matmul, both product forms (signed for AVX2
and the portable code, unsigned for VNNI: the portable code runs it here), symmetric weights
without a bias array, FastHead over whole heads (8- and 4-bit, a row count that is not a
multiple of four), and the fused decoder taking it under numerics fast only."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.kernels.int8head import FastHead, make_q8_rows_i8, quantise_rows8, signed_products, unsupported  # noqa: E402
from tests.q4_weights import as_f32, quantized, runnable_isas  # noqa: E402

_KERNELS: dict = {}


def _forms() -> list[tuple[str, bool]]:
    """(isa, signed) of every product form this CPU runs: each ISA's own, and the portable code's
    other one (VNNI's unsigned form, which this CPU may lack the instruction for)."""
    out = [(isa, signed_products(isa)) for isa in runnable_isas()]
    return out + [("generic", False)]


def _kernel(isa: str, gs: int, signed: bool):
    key = (isa, gs, signed)
    if key not in _KERNELS:
        k = make_q8_rows_i8(isa, gs, signed=signed)

        @njit
        def run(w, xq, ls, xs, sc, bi, out):
            k(w, 0, xq, ls, xs, sc, bi, out)

        _KERNELS[key] = run
    return _KERNELS[key]


def _quantise(x, block=32):
    k = x.shape[0]
    xq, ls, xs = np.empty(k, np.int8), np.empty(k // 4, np.float32), np.empty(k // 4, np.float32)
    quantise_rows8(x, block, xq, ls, xs)
    return xq, ls, xs


def _symmetric(seed: int, n: int, k: int, gs: int, half: bool):
    """A Q8_0-like weight as mx.load gives it (q = signed + 128, bias = -128 scale), the bias array
    dropped as affine.py does: (bytes, scales, empty biases, dequantised)."""
    rng = np.random.default_rng(seed)
    signed = rng.integers(-128, 128, (n, k))
    s = (rng.random((n, k // gs)) * 0.01 + 1e-4).astype(np.float32)
    if half:
        s = s.astype(np.float16).view(np.uint16)
    deq = signed * np.repeat(as_f32(s), gs, 1)
    return (signed + 128).astype(np.uint8), s, np.empty((n, 0), s.dtype), deq.astype(np.float32)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), steps=st.integers(1, 12),
       half=st.booleans(), sym=st.booleans(), spread=st.sampled_from([1.0, 30.0]))
def test_8bit_rows_match_their_integers_and_dequantize_then_matmul(seed, gs, steps, half, sym, spread):
    """Every form this CPU runs: the model of the sums (the dequantised weights times the quantised
    x, biases through the lane sums as quantised) to float rounding, and the float product within
    the rounding's worst case, sum |w| x half a step; rows of K % 64 = 32 (a half step) included."""
    k = max(gs, 32 * steps // gs * gs)
    packed, s, b, deq = (_symmetric if sym else lambda *a: quantized(*a, bits=8))(seed, 4, k, gs, half)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(k) * rng.choice([0.01, 1.0, spread], k)).astype(np.float32)
    xq, ls, xs = _quantise(x)
    model = deq.astype(np.float64) @ (xq * np.repeat(ls, 4).astype(np.float64))
    exact = deq @ x
    bound = np.abs(deq) @ (np.repeat(ls, 4) / 2) * 1.01 + 1e-4 * np.abs(exact).max() + 1e-6
    for isa, signed in _forms():
        out = np.empty(4, np.float32)
        _kernel(isa, gs, signed)(packed, xq, ls, xs, s, b, out)
        np.testing.assert_allclose(out, model, rtol=1e-4, atol=1e-4 * np.abs(model).max() + 1e-6,
                                   err_msg=f"{isa} signed={signed}")
        assert np.all(np.abs(out - exact) <= bound), (isa, signed)


def test_extreme_bytes_do_not_saturate():
    """Every byte 0 (q - 128 = -128) or 255 against activations of +-127: AVX2's pair sums reach
    2 x 128 x 127, the largest the signed form makes; the result is the exact integer sum."""
    k = 256
    packed = np.zeros((4, k), np.uint8)
    packed[1] = 255
    packed[2, ::2] = 255
    packed[3] = np.arange(k) % 256
    s = np.full((4, k // 32), 1.0, np.float32)
    b = np.zeros((4, k // 32), np.float32)
    x = np.where(np.arange(k) % 3 == 0, -1.0, 1.0).astype(np.float32)
    xq, ls, xs = _quantise(x)
    assert np.abs(xq).max() == 127
    want = packed.astype(np.float64) @ (xq * np.repeat(ls, 4).astype(np.float64))
    for isa, signed in _forms():
        out = np.empty(4, np.float32)
        _kernel(isa, 32, signed)(packed, xq, ls, xs, s, b, out)
        np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=f"{isa} signed={signed}")


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), block=st.sampled_from([8, 16, 32]), blocks=st.integers(1, 12))
def test_quantise_rows8_rounds_within_half_a_step(seed, block, blocks):
    k = block * blocks
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(k) * rng.choice([0.0, 1e-3, 1.0, 50.0], k)).astype(np.float32)
    xq, ls, xs = _quantise(x, block)
    step = np.repeat(ls, 4)
    assert np.all(np.abs(xq * step - x) <= step / 2 * 1.001 + 1e-30)
    assert np.all(step.reshape(-1, block) == step.reshape(-1, block)[:, :1])  # one scale per block
    np.testing.assert_allclose(xs, (xq * step).reshape(-1, 4).sum(1), rtol=1e-6, atol=1e-6 * np.abs(x).max())


@pytest.mark.parametrize("bits, n, k, gs, sym", [(8, 4 * 37 + 3, 576, 32, True), (8, 101, 256, 64, False),
                                                  (8, 64, 256, 128, True), (4, 4 * 41 + 1, 576, 32, False),
                                                  (4, 96, 512, 64, False)])
def test_fast_head_matches_the_float_product_over_the_whole_head(bits, n, k, gs, sym):
    """FastHead through the pool (chunks of rows; a last chunk ending with the weight's last four
    rows when n % 4 != 0) against dequantize then matmul, within the activations' rounding."""
    if sym:
        packed, s, b, deq = _symmetric(7, n, k, gs, True)
    else:
        packed, s, b, deq = quantized(7, n, k, gs, True, bits=bits)
    x = np.random.default_rng(n).standard_normal(k).astype(np.float32)
    head = FastHead(packed, s, b, bits, gs)
    out = head(x)
    exact = deq @ x
    assert out.shape == (n,)
    # per element at most half its block's step, max|x| / 254 per block of 32
    step = np.repeat(np.abs(x).reshape(-1, 32).max(1) / 127, 32)
    bound = np.abs(deq) @ (step / 2) * 1.01 + 1e-4 * np.abs(exact).max()
    assert np.all(np.abs(out - exact) <= bound)
    np.testing.assert_array_equal(head(x), out)  # the buffers are reused: the same bits again


def test_unsupported_heads_say_why():
    assert unsupported(8, 32, 576, 49152) is None and unsupported(4, 64, 4096, 32000) is None
    assert "2-bit" in unsupported(2, 32, 576, 100)
    assert "group size 16" in unsupported(8, 16, 576, 100)
    assert "multiple of 64" in unsupported(4, 32, 96, 100)
    assert "rows" in unsupported(8, 32, 64, 3)
    with pytest.raises(ValueError, match="signed form"):
        make_q8_rows_i8("avx2", 32, signed=False)
    with pytest.raises(ValueError, match="does not divide"):
        FastHead(np.zeros((8, 96), np.uint8), np.zeros((8, 3), np.float32), np.zeros((8, 3), np.float32), 8, 32,
                 block=64)


def test_fused_decoder_takes_the_int8_head_under_fast_only():
    """numerics fast: the head's logits come from FastHead (head="int8", the default), close to the
    float head's; head="exact" and numerics exact run the float product, bit for bit the same."""
    import mlx.core as mx

    from chatapp.backend.cpu import apply_fast_path
    from chatapp.backend.fused_install import fused_decoder
    from tests.test_fused_decode import _model

    model = _model()  # a tied 8-bit embedding: the head
    apply_fast_path(model, backend="cpu", numerics="fast")
    dec = fused_decoder(model)
    assert dec._int8_head is not None and dec.int8_head
    x = np.asarray(mx.random.normal((dec.dim,), key=mx.random.key(1)))
    fast = dec._head(x)
    dec.set_fast(True, head="exact")
    exact = dec._head(x)
    dec.set_fast(False)
    np.testing.assert_array_equal(dec._head(x), exact)
    assert not np.array_equal(fast, exact)
    assert np.abs(fast - exact).max() <= 2e-2 * np.abs(exact).max()
    with pytest.raises(ValueError, match="head must be one of"):
        dec.set_fast(True, head="int4")
