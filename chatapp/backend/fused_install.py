"""Which calls of a model take the fused routes: ``install_fused_decode`` swaps the model's class
for a subclass whose ``__call__`` sends a single token to ``FusedDecoder.step`` and a prefill
chunk whose caller wants its last position only to ``FusedDecoder.prefill``, over every
segmented cache (fused_support.cache_refusal), and hands every other call (other caches,
embeddings inputs) to the model's own ``__call__``; and what the rest of the code asks of a
model about it (is it fused, its decoder, its caches' dtype)."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .fused_decode import FusedDecoder
from .fused_settings import KV_MX, kv_dtype_line, numerics_line, resolve_numerics
from .fused_support import cache_refusal, fused_unsupported
from .precompile import maintenance_cached, run_policies
from .qlinear import last_position_wanted

_FUSED_CLASSES: dict[type, type] = {}
# longest chunk the fused prefill takes (its scratch is a few [T, hidden] float32 arrays);
# the session's chunks are 512 tokens at most
PREFILL_MAX_TOKENS = 1024


def _served(dec: FusedDecoder | None, inputs, cache) -> bool:
    """Whether the fused routes take a call: one row of token ids over caches they serve."""
    return (dec is not None and isinstance(inputs, mx.array) and inputs.ndim == 2 and inputs.shape[0] == 1
            and cache_refusal(cache, len(dec.layers)) is None)


def _prefill_chunk(dec: FusedDecoder, inputs: mx.array) -> bool:
    return dec.prefill_chunks and 1 < inputs.shape[1] <= PREFILL_MAX_TOKENS


def _fused_class(base: type) -> type:
    cls = _FUSED_CLASSES.get(base)
    if cls is None:
        def __call__(self, inputs, cache=None, **kwargs):
            dec = getattr(self, "_chatapp_fused", None)
            if not kwargs and _served(dec, inputs, cache):
                dec.adopt(cache)  # the model's own call below writes them in the fused routes' dtype too
                if inputs.shape[1] == 1:
                    token = int(inputs.item())
                    logits = dec.step(token, cache)
                    return mx.array(logits).reshape(1, 1, -1)
                if _prefill_chunk(dec, inputs) and last_position_wanted():
                    # a prefill chunk whose caller reads the last position's logits only
                    return mx.array(dec.prefill(inputs[0], cache)).reshape(1, 1, -1)
            return base.__call__(self, inputs, cache=cache, **kwargs)

        cls = type(f"Fused{base.__name__}", (base,), {"__call__": __call__, "_chatapp_base": base})
        _FUSED_CLASSES[base] = cls
    return cls


def install_fused_decode(model: nn.Module, warm_up: bool = True, numerics: str = "exact",
                         kv_dtype: str = "float32", before_prefill: Callable[[], None] | None = None) -> str:
    """Fuse the model's single-token steps when its layers allow; returns a line for the plan.
    warm_up: run one step on a scratch cache now, so that compiling (or loading from numba's
    disk cache) the layer kernel does not land in the first reply. before_prefill: with
    warm_up, the decode step is warmed first, then this is called (it waits for the process
    compiling the prefill kernel into numba's disk cache meanwhile: precompile.py), then the
    prefill, which loads what that process left. Where numba's disk cache lacks the cache
    maintenance kernels (a first start, or new kernel source), warm_up also runs the evicting
    policies' caches through a few dozen tokens (precompile.run_policies): compiled here, under
    the warm-up's notice, they no longer land in the turn that first quantises or evicts (on
    bench long's chat, +1.9 s and +2.2 s to those turns' first token)."""
    why = fused_unsupported(model)
    if why:
        return f"fused decode: off ({why})"
    numerics = resolve_numerics(numerics)
    dec = FusedDecoder(model, numerics, kv_dtype)
    if warm_up:
        first = dec.first_layers(1)
        first.warm_up(before_prefill)
        if not maintenance_cached():
            run_policies(model, first)
    object.__setattr__(model, "_chatapp_fused", dec)
    if not getattr(type(model), "_chatapp_base", None):
        model.__class__ = _fused_class(type(model))
    return (f"fused decode: one native call per token ({len(dec.layers)} layers), then the output head; "
            f"prefill chunks: one native call each ({'the same int8 products' if numerics == 'fast' else 'float32'}); "
            f"{numerics_line(numerics)}; {kv_dtype_line(kv_dtype)}"
            + (f"; {dec.widened} 3/5/6-bit matrices read widened to a byte a value (exact, 8 / bits of their "
               "bytes)" if dec.widened else "") + _features(model, dec))


def _features(model: nn.Module, dec: FusedDecoder) -> str:
    """What the kernels compute beyond Llama's block for this model, for the plan's line."""
    from cache.layers import model_layout, slides

    parts = []
    if dec._qkv_bias.shape[1]:
        parts.append("q/k/v biases")
    if dec._qk_norm.shape[1]:
        parts.append("q/k norms")
    if dec._post_norm.shape[1]:
        parts.append("sandwich norms")
    if dec.gelu:
        parts.append("GELU")
    if dec.embed_scale is not None:
        parts.append(f"embeddings x {float(dec.embed_scale):g}")
    if len(dec.angles.freqs) > 1:
        parts.append(f"{len(dec.angles.freqs)} RoPE bases")
    windows = [s.max_size for s in model_layout(model) if slides(s)]
    if windows:
        parts.append(f"{len(windows)} sliding-window layers ({'/'.join(map(str, sorted(set(windows))))} tokens)")
    return f"; in the kernels: {', '.join(parts)}" if parts else ""


def uninstall_fused_decode(model: nn.Module) -> None:
    base = getattr(type(model), "_chatapp_base", None)
    if base is not None:
        model.__class__ = base
    if "_chatapp_fused" in getattr(model, "__dict__", {}):
        object.__delattr__(model, "_chatapp_fused")


def cache_kv_dtype(model) -> mx.Dtype | None:
    """The dtype of the K/V buffers the fused routes give ``model``'s caches (float16
    under cpu.kv_dtype auto with F16C), or None when the model is not fused (its caches then
    hold what the model computes)."""
    dec = getattr(model, "_chatapp_fused", None)
    return KV_MX[dec.kv_dtype] if dec is not None and is_fused(model) else None


def fused_decoder(model) -> "FusedDecoder | None":
    """The model's FusedDecoder when the fused step is installed (benches adjust its numerics)."""
    return getattr(model, "_chatapp_fused", None)


def prefill_every_position(model, inputs: mx.array, cache: list) -> mx.array | None:
    """Logits [1, T, vocab] of a prefill chunk through the fused prefill with every position
    scored (bench quality's chunked fused route: the session asks for the last one only); None
    where the fused prefill would not take the chunk (the caller then runs the model)."""
    dec = fused_decoder(model) if is_fused(model) else None
    if not (_served(dec, inputs, cache) and _prefill_chunk(dec, inputs)):
        return None
    dec.adopt(cache)
    return mx.array(dec.prefill(inputs[0], cache, every_position=True))[None]


def steps_synchronously(model) -> bool:
    """Whether ``model``'s single-token steps compute inside the call (the fused step) rather
    than building a lazy graph: the session then reads each token before starting the next step."""
    return getattr(model, "_chatapp_fused", None) is not None and is_fused(model)


def is_fused(model: nn.Module) -> bool:
    return getattr(type(model), "_chatapp_base", None) is not None
