"""Cache maintenance in place (backend/kv_native.py, kernels/kv_rows.py): the quantiser equals
``mx.quantize`` bit for bit; a fused model's flushes, evictions and re-rotations run on the host
views and leave what the MLX route leaves; rows a snapshot holds are never changed under it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cache import CacheSettings, make_caches  # noqa: E402
from chatapp.backend.fused_decode import fused_decoder  # noqa: E402
from chatapp.kernels.kv_rows import quantize_rows, shift_rows  # noqa: E402
from tests.test_fused_policies import _close, _content, _pair, _Run  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]), half=st.booleans(),
       rows=st.integers(1, 9), magnitude=st.sampled_from([1e-4, 0.02, 1.0, 40.0, 3e3]),
       shape=st.sampled_from(["normal", "positive", "negative", "constant", "zero_group"]),
       seed=st.integers(0, 2**31 - 1))
def test_quantize_rows_equals_mx_quantize(bits, group, half, rows, magnitude, shape, seed):
    D = 128
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, D)) * magnitude
    if shape == "positive":
        x = np.abs(x)
    elif shape == "negative":
        x = -np.abs(x)
    elif shape == "constant":
        x[:] = x[0, 0]
    elif shape == "zero_group":
        x[:, :group] = 0.0
    dtype = np.float16 if half else np.float32
    x = x.astype(dtype)
    want = [np.asarray(a) for a in mx.quantize(mx.array(x), group_size=group, bits=bits)]
    packed = np.empty(rows * D * bits // 8, np.uint8)
    scales = np.empty(rows * D // group, np.uint16 if half else np.float32)
    biases = np.empty_like(scales)
    quantize_rows(x.astype(np.float32).reshape(-1), rows, D, bits, group, packed, scales, biases)
    assert np.array_equal(packed, want[0].view(np.uint8).reshape(-1))
    view = (lambda a: a.view(np.uint16)) if half else (lambda a: a)
    assert np.array_equal(scales, view(want[1]).reshape(-1))
    assert np.array_equal(biases, view(want[2]).reshape(-1))


@settings(max_examples=40, deadline=None)
@given(start=st.integers(0, 6), n=st.integers(1, 12), tail=st.integers(0, 30), heads=st.integers(1, 3))
def test_shift_rows_moves_the_tail_back_in_every_head(start, n, tail, heads):
    W, cap = 5, start + n + tail + 3
    a = np.arange(heads * cap * W, dtype=np.float32).reshape(heads, cap, W)
    want = a.copy()
    want[:, start:start + tail] = a[:, start + n:start + n + tail]
    shift_rows(a.reshape(-1), heads, cap * W, start, n, start + n + tail, W)
    assert np.array_equal(a, want)


def _settings(mode: str, bits: int = 8) -> CacheSettings:
    return CacheSettings(mode=mode, sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16,
                         kv_bits=bits, kv_group_size=32)


IN_PLACE = {"window-quant": {"flush", "remove_front", "rotate"}, "window": {"remove", "rotate"},
            "scored-quant": {"flush", "votes", "select", "rotate"}, "scored": {"votes", "select_full"}}


@pytest.mark.parametrize("mode,bits", [("window-quant", 8), ("window-quant", 4), ("window", 8), ("scored-quant", 8),
                                       ("scored-quant", 4), ("scored", 8)])
def test_maintenance_runs_in_place_and_leaves_what_mlx_leaves(mode, bits):
    """Past several flushes and evictions, every operation ran on the host views (none declined),
    the buffers kept their arrays between growths, and the caches hold what MLX's route holds."""
    ref, fast = _pair()
    runs = [_Run(ref, _settings(mode, bits)), _Run(fast, _settings(mode, bits))]
    ops = fused_decoder(fast).row_ops
    rng = np.random.default_rng(3)
    for r in runs:
        r.prefill(list(range(1, 13)))
    for t in rng.integers(0, 200, 90):
        outs = [r.step(int(t)) for r in runs]
        assert _close(outs[1], outs[0], 5e-3 if bits == 8 else 3e-2)
    assert runs[1].caches[0].evicted > 16
    assert IN_PLACE[mode] <= set(ops.done)
    assert not ops.declined
    assert [c.evicted for c in runs[0].caches] == [c.evicted for c in runs[1].caches]
    (k0, v0), (k1, v1) = (_content(r.caches) for r in runs)
    step = 2.0 / (2 ** bits - 1) if "quant" in mode else 0.0
    assert _close(k1, k0, step + 1e-4) and _close(v1, v0, step + 1e-4)


