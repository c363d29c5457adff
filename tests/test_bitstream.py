"""kernels/bitstream.py: MLX's packed 3/5/6-bit quants unpacked and packed natively, against
MLX's own reading of its packing (mx.dequantize with unit scales and zero biases) and the numpy
packing it replaced."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from chatapp.kernels.bitstream import pack_bits_rows, unpack_bits  # noqa: E402


def _numpy_pack(q: np.ndarray, bits: int) -> np.ndarray:
    """The numpy packing gguf_kquants.pack_bits used before (eight passes over uint64 words)."""
    lead, k = q.shape[:-1], q.shape[-1]
    eights = q.reshape(*lead, k // 8, 8).astype(np.uint64)
    word = np.zeros(eights.shape[:-1], np.uint64)
    for i in range(8):
        word |= eights[..., i] << np.uint64(bits * i)
    return np.ascontiguousarray(word[..., None].view(np.uint8)[..., :bits]).reshape(*lead, k * bits // 8)


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_unpack_reads_mlx_packing_as_mlx_does(bits):
    w = mx.random.normal((24, 96), key=mx.random.key(bits))
    wq, scales, _ = mx.quantize(w, group_size=32, bits=bits)
    want = mx.dequantize(wq, mx.ones_like(scales), mx.zeros_like(scales), group_size=32, bits=bits)
    got = unpack_bits(np.array(wq).view(np.uint8), bits)
    np.testing.assert_array_equal(got, np.array(want).astype(np.uint8))
    assert got.max() > 2 ** (bits - 1)  # the top bits are exercised


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([3, 5, 6]), rows=st.integers(1, 5), eights=st.integers(1, 6),
       lead=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_pack_equals_the_numpy_packing_and_unpack_inverts_it(bits, rows, eights, lead, seed):
    q = np.random.default_rng(seed).integers(0, 2**bits, (lead, rows, 8 * eights), dtype=np.uint8)
    packed = pack_bits_rows(q, bits)
    np.testing.assert_array_equal(packed, _numpy_pack(q, bits))
    np.testing.assert_array_equal(unpack_bits(packed.reshape(lead * rows, -1), bits), q.reshape(lead * rows, -1))
