"""GGUF's Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks repacked as MLX affine layers (model/gguf_kquants.py):
values against the ``gguf`` package's reference dequantisation (llama.cpp's), models loaded from
files of each type, and the one-line refusals."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_unflatten

from chatapp.model.gguf import load_gguf
from chatapp.model.gguf_file import GGML_TYPES, REPACKED_BITS, GGUFError
from chatapp.model.gguf_kquants import LAYOUTS, affine_blocks, dequantize, q6_k_values
from chatapp.model.gguf_writer import F32, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, write_gguf
from tests.gguf_models import WIDE, metadata, random_llama, write_model_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) holds the reference dequantisation")
TYPE_IDS = {"Q5_0": Q5_0, "Q5_1": Q5_1, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}
# where each block type keeps its float16 numbers (d, dmin or m): bytes [start, start + 2)
HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def reference(kind: str, raw: np.ndarray, rows: int) -> np.ndarray:
    return gguf.quants.dequantize(raw.reshape(rows, -1), getattr(gguf.GGMLQuantizationType, kind)).reshape(rows, -1)


def blocks_from(kind: str, data: bytes, halves: list[float]) -> np.ndarray:
    """Random bytes as blocks of ``kind``, its float16 fields set to the finite ``halves``."""
    lay = LAYOUTS[kind]
    raw = np.frombuffer(data, np.uint8).reshape(-1, lay.block_bytes).copy()
    h = np.resize(np.array(halves, np.float16), (len(raw), len(HALVES[kind])))
    for i, start in enumerate(HALVES[kind]):
        raw[:, start:start + 2] = h[:, i:i + 1].view(np.uint8)
    return raw


def q6_bound(raw: np.ndarray) -> np.ndarray:
    """Per group of 32: the larger sub-block's step |d * sc| / 4 (the 8-bit grid's step S)."""
    _, s = q6_k_values(raw.reshape(-1, LAYOUTS["Q6_K"].block_bytes))
    return np.abs(s).reshape(-1, 2).max(axis=1) / 4


def test_layouts_agree_with_the_header_reader():
    for kind, lay in LAYOUTS.items():
        t = next(t for t in GGML_TYPES.values() if t.name == kind)
        assert (lay.block, lay.block_bytes, lay.bits) == (t.block, t.nbytes, REPACKED_BITS[kind])


# Q5_0's bias -16 d is a float16 as mx.load makes Q4_0's -8 d: from |d| = 4096 it is infinite (real
# weights' d are ~1e-3..1e-1); the K-quants' float32 numbers take any finite float16
finite_halves = st.lists(st.floats(-4094, 4094, width=16, allow_nan=False, allow_infinity=False),
                         min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(LAYOUTS)), n=st.integers(1, 4), data=st.data(), halves=finite_halves)
def test_random_blocks_dequantise_as_llama_cpp_does(kind, n, data, halves):
    """Any bytes with finite float16 fields are valid blocks: the MLX layout stands for exactly the
    reference's values (Q4_K, Q5_K, Q5_0, Q5_1), or within half the 8-bit grid's step (Q6_K; a
    whole step where two opposite sub-blocks need 257 levels)."""
    lay = LAYOUTS[kind]
    rows = 2
    nbytes = rows * n * lay.block_bytes * (256 // lay.block if lay.block == 32 else 1)
    raw = blocks_from(kind, data.draw(st.binary(min_size=nbytes, max_size=nbytes)), halves)
    want = reference(kind, raw, rows)
    got = dequantize(kind, raw, rows)
    if lay.exact:
        np.testing.assert_array_equal(got, want)
    else:
        err = np.abs(got - want).reshape(-1, 32).max(axis=1)
        step = q6_bound(raw)
        assert np.all(err <= step * (1 + 1e-5) + 1e-6 * np.abs(want).reshape(-1, 32).max(axis=1))


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_mlx_reads_the_packed_words_as_the_numpy_values(kind):
    """The bytes handed to MLX (packed words, scales, biases) multiply in MLX's quantized_matmul
    (float32 activations) as the numpy model of the layout says: the bit order of 5-bit words,
    the dtypes of the scales (float16 ones are widened, not rounding the products to float16)."""
    rng = np.random.default_rng(3)
    lay = LAYOUTS[kind]
    rows = 3
    raw = blocks_from(kind, rng.integers(0, 256, rows * 8 * lay.block_bytes * (256 // lay.block // 8 or 1),
                                         dtype=np.uint8).tobytes(), list(rng.normal(0, 0.02, 8)))
    packed, scales, biases = affine_blocks(kind, raw, rows)
    w = mx.array(np.ascontiguousarray(packed).view(np.uint32))
    x = rng.normal(0, 1, (2, packed.shape[1] * 8 // lay.bits)).astype(np.float32)
    got = mx.quantized_matmul(mx.array(x), w, mx.array(scales), mx.array(biases), transpose=True, group_size=32,
                              bits=lay.bits)
    want = x.astype(np.float64) @ dequantize(kind, raw, rows).T.astype(np.float64)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # and the dequantised weights themselves, with the scales in float32
    dq = mx.dequantize(w, mx.array(scales.astype(np.float32)), mx.array(biases.astype(np.float32)), group_size=32,
                       bits=lay.bits)
    np.testing.assert_array_equal(np.array(dq), dequantize(kind, raw, rows))


def test_q6_k_requantisation_costs_little_next_to_q6_ks_own_rounding():
    """The measured cost of Q6_K's 8-bit layout on Gaussian weights: the added error is a small
    fraction of what quantising to Q6_K already cost (rms; measured: 0.20), the larger-scale half
    of every group is exact, and no value is off by more than one step of the grid (half a step but for the
    rare groups whose two sub-blocks need 257 levels)."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.05, (64, 1024)).astype(np.float32)
    from chatapp.model.gguf_writer import tensor_bytes

    raw, values = tensor_bytes(x, Q6_K)
    raw = np.frombuffer(raw, np.uint8)
    ours = dequantize("Q6_K", raw, 64)
    np.testing.assert_array_equal(reference("Q6_K", raw, 64), values)
    added = np.sqrt(np.mean((ours - values) ** 2))
    own = np.sqrt(np.mean((values - x) ** 2))
    assert 0 < added < 0.35 * own
    # the larger-scale half: exact up to float32's rounding of S * k + bias (k < 256)
    err = np.abs(ours - values).reshape(-1, 2, 16).max(axis=2)
    step = q6_bound(raw)
    assert np.all(err.min(axis=1) <= 256 * step * 2.0**-23)
    # half a step, except where two sub-blocks of opposite signs need 257 levels (then one step)
    assert np.all(err.max(axis=1) <= step * (1 + 1e-5))
    assert np.mean(err.max(axis=1) > step / 2 * (1 + 1e-5)) < 0.01