def test_a_snapshot_keeps_its_rows_while_the_cache_goes_on():
    """State handed out (a snapshot) covers the rows it holds: maintenance after it declines those
    rows to MLX, which copies, so the saved arrays never change."""
    _, fast = _pair()
    run = _Run(fast, _settings("window-quant"))
    run.prefill(list(range(1, 13)))
    for t in range(40):
        run.step(t)
    states = [c.state for c in run.caches]
    mx.eval(states)
    saved = [[np.array(a) for a in s] for s in states]
    for t in range(60):
        run.step(t)
    assert run.caches[0].evicted
    assert fused_decoder(fast).row_ops.declined
    for s, kept in zip(states, saved):
        for a, b in zip(s, kept):
            assert np.array_equal(np.array(a), b)


def test_caches_without_a_native_step_keep_mlx_maintenance():
    ref, _ = _pair()
    caches = make_caches(ref, _settings("window-quant"))
    assert all(c.native is None for c in caches)


def test_scales_read_as_float32_copies_are_read_again_after_maintenance(monkeypatch):
    """Where the CPU lacks F16C the fused step reads float16 scales through float32 copies
    (kv_native.host_scales): maintenance in place must make it take them afresh. The same float16
    cache with and without native half scales gives the same logits past flushes and evictions."""
    import chatapp.kernels as kernels
    from chatapp.backend.cpu import apply_fast_path
    from tests.fused_llama import small_llama

    outs = []
    for native in (True, False):
        monkeypatch.setattr(kernels, "half_scales_native", lambda native=native: native)
        model = small_llama()
        apply_fast_path(model, backend="cpu", warm_up=False, kv_dtype="float16")
        run = _Run(model, _settings("window-quant"))
        run.prefill(list(range(1, 13)))
        outs.append([run.step(int(t)) for t in np.random.default_rng(4).integers(0, 200, 70)])
        assert run.caches[0].evicted and not fused_decoder(model).row_ops.declined
        assert run.caches[0].quant.keys[1].dtype == mx.float16
    for a, b in zip(*outs):
        assert np.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_a_middle_numpy_cannot_view_goes_through_mlx():
    """bfloat16 scales (a middle quantised on MLX's route from bfloat16 rows) have no numpy
    type: the operations decline, and the cache's own MLX maintenance runs."""
    from cache.buffers import FullBuffer, QuantBuffer
    from chatapp.backend.kv_native import NativeRowOps

    ops = NativeRowOps(np.ones(8, np.float32), False)
    full = FullBuffer(16, dtype=mx.float16)
    rows = mx.array(np.random.default_rng(0).standard_normal((1, 2, 40, 32)).astype(np.float16))
    full.append(rows, rows)
    mx.eval(full.keys, full.values)
    full.pinned = (np.asarray(full.keys), np.asarray(full.values))
    quant = QuantBuffer(16, 8, 32)
    quant.append(rows[:, :, :8].astype(mx.bfloat16), rows[:, :, :8].astype(mx.bfloat16))
    quant.shared = 0
    assert quant.keys[1].dtype == mx.bfloat16
    assert not ops.flush(full, quant, 0, 8, 0)
    assert not ops.remove_front(quant, 4)
    assert ops.keys(full, quant, 0) is None
    assert full.length == 40 and quant.length == 8 and ops.declined == {"flush": 1, "remove_front": 1}
