"""mlx-lm 0.32's cache protocol on chatapp's caches: keys_and_values / keys / values, merge,
to_quantized, from_state, and mlx-lm's save_prompt_cache / load_prompt_cache round trip."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
import pytest
from mlx_lm.models.cache import BatchKVCache, load_prompt_cache, save_prompt_cache

from cache import CACHE_CLASSES, CacheSettings
from cache.kv import QuantStartKVCache

SETTINGS = CacheSettings(quant_start=8, evict_chunk=8, kv_group_size=32, kv_bits=4)


def filled(mode: str, n: int = 40):
    c = CACHE_CLASSES[mode](SETTINGS.with_(mode=mode))
    k = mx.random.normal((1, 2, n, 32), key=mx.random.key(1))
    v = mx.random.normal((1, 2, n, 32), key=mx.random.key(2))
    c.update_and_fetch(k, v)
    c.offset  # noqa: B018 - settle the policy (quantise)
    return c, k, v


def test_no_chatapp_cache_class_shares_a_name_with_one_of_mlx_lms():
    for cls in CACHE_CLASSES.values():
        assert getattr(mlx_cache, cls.__name__) is cls  # registered for load_prompt_cache, never shadowing
    assert mlx_cache.QuantizedKVCache is not QuantStartKVCache


@pytest.mark.parametrize("mode", ["concat", "prealloc", "quantized"])
def test_keys_and_values_and_mlx_lm_round_trip(tmp_path, mode):
    c, k, v = filled(mode)
    ck, cv = c.keys_and_values()
    assert ck.shape == k.shape and mx.array_equal(ck, c.keys) and mx.array_equal(cv, c.values)
    if mode != "quantized":
        assert mx.array_equal(ck, k) and mx.array_equal(cv, v)
    else:
        assert c.usage().quant_tokens > 0 and float(mx.abs(ck - k).max()) < 0.5
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [c, c])
    back = load_prompt_cache(path)
    assert [type(b) for b in back] == [type(c)] * 2
    bk, bv = back[0].keys_and_values()
    assert mx.array_equal(bk, ck) and mx.array_equal(bv, cv) and back[0].offset == c.offset
    u, w = back[0].usage(), c.usage()  # what is held (a restore allocates only that)
    assert (u.full_tokens, u.quant_tokens, u.bytes_held) == (w.full_tokens, w.quant_tokens, w.bytes_held)


def test_evicting_modes_refuse_from_state_with_the_reason():
    c, _, _ = filled("window")
    with pytest.raises(NotImplementedError, match="snapshots"):
        type(c).from_state(c.state)


def test_merge_and_to_quantized_give_mlx_lms_caches():
    a, ka, _ = filled("prealloc", 10)
    b, kb, _ = filled("prealloc", 6)
    batch = type(a).merge([a, b])
    assert isinstance(batch, BatchKVCache) and batch.keys.shape[0] == 2
    assert mx.array_equal(batch.keys[1:, :, 4:10], kb)  # left-padded
    q = a.to_quantized(group_size=32, bits=8)
    assert isinstance(q, mlx_cache.QuantizedKVCache) and q.offset == 10
