"""Building a model's per-layer caches, checked against the model's geometry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .attention import install_attention
from .kv import CACHE_CLASSES, CacheStateError
from .rope import Repositioner, check_pure_rotation
from .scored import ScoredKVCache  # noqa: F401  (registers the scored mode)
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


def reserve_tokens(caches: list, n: int) -> bool:
    """Room for ``n`` more tokens now in each layer's cache that takes a reservation (the ones
    that keep every token: SegmentedKVCache.reserve; concat has none); whether any grew."""
    grew = False
    for c in caches:
        reserve = getattr(c, "reserve", None)
        grew = (reserve is not None and reserve(n)) or grew
    return grew


def _check_state(i: int, state: list, settings: CacheSettings, geom: ModelGeometry) -> None:
    """Shapes of one layer's saved state against the model and the settings."""
    if not state:
        return
    k, v = state[0], state[1]
    for name, x in (("keys", k), ("values", v)):
        if x.ndim != 4 or x.shape[1] != geom.n_kv_heads:
            raise CacheStateError(
                f"layer {i}: {name} of shape {tuple(x.shape)} do not fit this model "
                f"({geom.n_kv_heads} KV heads, layout [batch, heads, tokens, head_dim])"
            )
    if k.shape[3] != geom.head_dim or k.shape[2] != v.shape[2] or k.shape[0] != v.shape[0]:
        raise CacheStateError(
            f"layer {i}: keys {tuple(k.shape)} / values {tuple(v.shape)} do not fit this model's head_dim "
            f"({geom.head_dim})"
        )
    if len(state) in (8, 9):
        packed_dim = geom.head_dim * settings.kv_bits // 32
        groups = geom.head_dim // settings.kv_group_size
        qk = state[2:5]
        if qk[0].shape[-1] != packed_dim or qk[1].shape[-1] != groups or qk[0].shape[1] != geom.n_kv_heads:
            raise CacheStateError(
                f"layer {i}: quantised keys {tuple(qk[0].shape)} do not fit {settings.kv_bits}-bit groups of "
                f"{settings.kv_group_size} over head_dim {geom.head_dim}"
            )


def restore_caches(model, settings: CacheSettings, states: list, metas: list,
                   geometry: ModelGeometry | None = None) -> list:
    """Rebuild ``model``'s per-layer caches from saved ``state`` / ``meta_state`` values.

    The inverse of reading ``[c.state for c in caches]`` and ``[c.meta_state for c in caches]``
    from caches made with the same ``settings``: the restored caches hold the same tokens (full
    precision and quantised), the same rotation delta and eviction count, and give the same
    logits from the next step on. Pure MLX: the caller reads the arrays from wherever they were
    kept. Raises :class:`CacheStateError` (a ValueError) when the state does not fit the model
    or the settings, and :class:`CacheConfigError` when the settings do not fit the model.
    """
    geom = geometry or model_geometry(model)
    caches = make_caches(model, settings, geom)
    if len(states) != len(caches) or len(metas) != len(caches):
        raise CacheStateError(
            f"the state has {len(states)} layers (meta {len(metas)}), this model has {len(caches)}"
        )
    for i, (c, state, meta) in enumerate(zip(caches, states, metas)):
        state = list(state)
        _check_state(i, state, settings, geom)
        try:
            c.load_state(state, tuple(meta))
        except CacheStateError as e:
            raise CacheStateError(f"layer {i}: {e}") from None
    held = {(c.offset, c.evicted) for c in caches}
    if len(held) > 1:
        raise CacheStateError(f"layers disagree on the tokens held / evicted: {sorted(held)}")
    return caches
