"""Building a model's per-layer caches, checked against the model's geometry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .attention import install_attention
from .kv import CACHE_CLASSES, CacheStateError
from .layers import kinds as layout_kinds
from .layers import model_layout, slides, takes_policy, uniform
from .rope import Repositioner, check_pure_rotation
from .scored import ScoredKVCache  # noqa: F401  (registers the scored mode)
from .settings import QUANT_GROUP_SIZES, CacheConfigError, CacheSettings
from .sliding import OWN_OFFSETS, SlidingKVCache


@dataclass
class ModelGeometry:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_positions: int | None
    rope: Any  # the model's RoPE module (callable(x, offset=...)), or None
    value_dim: int = 0  # the cached values' last dimension (0: head_dim)
    latent: bool = False  # multi-head latent attention: the cache holds latents, not rotated keys
    layout: str = ""  # the model's own non-KVCache slots in words (cache/layers.py kinds), "" for none
    n_caches: int = 0  # slots in the model's own layout (0: n_layers)
    n_policy: int = -1  # of those, the plain KVCache slots a policy cache takes over (-1: unknown)
    # the other slots are all plain sliding windows (SlidingKVCache), in a model whose layers each
    # keep their own positions (sliding.OWN_OFFSETS): the evicting policies may run beside them
    windows_apart: bool = False


_ATTENTION_NAMES = ("self_attn", "attention", "attn", "mixer", "temporal_block")
# attributes that mark a module as attention over a K/V cache (not a recurrent mixer)
_KV_PROJECTIONS = ("k_proj", "head_dim", "kv_lora_rank", "wk", "qkv_proj", "query_key_value", "Wqkv", "c_attn", "k")
_ROPE_NAMES = ("rope", "rotary_emb", "rotary", "rotary_embedding", "pos_emb")


def _attention_of(layer) -> Any:
    for name in _ATTENTION_NAMES:
        if hasattr(layer, name):
            return getattr(layer, name)
    raise CacheConfigError(f"model: cannot find the attention module of {type(layer).__name__}")


def _find_attention(layers, slots: list) -> Any:
    """The attention module of the first layer whose cache a policy takes over (all layers
    when the layout does not map one slot to one layer); None when there is none."""
    if len(slots) == len(layers):
        order = [i for i, s in enumerate(slots) if takes_policy(s)] or list(range(len(layers)))
    else:
        order = list(range(len(layers)))
    for i in order:
        for name in _ATTENTION_NAMES:
            attn = getattr(layers[i], name, None)
            if attn is not None and any(hasattr(attn, a) for a in _KV_PROJECTIONS):
                return attn
    return None


def _int(x) -> int:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0


def model_geometry(model) -> ModelGeometry:
    layers = model.layers
    slots = model_layout(model)
    attn = _find_attention(layers, slots)
    args = getattr(model, "args", None)
    max_pos = getattr(args, "max_position_embeddings", None)
    n_kv = head_dim = value_dim = 0
    rope, latent = None, False
    if attn is not None:
        latent = hasattr(attn, "kv_lora_rank")
        if latent:  # the cache holds the compressed latent (keys) and the rotated part (values)
            n_kv, head_dim, value_dim = 1, _int(attn.kv_lora_rank), _int(getattr(attn, "qk_rope_head_dim", 0))
        else:
            n_kv = _int(getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
                        or getattr(attn, "num_kv_heads", None) or getattr(attn, "n_kv", None))
            head_dim = _int(getattr(attn, "head_dim", None) or getattr(attn, "head_size", None))
            k_proj = getattr(attn, "k_proj", None)
            weight = getattr(k_proj, "weight", None)
            if not head_dim and weight is not None and n_kv:
                head_dim = weight.shape[0] // n_kv
            value_dim = _int(getattr(attn, "v_head_dim", None))
        rope = next((getattr(attn, n) for n in _ROPE_NAMES if callable(getattr(attn, n, None))), None)
    apart = getattr(args, "model_type", None) in OWN_OFFSETS and all(takes_policy(s) or slides(s) for s in slots)
    return ModelGeometry(len(layers), n_kv, head_dim, max_pos, rope, value_dim or head_dim, latent,
                         layout_kinds(slots), len(slots), sum(takes_policy(s) for s in slots), apart)


def _group_hint(dims: list[int]) -> str:
    fits = [g for g in QUANT_GROUP_SIZES if all(d % g == 0 for d in dims)]
    if fits:
        return f"use kv_group_size {' or '.join(map(str, fits))}"
    if min(dims) < QUANT_GROUP_SIZES[0]:
        return (f"its head_dim is below the smallest quantisation group ({QUANT_GROUP_SIZES[0]}), "
                "so use prealloc or window")
    return (f"no quantisation group ({', '.join(map(str, QUANT_GROUP_SIZES))}) divides it, "
            "so use prealloc or window")


def check_settings(settings: CacheSettings, geom: ModelGeometry) -> None:
    """Refuse settings this model cannot run, with the reason and what would work."""
    if settings.evicts and geom.layout and not geom.windows_apart:
        raise CacheConfigError(
            f"mode: {settings.mode} evicts tokens and re-positions the keys of every layer, but this model's "
            f"layers also keep their own caches ({geom.layout}) whose positions and state it cannot move; "
            "use prealloc, quantized or concat"
        )
    if settings.evicts and geom.n_caches and geom.n_caches != geom.n_layers:
        raise CacheConfigError(
            f"mode: {settings.mode} evicts per layer, but this model has {geom.n_caches} caches for "
            f"{geom.n_layers} layers (layers share or loop over caches); use prealloc, quantized or concat"
        )
    if settings.evicts and geom.latent:
        raise CacheConfigError(
            f"mode: {settings.mode} re-positions cached keys, but this model's attention caches compressed "
            "latents (multi-head latent attention), not rotated keys; use prealloc, quantized or concat"
        )
    if settings.quantizes and geom.n_policy != 0:  # a model without attention caches has nothing to quantise
        dims = sorted({d for d in (geom.head_dim, geom.value_dim) if d})
        if not dims:
            raise CacheConfigError(
                "mode: cannot find this model's head_dim, so its K/V cannot be quantised safely; "
                "use prealloc or concat"
            )
        if any(d % settings.kv_group_size for d in dims):
            what = f"head_dim ({geom.head_dim})" if len(dims) == 1 else (
                f"cached key and value widths ({geom.head_dim}, {geom.value_dim})")
            raise CacheConfigError(
                f"kv_group_size: this model's {what} is not a multiple of kv_group_size "
                f"({settings.kv_group_size}); quantised KV groups along head_dim: {_group_hint(dims)}"
            )
    if settings.evicts:
        if geom.rope is None:
            raise CacheConfigError("mode: this model has no RoPE module the cache can use to re-position keys")
        if not geom.head_dim:
            raise CacheConfigError(f"mode: cannot find this model's head_dim, so {settings.mode} cannot re-position "
                                   "its keys; use prealloc, quantized or concat")
        try:
            check_pure_rotation(geom.rope, geom.head_dim)
        except (ValueError, TypeError) as e:
            if isinstance(e, CacheConfigError):
                raise
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CacheConfigError(f"mode: this model's RoPE cannot re-position cached keys ({why}); "
                                   "use prealloc, quantized or concat") from None


def _own_slot(slot: Any, settings: CacheSettings) -> Any:
    """A slot no policy takes: a plain sliding window becomes chatapp's SlidingKVCache (the same
    window, in one contiguous buffer the fused CPU steps read), every other stays mlx-lm's own."""
    return SlidingKVCache(settings, slot.max_size) if slides(slot) else slot


