"""KV cache library for mlx-lm models: pure MLX, no UI, no I/O.

One cache object per layer speaking mlx-lm's cache protocol, in six modes (see settings.py).

The names below load lazily (PEP 562): ``import cache.settings`` (the modes and the cache rules,
``CacheSettings.validate``) loads no MLX, so config, UI and CLI can use the one copy of the rules
before the BLAS preload; the first use of a cache class or of the attention patch loads MLX.
"""

from __future__ import annotations

import importlib

# name -> the submodule that defines it
_WHERE = {
    "install_attention": "attention", "set_decode_kernels": "attention", "set_prefill_kernel": "attention",
    "Conversion": "convert", "convert_caches": "convert",
    "ModelGeometry": "factory", "check_settings": "factory", "make_caches": "factory", "model_geometry": "factory",
    "reserve_tokens": "factory",
    # CACHE_CLASSES is kv's dict, but the scored modes add themselves to it when scored.py loads:
    # reading it through scored means every mode of settings.MODES is in it, whoever asks first.
    "CACHE_CLASSES": "scored", "ConcatKVCache": "kv", "PreallocKVCache": "kv", "QuantStartKVCache": "kv",
    "SegmentedKVCache": "kv", "WindowKVCache": "kv", "WindowQuantKVCache": "kv",
    "ScoredKVCache": "scored", "ScoredQuantKVCache": "scored",
    "MODES": "settings", "CacheConfigError": "settings", "CacheSettings": "settings",
    "CacheUsage": "usage", "total_usage": "usage",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
