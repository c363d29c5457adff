"""Symmetric weights (GGUF Q4_0: every bias -8 x its scale) without their bias array
(kernels/affine.py): the rule, the int8 rows, and the fused decode and prefill, which give the
same bits with the array dropped as with it read."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_install import fused_decoder  # noqa: E402
from chatapp.kernels import affine  # noqa: E402
from chatapp.kernels.affine import drop_symmetric_biases, is_symmetric  # noqa: E402
from tests.q4_weights import quantized  # noqa: E402
from tests.test_fused_decode import _decode, _model  # noqa: E402


def _f16_bits(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("half", [True, False])
def test_the_rule_finds_minus_eight_times_the_scale_and_nothing_else(half):
    s = np.random.default_rng(0).random((8, 4), dtype=np.float32) * 0.02
    b = -8 * s
    as_dtype = _f16_bits if half else (lambda a: a)
    assert is_symmetric(as_dtype(s), as_dtype(b), 4)
    assert not is_symmetric(as_dtype(s), as_dtype(b), 8)  # 8-bit symmetric means -128 x the scale
    assert is_symmetric(as_dtype(s), as_dtype(-128 * s), 8)
    off = b.copy()
    off[5, 2] *= 1.01
    assert not is_symmetric(as_dtype(s), as_dtype(off), 4)
    zero = s.copy()
    zero[0, 0] = 0.0  # an all-zero block: scale 0, bias 0 = -8 x 0
    assert is_symmetric(as_dtype(zero), as_dtype(-8 * zero), 4)
    if half:  # -8 x 10000 overflows float16: the stored bias is -inf, not -8 x the scale
        big = s.copy()
        big[1, 1] = 10000.0
        with np.errstate(over="ignore"):
            stored = _f16_bits(np.float16(-8) * big.astype(np.float16))
        assert not is_symmetric(as_dtype(big), stored, 4)
    packed = np.zeros((8, 64), np.uint8)
    _, _, dropped = drop_symmetric_biases(packed, as_dtype(s), as_dtype(b), 4)
    assert dropped.shape == (8, 0) and dropped.dtype == as_dtype(b).dtype
    _, _, kept = drop_symmetric_biases(packed, as_dtype(s), as_dtype(off), 4)
    assert kept.shape == (8, 4)


@pytest.mark.parametrize("row", [0, 255, 256, 1000, 1023])
def test_the_scan_finds_one_asymmetric_group_in_any_chunk(row):
    """The rule is checked by the pool's threads a chunk of rows at a time (affine.SCAN_ROWS): one
    group off anywhere, first or last row of a chunk, makes the whole array asymmetric."""
    s = 0.001 + np.random.default_rng(1).random((1024, 8), dtype=np.float32) * 0.02  # no float16 subnormals
    b = -8 * s
    assert is_symmetric(_f16_bits(s), _f16_bits(b), 4)
    b[row, 7] = b[row, 7] * 0.5
    assert not is_symmetric(_f16_bits(s), _f16_bits(b), 4)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), gs=st.sampled_from([32, 64, 128]), chunks=st.integers(1, 40),
       half=st.booleans())
def test_int8_rows_without_the_bias_array_are_the_same_bits(seed, gs, chunks, half):
    from chatapp.kernels.int8dot import q4_rows4_i8, quantise_lanes

    k = 128 * chunks if gs == 128 else 64 * chunks
    packed, s, _, _ = quantized(seed, 8, k, gs, half)
    sf = s.view(np.float16) if half else s
    b = (sf * sf.dtype.type(-8)).astype(sf.dtype)
    b = b.view(np.uint16) if half else b
    x = np.random.default_rng(seed).standard_normal(k).astype(np.float32)
    xq = (np.empty(k // 2, np.int8), np.empty(k // 2, np.int8), np.empty(k // 8, np.float32),
          np.empty(k // 8, np.float32))
    quantise_lanes(x, 8, *xq)

    @njit
    def rows(w, xq, sc, bi, out):
        tmp = np.empty(4, np.float32)
        for r in range(0, w.shape[0], 4):
            q4_rows4_i8(w, r, xq, sc, bi, gs, tmp)
            out[r:r + 4] = tmp

    with_array, without = np.empty(8, np.float32), np.empty(8, np.float32)
    rows(packed, xq, s, b, with_array)
    rows(packed, xq, s, np.empty((8, 0), b.dtype), without)
    np.testing.assert_array_equal(without, with_array)


def _symmetric_model(seed=0):
    """The fused tests' random model with every projection's biases set to -8 x its scales."""
    m = _model(seed=seed)
    for _, mod in m.named_modules():
        if isinstance(mod, nn.QuantizedLinear):
            mod.biases = (mod.scales * -8).astype(mod.scales.dtype)
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_fused_decode_and_prefill_without_the_bias_arrays_are_the_same_bits(numerics, monkeypatch):
    prompt = [int(t) for t in mx.random.randint(0, 640, (23,), key=mx.random.key(3))]
    dropped = _symmetric_model()
    apply_fast_path(dropped, backend="cpu", numerics=numerics, warm_up=False)
    dec = fused_decoder(dropped)
    assert all(b.shape[1] == 0 for layer in dec.layers for (_, _, b) in layer.weights)
    held = sum(mod.biases.nbytes for name, mod in dropped.named_modules()
               if isinstance(mod, nn.QuantizedLinear) and "layers" in name)
    assert dec.dropped_bias_bytes() == held > 0
    t_dropped, l_dropped, _ = _decode(dropped, prompt, 6)

    monkeypatch.setattr(affine, "drop_symmetric_biases", lambda p, s, b, bits: (p, s, b))
    kept = _symmetric_model()
    apply_fast_path(kept, backend="cpu", numerics=numerics, warm_up=False)
    assert all(b.shape[1] > 0 for layer in fused_decoder(kept).layers for (_, _, b) in layer.weights)
    t_kept, l_kept, _ = _decode(kept, prompt, 6)
    assert t_dropped == t_kept
    np.testing.assert_array_equal(np.stack(l_dropped), np.stack(l_kept))


def test_affine_weights_keep_their_biases():
    m = _model()
    apply_fast_path(m, backend="cpu", warm_up=False)
    assert all(b.shape[1] > 0 for layer in fused_decoder(m).layers for (_, _, b) in layer.weights)
    assert fused_decoder(m).dropped_bias_bytes() == 0
