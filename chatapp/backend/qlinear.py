"""Quantised layers for MLX's CPU backend, with the route each product takes.

`accelerate_model` (cpu.py) swaps every `nn.QuantizedLinear` / `nn.QuantizedEmbedding` for a
subclass with the same parameters (same names, same arrays: weights, saving and
`model.parameters()` are unaffected) and gives each one a route:

- ``kernel``: products on the packed weights themselves (`chatapp.kernels.qmatmul`, numba):
  up to ``kernel_max_tokens`` tokens (decode) the kernel reads the 4- or 8-bit bytes once per
  call; longer calls (prefill) dequantise blocks of rows into a float32 scratch and run one
  BLAS gemm per block through numpy's bundled OpenBLAS. No float32 copy of the weights is
  kept, so a 7B model stays at its 4-bit size.
- ``dense``: a kept float32 copy of the weight (8x the 4-bit bytes), products through the BLAS
  (single tokens through numpy's sgemv). Only when asked for (``dense_weights = "on"``) or
  when the kernels are unavailable and an optimised BLAS is loaded.
- ``mlx``: MLX's own `quantized_matmul`, dequantising and using MLX's matmul above
  ``threshold`` tokens. For weights the kernels do not handle, and small ones, where the sync
  that hands an activation to numpy (20-60 us) costs more than the product.

Every route computes in float32 and returns what `quantized_matmul` would (the promotion of
the activation and scale dtypes).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

ROUTES = ("kernel", "dense", "mlx")

# Weights at least this large (out x in) take numpy's sgemv or the packed kernels for one
# token. Each call evaluates its input (a sync, ~20-60 us), which small products cannot repay:
# per product in a chain of 8, MLX vs numpy took 23 vs 63 us at 512x512, 42 vs 49 us at 768x768
# and 366 vs 62 us at 1024x1024. stories260K (64 wide) decodes at ~560 tokens/s through MLX and
# ~360 through numpy.
NUMPY_MIN_ELEMENTS = 1024 * 1024


# MLX evaluates lazily: a prefill that reads only the last position's logits never computes the
# output head for the other positions. The kernel routes compute eagerly (numpy needs the
# input), so a 512-token prefill chunk would run the whole head (512 x 32000 x 4096 products,
# ~1 s here) for one row. A caller that reads only the last position says so with this context;
# the output head then computes that row alone and leaves the others zero.
_last_position_only: contextvars.ContextVar[bool] = contextvars.ContextVar("last_position_only", default=False)


@contextlib.contextmanager
def last_position_only() -> Iterator[None]:
    """Within this context the model's output head computes only the last position's logits
    (the other rows are zeros): for prefill, which reads ``logits[:, -1]`` and nothing else."""
    token = _last_position_only.set(True)
    try:
        yield
    finally:
        _last_position_only.reset(token)


def last_position_wanted() -> bool:
    """Whether the caller runs inside ``last_position_only`` (only ``logits[:, -1]`` is read)."""
    return _last_position_only.get()


@dataclass(eq=False)
class Route:
    """Per-layer state, kept outside the module's parameter tree (no mx.array attributes)."""

    kind: str = "mlx"
    why: str = ""
    threshold: int = 16  # mlx route: dequantise + dense matmul above this many tokens
    kernel_max_tokens: int = 4  # kernel route: packed products up to this many tokens
    numpy_matvec: bool = True  # dense route: single tokens through numpy's sgemv
    output_head: bool = False  # the model's last projection (see last_position_only)
    packed: object | None = None  # chatapp.kernels.qmatmul.PackedWeight (kernel route)
    dense: mx.array | None = None  # dense route: the float32 copy
    dense_np: np.ndarray | None = None  # a numpy view of ``dense`` (same memory) for sgemv


