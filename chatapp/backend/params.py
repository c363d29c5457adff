"""Which of a model's parameters are what, by name and module type: the model-surgery rules that the
CPU backend owns and the loader follows (which parameters a CPU load may leave in their dtype)."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def is_quant_param(path: str) -> bool:
    """The scales/biases of a quantised layer (by name: every MLX quantised module uses these)."""
    return path.endswith((".scales", ".biases"))


def lookup_only_embeddings(model: nn.Module) -> set[str]:
    """Weight paths of the model's float embedding tables that serve lookups only.

    A model with its own output head (``lm_head``) reads its embedding table one row per token;
    a tied one also multiplies by the whole table, which must then be in the activations' dtype.
    """
    if getattr(model, "lm_head", None) is None:
        return set()
    return {f"{name}.weight" for name, m in model.named_modules()
            if isinstance(m, nn.Embedding) and not isinstance(m, nn.QuantizedEmbedding)}


def kept_for_cpu_kernels(model: nn.Module) -> Callable[[str], bool]:
    """The parameters a CPU load may leave in the checkpoint's dtype: quantised layers' scales
    and biases (the kernels read float16 ones) and lookup-only embedding tables (rows are cast
    as they are read; `chatapp.backend.cpu.accelerate_model` installs that)."""
    tables = lookup_only_embeddings(model)
    return lambda path: is_quant_param(path) or path in tables


def activation_dtype(model: nn.Module) -> mx.Dtype | None:
    """The float dtype the model computes (and keeps its K/V) in: that of most float parameters,
    leaving out those a CPU load keeps as stored (float16 scales/biases the kernels read, lookup-only
    tables); None when no other float parameter exists."""
    kept = kept_for_cpu_kernels(model)
    totals: dict[mx.Dtype, int] = {}
    for path, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating) and not kept(path):
            totals[p.dtype] = totals.get(p.dtype, 0) + p.nbytes
    return max(totals.items(), key=lambda kv: kv[1])[0] if totals else None
