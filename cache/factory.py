"""Building a model's per-layer caches, checked against the model's geometry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .attention import install_attention
from .kv import CACHE_CLASSES
from .rope import Repositioner, check_pure_rotation
from .settings import QUANT_GROUP_SIZES, CacheConfigError, CacheSettings


@dataclass
class ModelGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_positions: int | None
    rope: Any  # the model's RoPE module (callable(x, offset=...)), or None


def _attention_of(layer) -> Any:
    for name in ("self_attn", "attention", "attn"):
        if hasattr(layer, name):
            return getattr(layer, name)
    raise CacheConfigError(f"model: cannot find the attention module of {type(layer).__name__}")


def model_geometry(model) -> ModelGeometry:
    layers = model.layers
    attn = _attention_of(layers[0])
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None and hasattr(attn, "k_proj") and n_kv:
        head_dim = attn.k_proj.weight.shape[0] // n_kv
    args = getattr(model, "args", None)
    max_pos = getattr(args, "max_position_embeddings", None)
    return ModelGeometry(len(layers), int(n_kv or 0), int(head_dim or 0), max_pos, getattr(attn, "rope", None))


def check_settings(settings: CacheSettings, geom: ModelGeometry) -> None:
    """Refuse settings this model cannot run, with the reason and what would work."""
    if settings.quantizes and geom.head_dim % settings.kv_group_size:
        fits = [g for g in QUANT_GROUP_SIZES if geom.head_dim % g == 0]
        hint = (
            f"use kv_group_size {' or '.join(map(str, fits))}"
            if fits
            else f"its head_dim is below the smallest quantisation group ({QUANT_GROUP_SIZES[0]}), "
            "so use prealloc or window"
        )
        raise CacheConfigError(
            f"kv_group_size: this model's head_dim ({geom.head_dim}) is not a multiple of "
            f"kv_group_size ({settings.kv_group_size}); quantised KV groups along head_dim: {hint}"
        )
    if settings.evicts:
        if geom.rope is None:
            raise CacheConfigError("mode: this model has no RoPE module the cache can use to re-position keys")
        check_pure_rotation(geom.rope, geom.head_dim)


def make_caches(model, settings: CacheSettings, geometry: ModelGeometry | None = None) -> list:
    """One cache per layer for ``model`` in ``settings.mode``; installs the attention dispatch."""
    geom = geometry or model_geometry(model)
    check_settings(settings, geom)
    install_attention(model)
    cls = CACHE_CLASSES[settings.mode]
    repos = Repositioner(geom.rope) if geom.rope is not None else None
    return [cls(settings, repositioner=repos) for _ in range(geom.n_layers)]