def _numpy_q6_k(b: np.ndarray):
    """The numpy regrouping that gguf_kquants._q6_k ran before kernels/q6k_groups.py."""
    q, s = q6_k_values(b)
    q = q.reshape(-1, 2, 16).astype(np.float32)
    s = s.reshape(-1, 2)
    big = np.abs(s).argmax(axis=1)
    s_big = np.take_along_axis(s, big[:, None], 1)[:, 0]
    step = np.abs(s_big) / 4
    safe = np.where(step == 0, 1, step)
    t = np.rint(q * (s / safe[:, None])[:, :, None])
    lo, hi = t.min(axis=(1, 2)), t.max(axis=(1, 2))
    off = np.clip(128, -lo, 255 - hi)
    off = np.where(hi - lo > 255, -lo, off)
    k = np.clip(t + off[:, None, None], 0, 255).astype(np.uint8).reshape(-1, 256)
    groups = step.reshape(-1, 8)
    return k, groups, (-off.reshape(-1, 8) * groups).astype(np.float32)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=210 * 3, max_size=210 * 3),
       d=st.lists(st.sampled_from([0.0, 1e-3, -2e-2, 0.5, 3.0, -7e-5]), min_size=3, max_size=3),
       ties=st.booleans())
def test_native_q6_k_regrouping_is_the_numpy_one_bit_for_bit(data, d, ties):
    """Random Q6_K blocks (scales of both signs, zero, equal magnitudes): the same bytes, scales
    and biases as the numpy version, whose error the tests above bound."""
    from chatapp.model.gguf_kquants import _q6_k

    raw = blocks_from("Q6_K", data, d)
    if ties:  # equal |sc| in each pair, opposite signs: the first must win, as argmax's
        sc = raw[:, 192:208].view(np.int8)
        sc[:, 1::2] = -sc[:, 0::2].clip(-127, 127)
    got, want = _q6_k(raw), _numpy_q6_k(raw)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def logits(model) -> np.ndarray:
    return np.array(model(mx.array([[5, 80, 120, 7, 33, 200, 9, 14, 99, 3]])).astype(mx.float32))