def make_caches(model, settings: CacheSettings, geometry: ModelGeometry | None = None) -> list:
    """One cache per slot of the model's own layout (``make_cache()`` when it has one): the plain
    full-attention ``KVCache`` slots become ``settings.mode``'s cache, a plain sliding window
    chatapp's ``SlidingKVCache`` (whatever the mode), every other slot (recurrent state, ...)
    stays mlx-lm's own. Installs the attention dispatch. Raises
    :class:`CacheConfigError` (one line) for a mode this model cannot run."""
    geom = geometry or model_geometry(model)
    check_settings(settings, geom)
    install_attention(model)
    cls = CACHE_CLASSES[settings.mode]
    repos = Repositioner(geom.rope) if geom.rope is not None else None
    caches = [cls(settings, repositioner=repos) if takes_policy(s) else _own_slot(s, settings)
              for s in model_layout(model)]
    if geom.layout or len(caches) != geom.n_layers:
        # Layers here may read another layer's K/V (shared caches, loops, hybrids): every fetch
        # must hand out the whole held history, never only the full-precision part that attend()
        # completes for the one call that follows.
        for c in caches:
            decline = getattr(c, "decline_attend", None)
            if decline is not None:
                decline()
    return caches


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
    if not uniform(caches):
        raise CacheStateError(f"saved K/V fit only models whose every layer is a full-attention cache; "
                              f"this one also has {geom.layout or 'shared caches'}")
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