def _tokens(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


def _as_numpy_tokens(x: mx.array) -> np.ndarray:
    """x [..., K] evaluated as a float32 numpy array [tokens, K] (a view where possible)."""
    xf = x if x.dtype == mx.float32 else x.astype(mx.float32)
    mx.eval(xf)
    return np.asarray(xf).reshape(-1, x.shape[-1])


def _from_numpy(y: np.ndarray, lead: tuple, out_dtype: mx.Dtype) -> mx.array:
    out = mx.array(y).reshape(*lead, y.shape[-1])
    return out if out.dtype == out_dtype else out.astype(out_dtype)


def _numpy_matvec(x: mx.array, w: np.ndarray, out_dtype: mx.Dtype) -> mx.array:
    """One token times w[out, in]^T through numpy's sgemv (evaluates ``x`` first)."""
    xn = _as_numpy_tokens(x)
    return _from_numpy(xn @ w.T, x.shape[:-1], out_dtype)


def _dense_matmul(x: mx.array, w: mx.array, out_dtype: mx.Dtype) -> mx.array:
    """x [..., in] times w[out, in]^T as one float32 sgemm over all leading dims.

    Through MLX's matmul when an optimised BLAS was loaded under it; otherwise MLX would run it
    on its bundled reference BLAS (~80x slower), so numpy's bundled OpenBLAS does it on views
    of the same arrays. (stories260K-4bit, whose small layers stay on this route: a
    prefill of 2,700 tokens 1.0-1.4 s -> 0.78-0.89 s.)"""
    from .blas import current_blas

    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != mx.float32:
        x2 = x2.astype(mx.float32)
    if current_blas().loaded:
        y = (x2 @ w.T).reshape(*lead, w.shape[0])
        return y if y.dtype == out_dtype else y.astype(out_dtype)
    wf = w if w.dtype == mx.float32 else w.astype(mx.float32)
    mx.eval(x2, wf)
    return _from_numpy(np.asarray(x2) @ np.asarray(wf).T, lead, out_dtype)


_scratch = threading.local()


def kernel_matmul(x: mx.array, route: Route, out_dtype: mx.Dtype) -> mx.array:
    from chatapp.kernels import qmatmul

    xn = _as_numpy_tokens(x)
    if xn.shape[0] <= route.kernel_max_tokens:
        y = qmatmul.matmul(route.packed, xn)
    else:
        from .numpy_blas import numpy_blas

        scratch = getattr(_scratch, "buf", None)
        if scratch is None:
            scratch = _scratch.buf = qmatmul.Scratch()
        with numpy_blas().single_threaded():  # each kernel thread runs its own blocks' gemms
            y = qmatmul.matmul_dequantized(route.packed, xn, scratch)
    return _from_numpy(y, x.shape[:-1], out_dtype)


def scales_for_kernels(a: mx.array) -> mx.array:
    """Scales or biases as the kernels read them, evaluated: float32 as they are, float16 as their
    uint16 bits where the CPU converts half floats natively, anything else converted to float32."""
    from chatapp.kernels import half_scales_native

    if a.dtype == mx.float16 and half_scales_native():
        a = a.view(mx.uint16)
    elif a.dtype != mx.float32:
        a = a.astype(mx.float32)
    mx.eval(a)
    return a


def packed_view(weight: mx.array | np.ndarray, scales: mx.array, biases: mx.array, bits: int, group_size: int):
    """numpy views (no copies) of a quantised weight for the kernels (scales: scales_for_kernels);
    the weight may already be host bytes (fused_layers.widened)."""
    from chatapp.kernels.qmatmul import PackedWeight

    if isinstance(weight, mx.array):
        mx.eval(weight)
    return PackedWeight(np.asarray(weight).view(np.uint8), np.asarray(scales_for_kernels(scales)),
                        np.asarray(scales_for_kernels(biases)), bits, group_size)


class _Routed:
    """Shared logic of the patched linear and embedding layers."""

    routing: Route

    def _dequantized(self) -> mx.array:
        return mx.dequantize(
            self["weight"], scales=self["scales"], biases=self.get("biases"), group_size=self.group_size,
            bits=self.bits, mode=self.mode, dtype=mx.float32,
        )

    def _project(self, x: mx.array) -> mx.array | None:
        """The routed result, or None when MLX's quantized_matmul is the route for this call."""
        # quantized_matmul returns the promotion of the activation and scale dtypes.
        out_dtype = mx.result_type(x.dtype, self["scales"].dtype)
        route = self.routing
        if route.output_head and x.ndim == 3 and x.shape[1] > 1 and _last_position_only.get():
            last = self._project(x[:, -1:, :])
            if last is None:
                last = self._mlx_product(x[:, -1:, :])
            rest = mx.zeros((x.shape[0], x.shape[1] - 1, last.shape[-1]), last.dtype)
            return mx.concatenate([rest, last], axis=1)
        if route.kind in ("kernel", "dense"):
            return matmul(route, x, out_dtype)
        if _tokens(x) > route.threshold:
            return _dense_matmul(x, self._dequantized(), out_dtype)
        return None

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in) of the full-precision weight."""
        out, packed_in = self["weight"].shape
        return out, packed_in * 32 // self.bits

    @property
    def dense_nbytes(self) -> int:
        out, inp = self.shape
        return out * inp * 4

    def kernel_unsupported(self, min_elements: int = NUMPY_MIN_ELEMENTS) -> str | None:
        """None when the packed kernels can run this layer, else why not."""
        from chatapp.kernels.qmatmul import unsupported

        if self.get("biases") is None:
            return f"quantisation mode {self.mode!r} has no biases (kernels: affine)"
        out, inp = self.shape
        if out * inp < min_elements:
            side = int(min_elements**0.5)
            return f"under {side}x{side}: handing it to a kernel costs more than MLX's product"
        return unsupported(self.bits, self.group_size, inp, self.mode)

    def use_kernel(self, kernel_max_tokens: int) -> None:
        self._drop_dense()
        self.routing.packed = packed_view(self["weight"], self["scales"], self["biases"], self.bits, self.group_size)
        self.routing.kernel_max_tokens = kernel_max_tokens
        self.routing.kind = "kernel"

    def keep_dense(self) -> None:
        w = self._dequantized()
        mx.eval(w)
        route = self.routing
        route.packed = None
        route.dense = w
        # numpy reads the same buffer (no copy); the mx.array above keeps it alive
        use_numpy = route.numpy_matvec and w.size >= NUMPY_MIN_ELEMENTS
        route.dense_np = np.asarray(w) if use_numpy else None
        route.kind = "dense"

    def use_mlx(self) -> None:
        self._drop_dense()
        self.routing.packed = None
        self.routing.kind = "mlx"

    def _drop_dense(self) -> None:
        self.routing.dense = None
        self.routing.dense_np = None

    def drop_dense(self) -> None:
        if self.routing.kind == "dense":
            self.use_mlx()

    @property
    def has_dense(self) -> bool:
        return self.routing.dense is not None

    @property
    def route(self) -> str:
        return self.routing.kind


    def _mlx_product(self, x: mx.array) -> mx.array:
        raise NotImplementedError


class CpuQuantizedLinear(_Routed, nn.QuantizedLinear):
    """`nn.QuantizedLinear` with the same parameters and the CPU routes above."""

    def __init__(self, src: nn.QuantizedLinear, threshold: int = 16, numpy_matvec: bool = True):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = src.group_size, src.bits, src.mode
        self.weight = src["weight"]
        self.scales = src["scales"]
        self.biases = src.get("biases")
        if "bias" in src:
            self.bias = src["bias"]
        self.freeze()
        self.routing = Route(threshold=threshold, numpy_matvec=numpy_matvec)

    def __call__(self, x: mx.array) -> mx.array:
        y = self._project(x)
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y

    def _mlx_product(self, x: mx.array) -> mx.array:
        return nn.QuantizedLinear.__call__(self, x)


class CpuQuantizedEmbedding(_Routed, nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output head) takes the routes above."""

    def __init__(self, src: nn.QuantizedEmbedding, threshold: int = 16, numpy_matvec: bool = True,
                 act: mx.Dtype | None = None):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = src.group_size, src.bits, src.mode
        self.num_embeddings, self.dims = src.num_embeddings, src.dims
        self.weight = src["weight"]
        self.scales = src["scales"]
        self.biases = src.get("biases")
        self.freeze()
        self.routing = Route(threshold=threshold, numpy_matvec=numpy_matvec)
        self._act = act

    def __call__(self, x: mx.array) -> mx.array:
        dense = self.routing.dense
        if dense is not None and self["scales"].dtype == mx.float32:
            return dense[x]  # the same rows dequantize() would produce
        act = self._act
        if act is None or self["scales"].dtype == act:
            return super().__call__(x)
        # Rows dequantised at the activations' dtype, as a load that casts the scales gives them.
        # Float16 rows would carry on down a residual stream that never meets a float32 add:
        # Gemma's clip_residual keeps a float16 stream in float16, and its ~2,000-sized
        # activations then lose three digits (perplexity 14.8 against 13.9).
        biases = self.get("biases")
        return mx.dequantize(
            self["weight"][x], scales=self["scales"][x].astype(act),
            biases=None if biases is None else biases[x].astype(act),
            group_size=self.group_size, bits=self.bits, mode=self.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        y = self._project(x)
        return super().as_linear(x) if y is None else y

    def _mlx_product(self, x: mx.array) -> mx.array:
        return nn.QuantizedEmbedding.as_linear(self, x)


class CastingEmbedding(nn.Embedding):
    """A float embedding table kept in the checkpoint's dtype whose looked-up rows are cast to
    the activations' dtype: the same values as casting the whole table first (float16 and
    bfloat16 convert exactly to float32), at half the memory (Llama-2-7B: 0.26 instead of
    0.52 GB). Only for tables that serve lookups alone (the model has its own output head)."""

    def __init__(self, src: nn.Embedding, dtype: mx.Dtype):
        nn.Module.__init__(self)
        self.weight = src["weight"]
        self.freeze()
        self._dtype = dtype

    def __call__(self, x: mx.array) -> mx.array:
        return self["weight"][x].astype(self._dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self["weight"].astype(self._dtype).T


# ---- public entry points for benches and tools (the layers above use these, not the privates) ----


def matmul(route: Route, x: mx.array, out_dtype: mx.Dtype = mx.float32) -> mx.array:
    """``x @ W.T`` the way ``route`` computes it: the packed kernels (``kind="kernel"``), or the dense
    float32 copy (``kind="dense"``; numpy's sgemv for one token when ``dense_np`` is set)."""
    if route.kind == "kernel":
        return kernel_matmul(x, route, out_dtype)
    if route.kind == "dense":
        if route.dense_np is not None and _tokens(x) == 1:
            return _numpy_matvec(x, route.dense_np, out_dtype)
        return _dense_matmul(x, route.dense, out_dtype)
    raise ValueError(f"matmul: route {route.kind!r} has no product of its own (MLX's quantized_matmul)")


def is_routed(module) -> bool:
    """A layer :func:`chatapp.backend.cpu.accelerate_model` replaced (a CpuQuantizedLinear or
    CpuQuantizedEmbedding)."""
    return isinstance(module, _Routed)