@pytest.fixture(scope="module")
def wide():
    return random_llama(seed=4, shape=WIDE)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_models_of_each_type_load_packed_and_compute_what_the_file_stands_for(wide, kind, tmp_path):
    pytest.importorskip("numba")
    path = tmp_path / f"{kind}.gguf"
    # a float32 embedding keeps the activations float32 (a Q8_0 one's float16 scales make them float16)
    values = write_model_gguf(path, wide, matrices=TYPE_IDS[kind], embedding=F32, meta=metadata(shape=WIDE))
    g = load_gguf(path)
    lay = LAYOUTS[kind]
    for proj in (g.model.model.layers[0].self_attn.q_proj, g.model.model.layers[1].mlp.down_proj):
        assert isinstance(proj, nn.QuantizedLinear) and (proj.bits, proj.group_size) == (lay.bits, 32)
        assert proj.weight.dtype == mx.uint32  # packed: no float copy
        assert proj.scales.dtype == (mx.float16 if lay.scale_dtype is np.float16 else mx.float32)
    dense = random_llama(seed=4, shape=WIDE)
    dense.update(tree_unflatten([(k, mx.array(v)) for k, v in values.items()]))
    got, want = logits(g.model), logits(dense)
    if lay.exact:
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    else:  # the requantisation costs less than a third of what Q6_K itself did to the logits
        assert np.abs(got - want).max() < np.abs(want - logits(wide)).max() / 3
    assert f"{kind} -> {lay.describe()}" in g.notes[1]
    assert (f"{kind} -> {lay.describe()}, exact" in g.notes[1]) == lay.exact
    assert ("not exact" in lay.describe()) != lay.exact


def test_a_row_that_is_not_whole_super_blocks_is_refused_in_one_line(tmp_path):
    path = tmp_path / "bad.gguf"
    shape = (64, 259)  # 64 values a row: not a Q4_K super-block of 256
    write_gguf(path, metadata(), [("token_embd.weight", shape, Q4_K)], [bytes(259 // 4 * 144)])
    with pytest.raises(GGUFError) as err:
        load_gguf(path)
    assert "Q4_K blocks of 256 values a row" in str(err.value) and "\n" not in str(err.value)


def test_iq_types_are_refused_naming_the_type_and_what_is_read(tmp_path):
    path = tmp_path / "iq.gguf"
    write_gguf(path, metadata(), [("token_embd.weight", (256, 259), 23)], [bytes(259 * 136)])  # IQ4_XS
    with pytest.raises(GGUFError) as err:
        load_gguf(path)
    msg = str(err.value)
    assert "IQ4_XS (1 tensors)" in msg and "Q4_K" in msg and "Q6_K" in msg and "\n" not in msg


def test_a_truncated_k_quant_tensor_is_refused(wide, tmp_path):
    path = tmp_path / "k.gguf"
    write_model_gguf(path, wide, matrices=Q4_K, embedding=Q8_0, meta=metadata(shape=WIDE))
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError) as err:
        load_gguf(tmp_path / "cut.gguf")
    assert "is truncated" in str(err.value) and "\n" not in str(err.value)


def test_the_writers_k_quant_blocks_are_what_llama_cpp_reads():
    rng = np.random.default_rng(5)
    x = rng.normal(0, 0.2, (8, 512)).astype(np.float32)
    from chatapp.model.gguf_writer import tensor_bytes

    for kind, tid in TYPE_IDS.items():
        raw, values = tensor_bytes(x, tid)
        np.testing.assert_array_equal(reference(kind, np.frombuffer(raw, np.uint8), 8), values, err_msg=kind)
        assert np.abs(values - x).max() < 0.25 * np.abs(x).max(), kind
