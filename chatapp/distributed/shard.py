"""Loading this rank's shard of the model: tensor parallelism (``model.shard``) or pipeline stages."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from chatapp.model.modelconfig import config_value


class ShardError(Exception):
    """The model cannot be sharded the way asked; ``str()`` is one line for the user."""



_PIPELINE_TYPES_HINT = "deepseek_v2/v3, glm4_moe, qwen2, qwen3_moe, qwen3_next, ministral3, ..."




def _supports_pipeline(model) -> bool:
    return hasattr(model, "model") and hasattr(model.model, "pipeline")


def check_heads(config: dict, size: int, where: str = "the model", model=None) -> None:
    """Tensor parallelism splits the attention heads: both head counts must divide by ``size``.

    (mlx-lm's ``shard()`` divides them with ``//`` and would silently run a wrong model.)
    """
    heads = config_value(config, "num_attention_heads", "n_heads")
    kv = config_value(config, "num_key_value_heads", "n_kv_heads") or heads
    if heads is None and model is not None:
        attn = getattr(model.layers[0], "self_attn", None)
        heads = getattr(attn, "n_heads", None)
        kv = getattr(attn, "n_kv_heads", None) or heads
    if heads is not None and (int(heads) % size or int(kv) % size):
        fits = [n for n in range(2, int(kv) + 1) if int(heads) % n == 0 and int(kv) % n == 0]
        hint = f"use {' or '.join(map(str, fits))} ranks" if fits else "it cannot be split by heads at all"
        raise ShardError(
            f"cannot shard {where} over {size} ranks: tensor parallelism splits the attention heads, "
            f"and its {heads} query heads and {kv} KV heads must both divide by {size} ({hint})")


def check_shardable(model, config: dict, size: int, strategy: str, where: str = "the model") -> None:
    """Refuse, with one line, a model that cannot be split over ``size`` ranks this way."""
    model_type = config.get("model_type", "?")
    if strategy == "tensor":
        if not hasattr(model, "shard"):
            alt = ("; it can be pipelined: use --distributed pipeline" if _supports_pipeline(model)
                   else "; it cannot be pipelined either")
            raise ShardError(f"cannot shard {where} with tensor parallelism: mlx-lm's {model_type} "
                             f"model has no shard(){alt}")
        check_heads(config, size, where, model)
    elif strategy == "pipeline":
        if not _supports_pipeline(model):
            alt = ("use --distributed tensor" if hasattr(model, "shard")
                   else "it has no shard() for tensor parallelism either")
            raise ShardError(
                f"cannot pipeline {where}: mlx-lm implements pipeline parallelism only for some "
                f"architectures ({_PIPELINE_TYPES_HINT}), not {model_type}; {alt}")
        n_layers = len(model.model.layers)
        if n_layers < size:
            raise ShardError(f"cannot pipeline {where} over {size} ranks: it has only {n_layers} layers")
    else:
        raise ShardError(f"unknown sharding {strategy!r}: use tensor or pipeline")


def precheck_heads(spec: str, size: int) -> None:
    """Tensor parallelism on a local folder: refuse heads that do not divide, from config.json alone."""
    path = Path(str(spec)).expanduser()
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a repo id, or no readable config: the full check runs after loading
    if not isinstance(config, dict) or config_value(config, "num_attention_heads", "n_heads") is None:
        return
    check_heads(config, size, str(spec))


def default_strategy(model) -> str:
    """What a launched job uses without --distributed: tensor where possible (as sharded_load)."""
    if hasattr(model, "shard"):
        return "tensor"
    if _supports_pipeline(model):
        return "pipeline"
    return "tensor"  # check_shardable then says why it cannot


def _apply_shard(model, group, strategy: str, where: str):
    try:
        if strategy == "tensor":
            model.shard(group)
            return model
        model.model.pipeline(group)
        return _PipelineStage(model)
    except (ValueError, RuntimeError) as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ShardError(f"cannot shard {where} over {group.size()} ranks ({strategy}): {first}") from None


@functools.lru_cache(maxsize=None)
def _pipeline_stage_class():
    import mlx.core as mx
    import mlx.nn as nn

    class _Tail:
        """The last local cache as mlx-lm's pipeline code sees it.

        mlx-lm's pipelined models make the rank's ``send`` a dependency of the last cache with
        ``cache[-1].keys = mx.depends(cache[-1].keys, h)``, so that evaluating the cache also
        sends. chatapp's caches keep their buffers privately (no ``keys`` attribute): this thin
        proxy takes the dependency instead, and :class:`_PipelineStage` evaluates it with the
        step. Everything else is the real cache.
        """

        def __init__(self, cache):
            object.__setattr__(self, "_cache", cache)
            object.__setattr__(self, "dep", None)

        @property
        def keys(self):
            return mx.zeros((1,))

        def __getattr__(self, name):
            return getattr(object.__getattribute__(self, "_cache"), name)

        def __setattr__(self, name, value):
            if name == "keys":  # mlx-lm's pipeline hook: keep the send as a dependency
                object.__setattr__(self, "dep", value)
            else:
                setattr(object.__getattribute__(self, "_cache"), name, value)

    class PipelineStage(nn.Module):
        """A pipelined mlx-lm model whose send is evaluated with every forward step."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        @property
        def layers(self):
            return self.inner.layers

        @property
        def args(self):
            return getattr(self.inner, "args", None)

        def __call__(self, inputs, cache=None, **kwargs):
            if not cache:
                return self.inner(inputs, cache=cache, **kwargs)
            tail = _Tail(cache[-1])
            out = self.inner(inputs, cache=[*cache[:-1], tail], **kwargs)
            if tail.dep is not None:
                mx.async_eval(tail.dep)  # schedule this rank's send now, even if only the cache is read
            return out

    return PipelineStage


def _PipelineStage(model):
    return _pipeline_stage_class()(model)


@dataclass
class ShardInfo:
    strategy: str
    rank: int
    size: int
    n_heads: int | None
    n_kv_heads: int | None  # of the whole model
    local_kv_heads: int | None  # held by this rank's cache
    local_layers: int


def load_shard(config, group, strategy: str | None):
    """Load this rank's shard of ``config.model.id``; returns (LoadedModel, ShardInfo).

    An mlx-lm folder (local, or a Hugging Face repo downloaded by chatapp's loader) is loaded
    lazily, sharded, and only then evaluated and cast, so each rank materialises only its own
    share of the weights (as mlx-lm's ``sharded_load`` does; it is not used itself because it
    needs a ``model.safetensors.index.json`` for pipelines and does not cast to chatapp's dtype).
    A legacy-npz folder goes through chatapp's loader whole, then is sharded.
    Raises ShardError or ModelLoadError with one line.
    """
    import mlx.core as mx

    from chatapp.model.device import (
        DTYPES,
        cast_floating,
        checkpoint_float_dtype,
        dtype_name,
        pick_backend,
    )
    from chatapp.model.hub import resolve_model_path
    from chatapp.model.loader import (
        LoadedModel,
        available_memory_bytes,
        estimate_weight_bytes,
        format_bytes,
        load_model,
        weights_fingerprint,
    )
    from chatapp.model.modelfiles import ModelLoadError, find_weight_files

    size = group.size()
    spec = config.model.id
    path, model_id = resolve_model_path(str(spec))
    where = str(spec) if Path(str(spec)).expanduser().is_dir() else f"{model_id} ({path})"
    fmt, files = find_weight_files(path)

    if fmt == "legacy-npz" and files:
        loaded = load_model(str(spec), dtype=config.model.dtype)
        strategy = strategy or default_strategy(loaded.model)
        check_shardable(loaded.model, loaded.config, size, strategy, where)
        model = _apply_shard(loaded.model, group, strategy, where)
        mx.eval(model.parameters())
        loaded.model = model
        lm_config = loaded.config
    else:
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not files:
            missing.append("weights (model*.safetensors)")
        if missing:
            raise ModelLoadError(f"{where} is missing {', '.join(missing)}")
        dtype = config.model.dtype
        target = pick_backend().activation_dtype if dtype == "auto" else DTYPES.get(dtype)
        try:
            from mlx_lm.utils import load_model as lm_load_model
            from mlx_lm.utils import load_tokenizer

            model, lm_config = lm_load_model(path, lazy=True)
            tokenizer = load_tokenizer(path, eos_token_ids=lm_config.get("eos_token_id"))
        except Exception as err:  # mlx-lm raises many kinds; the user needs one line
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            raise ModelLoadError(f"could not load {where}: {type(err).__name__}: {first}") from err
        strategy = strategy or default_strategy(model)
        check_shardable(model, lm_config, size, strategy, where)
        have = available_memory_bytes()
        need = estimate_weight_bytes(files, target) // size  # a lower bound: some tensors are replicated
        if have is not None and need > have:
            raise ModelLoadError(f"not enough memory for this rank's share of {where}: at least "
                                 f"{format_bytes(need)} but only {format_bytes(have)} is available")
        model = _apply_shard(model, group, strategy, where)
        final = target or checkpoint_float_dtype(model)
        cast_floating(model, final)  # evaluates: only this rank's share
        model.eval()
        max_pos = config_value(lm_config, "max_position_embeddings")
        loaded = LoadedModel(
            model=model, tokenizer=tokenizer, config=lm_config, model_id=model_id, path=path, format=fmt,
            dtype=dtype_name(final), weights_fingerprint=weights_fingerprint(files),
            has_chat_template=bool(getattr(tokenizer, "has_chat_template", False)),
            max_position_embeddings=int(max_pos) if max_pos is not None else None,
            n_kv_heads=None, head_dim=None, n_layers=None,
        )
    heads = config_value(lm_config, "num_attention_heads", "n_heads")
    kv = config_value(lm_config, "num_key_value_heads", "n_kv_heads") or heads
    layers = loaded.model.layers
    attn = getattr(layers[0], "self_attn", None) if len(layers) else None
    local_kv = getattr(attn, "n_kv_heads", None)
    loaded.n_kv_heads = local_kv
    loaded.n_layers = len(layers)
    loaded.head_dim = getattr(attn, "head_dim", None) or config_value(lm_config, "head_dim")
    info = ShardInfo(strategy, group.rank(), size, heads, kv, local_kv, len(layers))
    return loaded, info


# =============================================================================================
# Control channel, shared cancel flag, watchdog
