"""Which MLX backend runs the model, and which float dtype its activations should use.

MLX runs on Apple GPUs (Metal), NVIDIA GPUs (CUDA) or the CPU. The right activation dtype
differs:

* GPU: keep the checkpoint's own float dtype (float16 / bfloat16); the GPU kernels are built
  for it and it halves memory traffic.
* CPU: use float32. MLX's CPU kernels for half-precision types are far slower, worst of all
  for 4-bit ``quantized_matmul``. Measured once here (mlx 0.32.4 CPU backend, 2-core AMD EPYC,
  4-bit weights, group size 64, K = N = 2048, see the numbers below):

      activations   M=1 (decode)   M=32 (prefill chunk)
      float32         4.2 ms          120 ms
      bfloat16       30.0 ms  (7x)    957 ms  (8x)
      float16       133.7 ms (32x)   4989 ms (42x)

  So a quantised checkpoint whose scales/biases are float16 must be cast to float32 on CPU, or
  every token costs ~30x more. Casting the few float tensors (scales, biases, norms, any float
  weights) costs memory only for those; the packed uint32 weights are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from chatapp.backend.params import activation_dtype

DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}


@dataclass(frozen=True)
class BackendInfo:
    """The backend MLX computes on.

    ``activation_dtype`` is the float dtype to run activations in, or ``None`` for "keep the
    checkpoint's own float dtype" (the GPU choice); use :meth:`resolve` to get a concrete one.
    """

    name: str  # "metal" | "cuda" | "cpu"
    activation_dtype: mx.Dtype | None

    @property
    def is_gpu(self) -> bool:
        return self.name in ("metal", "cuda")

    def resolve(self, checkpoint_dtype: mx.Dtype) -> mx.Dtype:
        """The activation dtype for a checkpoint stored in ``checkpoint_dtype``."""
        return self.activation_dtype or checkpoint_dtype


def _available(module_name: str) -> bool:
    module = getattr(mx, module_name, None)
    is_available = getattr(module, "is_available", None)
    if is_available is None:
        return False
    try:
        return bool(is_available())
    except Exception:  # a backend that fails to initialise is not available
        return False


def pick_backend() -> BackendInfo:
    """Detect the backend: Metal, then CUDA, else CPU.

    A GPU build whose default device was set to the CPU (``mx.set_default_device(mx.cpu)``)
    counts as CPU, since that is where the work then runs.
    """
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if not on_cpu and _available("metal"):
        return BackendInfo("metal", None)
    if not on_cpu and _available("cuda"):
        return BackendInfo("cuda", None)
    return BackendInfo("cpu", mx.float32)


def is_floating(dtype: mx.Dtype) -> bool:
    return mx.issubdtype(dtype, mx.floating)


def checkpoint_float_dtype(model: nn.Module) -> mx.Dtype:
    """The float dtype that holds most of the model's float parameter bytes.

    For a quantised model that is the dtype of the scales/biases (and norms, embeddings left in
    float); float32 if the model has no float parameters at all.
    """
    totals: dict[mx.Dtype, int] = {}
    for _, p in tree_flatten(model.parameters()):
        if is_floating(p.dtype):
            totals[p.dtype] = totals.get(p.dtype, 0) + p.nbytes
    if not totals:
        return mx.float32
    return max(totals.items(), key=lambda kv: kv[1])[0]


def activation_float_dtype(model: nn.Module) -> mx.Dtype:
    """The float dtype the model computes (and so keeps its K/V) in (see ``backend.params.activation_dtype``),
    the checkpoint's float dtype when every float parameter is one a CPU load keeps as stored."""
    return activation_dtype(model) or checkpoint_float_dtype(model)


def cast_floating(model: nn.Module, dtype: mx.Dtype, skip: Callable[[str], bool] | None = None) -> nn.Module:
    """Cast every floating parameter of ``model`` to ``dtype``, in place; returns the model.

    That covers float weights, embeddings, norms and the scales/biases of quantised layers, so
    activations flow in ``dtype``. Integer parameters (the packed uint32 weights of quantised
    layers) are left untouched. Parameters already in ``dtype`` are not copied, nor those whose
    dotted path ``skip`` accepts. One parameter is cast and evaluated at a time, so the peak
    memory is the model plus its largest parameter, not the model plus a copy of every float.
    """
    if not is_floating(dtype):
        raise ValueError(f"cast_floating needs a floating dtype, got {dtype}")
    for path, p in tree_flatten(model.parameters()):
        if not is_floating(p.dtype) or p.dtype == dtype or (skip is not None and skip(path)):
            continue
        cast = p.astype(dtype)
        mx.eval(cast)
        model.update(tree_unflatten([(path, cast)]), strict=False)
        del p, cast
    mx.eval(model.parameters())
    return model


def dtype_name(dtype: mx.Dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("mlx.core.")
