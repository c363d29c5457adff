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
from chatapp.backend.fused_install import fused_decoder  # noqa: E402
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


def _quantised_head_rows(rng, H, cap, n, D, bits, group, half, magnitude):
    """Flat quantised buffers of H heads of ``cap`` rows, the first n filled by mx.quantize of
    random rows (the rest garbage bytes, which no kernel may read or write)."""
    from chatapp.backend.kv_native import _flat

    dtype = mx.float16 if half else mx.float32
    rows = mx.array((rng.standard_normal((1, H, cap, D)) * magnitude).astype(np.float32)).astype(dtype)
    arrays = mx.quantize(rows, group_size=group, bits=bits)
    bufs = [np.array(_flat(a)[0]) for a in arrays]
    fill = rng.integers(0, 256, bufs[0].size, dtype=np.uint8).reshape(H, -1)
    bufs[0].reshape(H, -1)[:, n * D * bits // 8:] = fill[:, n * D * bits // 8:]
    strides = (cap * D * bits // 8, cap * D // group)
    return bufs, strides


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64, 128]), D=st.sampled_from([64, 128]),
       half=st.booleans(), traditional=st.booleans(), H=st.integers(1, 3), n=st.integers(1, 300),
       dropped=st.integers(1, 40), magnitude=st.sampled_from([0.02, 1.0, 40.0]), threads=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_move_keys_equals_the_scalar_reference(bits, group, D, half, traditional, H, n, dropped, magnitude, threads,
                                               seed):
    """The vector, pooled move_keys leaves the packed bytes, scales and biases of every head
    exactly as the row-by-row kernel it replaced (tests/kv_rows_reference.py), over middles long
    enough for several chunks a head, evictions anywhere in the middle, both RoPE pairings and
    thread counts: rows before the first evicted one untouched, rows past the kept ones as they
    were."""
    from chatapp.backend.kv_native import NativeRowOps
    from chatapp.kernels import kv_rows
    from chatapp.kernels.pool import WorkPool
    from tests import kv_rows_reference as ref

    group = min(group, D)
    rng = np.random.default_rng(seed)
    (p, sc, bi), (ps, ss) = _quantised_head_rows(rng, H, n + 5, n, D, bits, group, half, magnitude)
    gone = np.sort(rng.choice(n, size=min(dropped, n - 1), replace=False)) if n > 1 else np.array([], int)
    kept = np.ones(n, bool)
    kept[gone] = False
    keep = np.flatnonzero(kept)
    deltas = -np.cumsum(~kept)[keep]
    first = int(gone[0]) if len(gone) else n
    ops = NativeRowOps((1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32), traditional)
    cos, sin = ops._shift_table(deltas)
    want = [a.copy() for a in (p, sc, bi)]
    ref.move_keys(*want, H, ps, ss, keep, deltas, first, D, bits, group, cos, sin, traditional)
    pool = WorkPool(threads)
    try:
        kv_rows.move_keys(p, sc, bi, H, ps, ss, keep, deltas, first, D, bits, group, cos, sin, traditional,
                          threads=pool)
    finally:
        pool.close()
    for got, expect in zip((p, sc, bi), want):
        assert np.array_equal(got, expect)


