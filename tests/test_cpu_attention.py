"""The CPU prefill attention kernel: equal to MLX's SDPA for every shape the models produce, used
for prefill only, and installed by the engine only on the CPU backend."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache import CacheSettings, make_caches
from cache.attention import attend_full, causal_mask, prefill_kernel, set_prefill_kernel
from chatapp.backend import cpu_attention
from chatapp.backend.cpu_attention import install_prefill_attention, numpy_prefill_attention
from tests.conftest import tiny_llama


def _qkv(B, H, KVH, L, N, D, Dv=None, dtype=mx.float32, seed=0):
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((B, H, L, D), key=k1).astype(dtype)
    k = mx.random.normal((B, KVH, N, D), key=k2).astype(dtype)
    v = mx.random.normal((B, KVH, N, Dv or D), key=k3).astype(dtype)
    return q, k, v


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), kvh=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2, 4]),
       L=st.integers(2, 40), extra=st.integers(0, 300), D=st.sampled_from([8, 16, 64]),
       causal=st.booleans(), seed=st.integers(0, 10_000))
def test_kernel_equals_mlx_sdpa(B, kvh, groups, L, extra, D, causal, seed):
    N = L + extra
    q, k, v = _qkv(B, kvh * groups, kvh, L, N, D, seed=seed)
    scale = D**-0.5
    mask = "causal" if causal else None
    got = numpy_prefill_attention(q, k, v, scale, mask)
    # the reference uses an explicit mask, so it also checks where "causal" puts the queries
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=causal_mask(L, N) if causal else None)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-4).item()


def test_query_blocks_give_the_same_result(monkeypatch):
    q, k, v = _qkv(1, 8, 2, 100, 700, 16, Dv=32)
    whole = numpy_prefill_attention(q, k, v, 0.25, "causal")
    monkeypatch.setattr(cpu_attention, "MAX_SCORE_BYTES", 8 * 700 * 4 * 7)  # 7 queries per block
    blocked = numpy_prefill_attention(q, k, v, 0.25, "causal")
    assert mx.array_equal(whole, blocked).item() or mx.allclose(whole, blocked, atol=1e-6).item()
    assert whole.shape == (1, 8, 100, 32)


@pytest.mark.parametrize("size", [0.01, 1.0, 30.0, 300.0])
def test_large_and_small_scores_stay_exact(size):
    # beyond +-80 the kernel subtracts each row's max before exp; below it, it does not need to
    q, k, v = _qkv(1, 4, 2, 16, 200, 16, seed=3)
    q = q * size
    got = numpy_prefill_attention(q, k, v, 1.0, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=causal_mask(16, 200))
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_half_precision_inputs_and_strided_cache_views():
    q, k, v = _qkv(1, 4, 2, 12, 64, 32, dtype=mx.bfloat16)
    kb = mx.concatenate([k, mx.zeros_like(k)], axis=2)  # a buffer with spare capacity, as caches hold
    vb = mx.concatenate([v, mx.zeros_like(v)], axis=2)
    got = numpy_prefill_attention(q, kb[:, :, :64], vb[:, :, :64], 32**-0.5, "causal")
    want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                                                scale=32**-0.5, mask=causal_mask(12, 64))
    assert got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), want, atol=2e-2).item()


def test_explicit_mask_arrays_are_left_to_mlx():
    q, k, v = _qkv(1, 2, 2, 4, 10, 8)
    assert numpy_prefill_attention(q, k, v, 1.0, causal_mask(4, 10)) is None
    set_prefill_kernel(numpy_prefill_attention)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=causal_mask(4, 10))
    assert mx.allclose(attend_full(q, k, v, 1.0, causal_mask(4, 10)), want).item()


def test_decode_steps_never_reach_the_kernel():
    calls = []
    set_prefill_kernel(lambda *a: calls.append(a[0].shape) or None)
    q, k, v = _qkv(1, 2, 2, 1, 10, 8)
    attend_full(q, k, v, 1.0, None)
    assert calls == []
    q, k, v = _qkv(1, 2, 2, 3, 10, 8)
    attend_full(q, k, v, 1.0, "causal")
    assert calls == [(1, 2, 3, 8)]


MODE_SETTINGS = {
    "prealloc": CacheSettings(mode="prealloc"),
    "window": CacheSettings(mode="window", window=256, sinks=4, evict_chunk=64),
    # quantised history: the kernel gets it dequantised (and re-rotated, for window-quant)
    "quantized": CacheSettings(mode="quantized", quant_start=64, evict_chunk=64, kv_bits=8),
    "window-quant": CacheSettings(mode="window-quant", window=64, sinks=4, evict_chunk=64, kv_bits=4,
                                  max_kv_tokens=256),
}


@pytest.mark.parametrize("mode", list(MODE_SETTINGS))
def test_model_logits_with_the_kernel_match_mlx_attention(mode):
    model = tiny_llama(layers=2, head_dim=64, kv_heads=2, heads=8)
    tokens = mx.array(np.random.default_rng(0).integers(0, 200, size=(1, 300)))
    settings = MODE_SETTINGS[mode]

    def run() -> list[mx.array]:
        caches = make_caches(model, settings)
        outs = []
        for a, b in ((0, 130), (130, 131), (131, 250), (250, 300)):  # prefill chunks and a decode step
            outs.append(model(tokens[:, a:b], cache=caches)[:, -1])
            if a == 131 and "quant" in mode:  # the next chunk attends over a quantised history
                assert caches[0].usage().quant_tokens > 0
        mx.eval(outs)
        return outs

    ref = run()
    seen = []

    def counting(*args):
        seen.append(args[0].shape[2])
        return numpy_prefill_attention(*args)

    set_prefill_kernel(counting)
    got = run()
    assert seen and all(n > 1 for n in seen)  # the kernel served every prefill chunk, no decode step
    for a, b in zip(ref, got):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_install_only_on_the_cpu_backend():
    assert "MLX SDPA" in install_prefill_attention("metal") and prefill_kernel() is None
    assert "numpy" in install_prefill_attention("cpu") and prefill_kernel() is numpy_prefill_attention
    assert "false" in install_prefill_attention("cpu", enabled=False) and prefill_kernel() is None


def test_the_kernel_runs_numpy_blas_on_one_thread(monkeypatch):
    from chatapp.backend.numpy_blas import numpy_blas

    blas = numpy_blas()
    if not blas.found:
        pytest.skip("this numpy wheel bundles no OpenBLAS")
    seen = []
    real = np.matmul
    monkeypatch.setattr(cpu_attention.np, "matmul", lambda *a, **k: seen.append(blas.threads()) or real(*a, **k))
    before = blas.threads()
    blas.set_threads(2)
    try:
        q, k, v = _qkv(1, 4, 2, 8, 40, 16)
        numpy_prefill_attention(q, k, v, 0.25, "causal")
        assert seen and set(seen) == {1}
        assert blas.threads() == 2  # restored afterwards
    finally:
        blas.set_threads(before)
