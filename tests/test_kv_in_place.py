"""The fused decode step writes its new K/V rows into the cache buffers in place: the caches
it leaves equal those of the update_and_fetch route, and nothing handed out of them (state,
snapshots, views) ever changes, through trims and further steps."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cache import CacheSettings, make_caches  # noqa: E402
from cache.buffers import FullBuffer  # noqa: E402
from cache.kv import SegmentedKVCache  # noqa: E402
from chatapp.backend.fused_decode import FusedDecoder  # noqa: E402
from tests.fused_llama import _no_leftover_kernels, clear_kernels, fused_small_llama  # noqa: E402, F401


@pytest.fixture(scope="module")
def model():
    yield fused_small_llama()
    clear_kernels()


def _row(n: int) -> tuple[mx.array, mx.array]:
    k = mx.full((1, 2, n, 4), 1.0)
    return k, k + 1


@pytest.mark.parametrize("n, cap", [(8, 8), (3, 8), (9, 16)])
def test_reserved_rows_are_two_buffers_of_whole_chunks_and_keep_the_rows_held(n, cap):
    buf = FullBuffer(8, mx.float16)
    z = mx.zeros((1, 2, 1, 4))
    buf.reserve(n, z, z)
    mx.eval(buf.keys, buf.values)
    assert buf.capacity == cap and buf.length == 0 and buf.keys.dtype == mx.float16
    assert not np.shares_memory(np.asarray(buf.keys), np.asarray(buf.values))
    assert buf.writable_in_place(n) and not buf.writable_in_place(cap + 1)
    k, v = _row(cap)
    buf.append(k, v)
    buf.reserve(1, k, v)  # grows past the held rows: they come along
    assert buf.capacity == cap + 8 and buf.length == cap
    got_k, got_v = buf.view()
    assert np.array_equal(np.array(got_k), np.array(k)) and np.array_equal(np.array(got_v), np.array(v))


def test_buffer_rows_handed_out_are_never_writable():
    buf = FullBuffer(step=8)
    assert not buf.writable_in_place(1)  # no buffer yet
    buf.append(*_row(3))
    assert buf.writable_in_place(5) and not buf.writable_in_place(6)  # capacity 8
    buf.view()  # rows [0, 3) handed out
    assert buf.writable_in_place(1)
    buf.wrote_in_place(2)
    assert buf.length == 5 and buf.view()[0].shape[2] == 5
    buf.trim(2)  # rows 3, 4 were handed out by the last view
    assert not buf.writable_in_place(1)
    with pytest.raises(ValueError):
        buf.wrote_in_place(1)
    buf.append(*_row(1))  # through MLX: new (or unshared) buffers
    assert buf.writable_in_place(1)
    buf.view(0, 7)  # a partial view past the rows held counts too
    assert not buf.writable_in_place(1)


def test_rows_written_in_place_wait_for_the_policy_maintenance(model):
    """A native step settles a cache before writing into it: rows counted while an eviction or
    a quantisation is due would land past what the policy keeps."""
    cache = make_caches(model, CacheSettings(mode="window", sinks=1, window=4, evict_chunk=1))[0]
    cache.absorb(*[mx.zeros((1, 2, 6, 32))] * 2)  # past sinks + window: eviction due
    with pytest.raises(ValueError, match="settle"):
        cache.wrote_in_place(1)
    cache.settle()
    assert cache.full.length == 5 and cache.full.writable_in_place(1)
    cache.wrote_in_place(1)
    assert cache.full.length == 6 and cache.offset == 5  # the next read evicts again


def _run(model, prompt, ops, in_place: bool):
    """Prefill ``prompt``, then ``ops`` (("step", token) / ("trim", n) / ("snap",)); returns the
    logits of each step, the caches and the snapshots taken (each: its lazy state arrays and
    the values they held when taken)."""
    dec: FusedDecoder = model._chatapp_fused
    dec.write_in_place = in_place
    try:
        caches = make_caches(model, CacheSettings(mode="prealloc"))
        model(mx.array([prompt]), cache=caches)
        logits, snaps = [], []
        for op in ops:
            if op[0] == "step":
                logits.append(np.array(model(mx.array([[op[1]]]), cache=caches)[0, -1]))
            elif op[0] == "trim":
                for c in caches:
                    c.trim(min(op[1], c.offset - 1))
            else:
                states = [c.state for c in caches]
                snaps.append((states, [[np.array(a) for a in s] for s in states]))
        return logits, caches, snaps
    finally:
        dec.write_in_place = True


_OPS = st.lists(st.one_of(st.tuples(st.just("step"), st.integers(0, 255)),
                          st.tuples(st.just("trim"), st.integers(1, 6)), st.tuples(st.just("snap"))),
                min_size=1, max_size=40)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt_len=st.one_of(st.integers(2, 20), st.integers(240, 255)), ops=_OPS)
def test_in_place_rows_equal_update_and_fetch_and_snapshots_never_change(model, prompt_len, ops):
    """Any sequence of steps, trims and snapshots (prompts near 256: the buffers grow mid-way):
    the same logits and cached rows, bit for bit, as the route that appends every row through
    update_and_fetch, and every snapshot still holds what it held when taken."""
    prompt = list(range(1, prompt_len + 1))
    ref_logits, ref_caches, _ = _run(model, prompt, ops, in_place=False)
    logits, caches, snaps = _run(model, prompt, ops, in_place=True)
    assert len(logits) == len(ref_logits)
    for a, b in zip(logits, ref_logits):
        np.testing.assert_array_equal(a, b)
    for c, r in zip(caches, ref_caches):
        assert c.offset == r.offset
        for a, b in zip(c.state, r.state):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    for states, values in snaps:
        for s, v in zip(states, values):
            for a, b in zip(s, v):
                np.testing.assert_array_equal(np.array(a), b)


def test_steps_write_in_place_without_mlx_appends(model, monkeypatch):
    """After the prefill, decode steps add their rows without update_and_fetch (the in-place
    route is the one taken), and the buffers stay the same arrays between steps."""
    caches = make_caches(model, CacheSettings(mode="prealloc"))
    model(mx.array([[1, 2, 3]]), cache=caches)
    calls = []
    real = SegmentedKVCache.absorb
    monkeypatch.setattr(SegmentedKVCache, "absorb", lambda self, k, v: calls.append(1) or real(self, k, v))
    for t in (4, 5, 6):
        model(mx.array([[t]]), cache=caches)
    assert not calls and caches[0].offset == 6
    # a trim below rows handed out appends the next row through MLX, then in place again
    held = [c.state for c in caches]  # noqa: F841 - a snapshot of every layer
    for c in caches:
        c.trim(2)
    model(mx.array([[7]]), cache=caches)
    assert len(calls) == len(caches)
    model(mx.array([[8]]), cache=caches)
    assert len(calls) == len(caches) and caches[0].offset == 6