def test_move_keys_runs_in_chunks_across_heads(monkeypatch):
    """With chunks of 16 rows, 3 heads of 100 moved rows are 21 chunks claimed by 3 threads, the
    last chunk of each head a partial one: each chunk's rows land where the reference puts them,
    in the right head."""
    from chatapp.backend.kv_native import NativeRowOps
    from chatapp.kernels import kv_rows
    from chatapp.kernels.pool import WorkPool
    from tests import kv_rows_reference as ref

    monkeypatch.setattr(kv_rows, "MOVE_CHUNK", 16)
    rng = np.random.default_rng(7)
    H, n, D, bits, group = 3, 160, 64, 8, 32
    (p, sc, bi), (ps, ss) = _quantised_head_rows(rng, H, n, n, D, bits, group, True, 1.0)
    keep = np.sort(rng.choice(n, size=110, replace=False))
    keep[:10] = np.arange(10)
    keep.sort()
    deltas = np.arange(len(keep)) - keep  # each kept row moves back by the rows dropped before it
    first = int(np.flatnonzero(keep != np.arange(len(keep)))[0])
    cos, sin = NativeRowOps(np.linspace(1, 1e-3, D // 2).astype(np.float32), False)._shift_table(deltas)
    want = [a.copy() for a in (p, sc, bi)]
    ref.move_keys(*want, H, ps, ss, keep, deltas, first, D, bits, group, cos, sin, False)
    pool = WorkPool(3)
    try:
        kv_rows.move_keys(p, sc, bi, H, ps, ss, keep, deltas, first, D, bits, group, cos, sin, False, threads=pool)
    finally:
        pool.close()
    assert all(np.array_equal(a, b) for a, b in zip((p, sc, bi), want))


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([32, 64]), half=st.booleans(), turn=st.booleans(),
       traditional=st.booleans(), H=st.integers(1, 3), n=st.integers(1, 40), start=st.integers(0, 5),
       row=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_flush_rows_equals_the_scalar_reference(bits, group, half, turn, traditional, H, n, start, row, seed):
    """flush_rows (a head's rows loaded, turned and quantised as one block) writes what the
    row-by-row kernel wrote, and nothing outside rows row .. row + n - 1."""
    from chatapp.kernels.decode_step import rope_angles
    from chatapp.kernels.kv_rows import flush_rows
    from tests import kv_rows_reference as ref

    D, cap = 64, start + n + 3
    rng = np.random.default_rng(seed)
    src = (rng.standard_normal((H, cap, D)) * 3).astype(np.float16 if half else np.float32)
    src = src.view(np.uint16).reshape(-1) if half else src.reshape(-1)
    q_cap = row + n + 2
    P, ng = D * bits // 8, D // group
    sdt = np.uint16 if half else np.float32
    bufs = [rng.integers(0, 256, H * q_cap * P, dtype=np.uint8)]
    bufs += [rng.integers(0, 2**15, H * q_cap * ng).astype(sdt) for _ in range(2)]
    want = [a.copy() for a in bufs]
    cos, sin = rope_angles(5, np.linspace(1, 1e-3, D // 2).astype(np.float32))
    args = (H, cap * D, start, n, D, turn, cos, sin, traditional)
    ref.flush_rows(src, *args, want[0], q_cap * P, want[1], want[2], q_cap * ng, row, bits, group)
    flush_rows(src, *args, bufs[0], q_cap * P, bufs[1], bufs[2], q_cap * ng, row, bits, group)
    for got, expect in zip(bufs, want):
        assert np.array_equal(got, expect)


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("n_mid", [0, 37])
def test_held_keys_equal_the_keys_as_built_before(half, n_mid):
    """held_keys (sinks | middle dequantised in place | recent) equals the copy-by-copy build
    the votes used before."""
    from chatapp.kernels.kv_rows import held_keys
    from tests import kv_rows_reference as ref

    rng = np.random.default_rng(11)
    H, D, cap, n_full, sinks, bits, group = 2, 64, 50, 41, 4, 4, 32
    buf = rng.standard_normal(H * cap * D).astype(np.float16 if half else np.float32)
    buf = buf.view(np.uint16) if half else buf
    (p, sc, bi), (ps, ss) = _quantised_head_rows(rng, H, max(n_mid, 1) + 2, n_mid, D, bits, group, half, 2.0)
    for h in range(H):
        want = np.full((n_full + n_mid) * D, np.nan, np.float32)
        got = want.copy()
        args = (buf, h * cap * D, n_full, sinks, D, p, sc, bi, h * ps, h * ss, n_mid, bits, group)
        ref.held_keys(*args, want)
        held_keys(*args, got)
        assert np.array_equal(got, want)
