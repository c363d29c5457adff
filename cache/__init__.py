"""KV cache library for mlx-lm models: pure MLX, no UI, no I/O.

One cache object per layer speaking mlx-lm's cache protocol, in six modes (see settings.py).
"""

from .attention import install_attention, set_decode_kernels, set_prefill_kernel
from .convert import Conversion, convert_caches
from .factory import ModelGeometry, check_settings, make_caches, model_geometry
from .kv import (
    CACHE_CLASSES,
    ConcatKVCache,
    PreallocKVCache,
    QuantizedKVCache,
    SegmentedKVCache,
    WindowKVCache,
    WindowQuantKVCache,
)
from .scored import ScoredKVCache
from .settings import MODES, CacheConfigError, CacheSettings
from .usage import CacheUsage, total_usage

__all__ = [
    "CACHE_CLASSES", "MODES", "CacheConfigError", "CacheSettings", "CacheUsage", "ConcatKVCache",
    "Conversion", "ModelGeometry", "PreallocKVCache", "QuantizedKVCache", "ScoredKVCache", "SegmentedKVCache",
    "WindowKVCache", "WindowQuantKVCache", "check_settings", "convert_caches", "install_attention",
    "make_caches", "model_geometry", "set_decode_kernels", "set_prefill_kernel", "total_usage",
]
