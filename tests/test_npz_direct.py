"""chatapp.model.npz_direct: an uncompressed npz read straight into MLX arrays is mx.load's, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.model.npz_direct import read_npz

DTYPES = (np.float32, np.float16, np.uint32, np.int32, np.uint8, np.int8, np.int64, np.bool_)


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        b = got[name]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        np.testing.assert_array_equal(np.array(b.reshape(-1).view(mx.uint8)), np.array(a.reshape(-1).view(mx.uint8)),
                                      err_msg=name)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 7), min_size=0, max_size=3)),
                min_size=1, max_size=6), st.integers(0, 2**31))
def test_uncompressed_npz_reads_as_mx_load_does(tmp_path_factory, arrays, seed):
    rng = np.random.default_rng(seed)
    values = {f"layers.{i}.w": (rng.standard_normal(shape) * 50).astype(dtype)
              for i, (dtype, shape) in enumerate(arrays)}
    path = tmp_path_factory.mktemp("npz") / "weights.npz"
    np.savez(path, **values)
    _same(read_npz(path), mx.load(str(path)))


def test_large_arrays_cross_read_chunks(tmp_path, monkeypatch):
    import chatapp.model.npz_direct as nd

    monkeypatch.setattr(nd, "_CHUNK", 1000)  # not a multiple of any item size
    values = {"a": np.arange(12345, dtype=np.float32).reshape(15, 823), "b": np.arange(77, dtype=np.float16)}
    np.savez(tmp_path / "w.npz", **values)
    _same(read_npz(tmp_path / "w.npz"), mx.load(str(tmp_path / "w.npz")))


def test_what_it_cannot_read_is_left_to_mx_load(tmp_path):
    np.savez_compressed(tmp_path / "z.npz", a=np.ones(8, np.float32))
    assert read_npz(tmp_path / "z.npz") is None  # compressed members
    np.savez(tmp_path / "f.npz", a=np.asfortranarray(np.ones((3, 4), np.float32)))
    assert read_npz(tmp_path / "f.npz") is None  # Fortran order
    np.savez(tmp_path / "c.npz", a=np.ones(4, np.complex64))
    assert read_npz(tmp_path / "c.npz") is None  # no MLX twin of the dtype here
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    assert read_npz(tmp_path / "bad.npz") is None
