"""The CPU fast path: dense float32 matmuls through the BLAS instead of 4-bit `quantized_matmul`.

On MLX's CPU backend `quantized_matmul` neither uses the BLAS nor batches over tokens: a prompt
of T tokens costs about T single-token products. A dequantised weight and one dense matmul
(`x @ w.T`, an sgemm) costs one dequantisation plus a BLAS call that OpenBLAS runs at ~90 GFLOP/s
on two cores. `accelerate_model` swaps every `nn.QuantizedLinear` / `nn.QuantizedEmbedding` of a
model for a subclass that picks the faster route per call; the parameters are unchanged (same
names, same arrays), so weights, saving and `model.parameters()` are unaffected.

Threshold, measured on this 2-core x86_64 box (2048x2048 4-bit layer, group 64, float32
activations, best of 5, ms; "deq+dense" dequantises on every call, "kept" reuses a float32 copy):

    tokens        1     2     4     8    16    32    64   (128)
    qmm         3.7   7.8  15.5  30.9  60.1   121   235    474
    deq+dense  14.7  14.6  15.3  14.8  11.9  13.0  15.0   20.4   with OpenBLAS
    kept dense  3.7   4.1   4.7   4.8   4.4   5.5   8.0   13.2   with OpenBLAS
    deq+dense  11.0  14.7  21.4  36.1  63.5   127   227    459   reference BLAS (no OpenBLAS)

With OpenBLAS, dequantise-then-matmul breaks even with qmm at ~4 tokens and is 5x faster at 16;
with the reference BLAS it never wins by much (equal at ~64). The default threshold, 16, keeps
the 1-8 token calls (decode, short speculative batches), where the gain is small and
shape-dependent, on qmm. With a kept float32 copy the dense route is as fast as or faster than
qmm for every token count, so it is used for all calls.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

DENSE_WEIGHT_MODES = ("auto", "on", "off")

# Weights at least this large (out x in) take numpy's sgemv for one token. Each numpy call
# evaluates its input (a sync, ~20-60 us), which small products cannot repay: per product in a
# chain of 8, MLX vs numpy took 23 vs 63 us at 512x512, 42 vs 49 us at 768x768 and 366 vs 62 us
# at 1024x1024 (where OpenBLAS's M=1 sgemm turns slow). stories260K (64 wide) decodes at ~560
# tokens/s through MLX and ~360 through numpy.
NUMPY_MATVEC_MIN_ELEMENTS = 1024 * 1024


@dataclass
class CpuPlan:
    """What `accelerate_model` did to a model."""

    backend: str
    applied: bool
    reason: str
    blas_loaded: bool = False
    blas: str | None = None
    dense_prefill_threshold: int = 16
    dense_weights: str = "auto"
    numpy_matvec: bool = True
    dense_bytes: int = 0  # float32 copies kept in memory
    dense_bytes_wanted: int = 0  # what keeping every layer dense would take
    budget_bytes: int = 0
    layers: list[str] = field(default_factory=list)  # patched QuantizedLinear layers
    embeddings: list[str] = field(default_factory=list)  # patched QuantizedEmbedding layers
    dense_layers: list[str] = field(default_factory=list)  # the ones with a kept float32 copy
    numpy_matvec_layers: list[str] = field(default_factory=list)  # of those, 1-token calls via numpy
    warnings: list[str] = field(default_factory=list)
    attention: str = ""  # set by whoever installs the prefill attention kernel (cpu_attention.py)

    def summary(self) -> str:
        tail = f"; {self.attention}" if self.attention else ""
        if not self.applied:
            return f"cpu fast path: off ({self.reason}){tail}"
        gib = 1024**3
        return (
            f"cpu fast path: {len(self.layers)} linear + {len(self.embeddings)} embedding layers, "
            f"dense above {self.dense_prefill_threshold} tokens; float32 copies of "
            f"{len(self.dense_layers)}/{len(self.layers) + len(self.embeddings)} layers "
            f"({self.dense_bytes / gib:.2f} GiB of {self.budget_bytes / gib:.2f} GiB budget)"
            f"{f', {len(self.numpy_matvec_layers)} decode through numpy sgemv' if self.numpy_matvec_layers else ''}; "
            f"BLAS {'loaded' if self.blas_loaded else 'NOT loaded (reference BLAS)'}{tail}"
        )


class _Fast:
    """Per-layer state, kept outside the module's parameter tree (not an mx.array attribute)."""

    __slots__ = ("threshold", "dense", "dense_np", "numpy_matvec")

    def __init__(self, threshold: int, dense: mx.array | None, numpy_matvec: bool = True):
        self.threshold = threshold
        self.dense = dense
        self.dense_np: np.ndarray | None = None  # a view of ``dense`` (same memory) for numpy's sgemv
        self.numpy_matvec = numpy_matvec


def _tokens(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


def _numpy_matvec(x: mx.array, w: np.ndarray, out_dtype: mx.Dtype) -> mx.array:
    """One token times w[out, in]^T through numpy's sgemv (evaluates ``x`` first)."""
    xn = np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32))
    y = mx.array((w @ xn.reshape(-1)).reshape(*x.shape[:-1], w.shape[0]))
    return y if y.dtype == out_dtype else y.astype(out_dtype)


def _dense_matmul(x: mx.array, w: mx.array, out_dtype: mx.Dtype) -> mx.array:
    """x [..., in] times w[out, in]^T as one float32 sgemm over all leading dims."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != mx.float32:
        x2 = x2.astype(mx.float32)
    y = (x2 @ w.T).reshape(*lead, w.shape[0])
    return y if y.dtype == out_dtype else y.astype(out_dtype)


class _DenseRoute:
    """Shared logic of the patched linear and embedding layers."""

    _fast: _Fast

    def _dequantized(self) -> mx.array:
        return mx.dequantize(
            self["weight"],
            scales=self["scales"],
            biases=self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            dtype=mx.float32,
        )

    def _project(self, x: mx.array) -> mx.array | None:
        """The dense result, or None when quantized_matmul is the better route."""
        # quantized_matmul returns the promotion of the activation and scale dtypes.
        out_dtype = mx.result_type(x.dtype, self["scales"].dtype)
        fast = self._fast
        if fast.dense is not None:
            if fast.dense_np is not None and _tokens(x) == 1:
                return _numpy_matvec(x, fast.dense_np, out_dtype)
            return _dense_matmul(x, fast.dense, out_dtype)
        if _tokens(x) > self._fast.threshold:
            return _dense_matmul(x, self._dequantized(), out_dtype)
        return None

    @property
    def dense_nbytes(self) -> int:
        out, packed_in = self["weight"].shape
        return out * (packed_in * 32 // self.bits) * 4

    def keep_dense(self) -> None:
        w = self._dequantized()
        mx.eval(w)
        self._fast.dense = w
        # numpy reads the same buffer (no copy); the mx.array above keeps it alive
        use_numpy = self._fast.numpy_matvec and w.size >= NUMPY_MATVEC_MIN_ELEMENTS
        self._fast.dense_np = np.asarray(w) if use_numpy else None

    def drop_dense(self) -> None:
        self._fast.dense = None
        self._fast.dense_np = None

    @property
    def has_dense(self) -> bool:
        return self._fast.dense is not None


class CpuQuantizedLinear(_DenseRoute, nn.QuantizedLinear):
    """`nn.QuantizedLinear` with the same parameters and a dense-matmul route for the CPU."""

    def __init__(self, src: nn.QuantizedLinear, threshold: int, numpy_matvec: bool = True):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = src.group_size, src.bits, src.mode
        self.weight = src["weight"]
        self.scales = src["scales"]
        self.biases = src.get("biases")
        if "bias" in src:
            self.bias = src["bias"]
        self.freeze()
        self._fast = _Fast(threshold, None, numpy_matvec)

    def __call__(self, x: mx.array) -> mx.array:
        y = self._project(x)
        if y is None:
            return super().__call__(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class CpuQuantizedEmbedding(_DenseRoute, nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output head) takes the dense route."""

    def __init__(self, src: nn.QuantizedEmbedding, threshold: int, numpy_matvec: bool = True):
        nn.Module.__init__(self)
        self.group_size, self.bits, self.mode = src.group_size, src.bits, src.mode
        self.num_embeddings, self.dims = src.num_embeddings, src.dims
        self.weight = src["weight"]
        self.scales = src["scales"]
        self.biases = src.get("biases")
        self.freeze()
        self._fast = _Fast(threshold, None, numpy_matvec)

    def __call__(self, x: mx.array) -> mx.array:
        dense = self._fast.dense
        if dense is not None and self["scales"].dtype == mx.float32:
            return dense[x]  # the same rows dequantize() would produce
        return super().__call__(x)

    def as_linear(self, x: mx.array) -> mx.array:
        y = self._project(x)
        return super().as_linear(x) if y is None else y


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def accelerate_model(
    model: nn.Module,
    *,
    backend: str,
    dense_prefill_threshold: int = 16,
    dense_weights: str = "auto",
    dense_budget_bytes: int | None = None,
    numpy_matvec: bool = True,
) -> CpuPlan:
    """Give a quantised model's matmuls the CPU fast path; a no-op on other backends.

    backend: the backend the model runs on ("cpu", "metal", "cuda"); anything but "cpu" leaves
    the model untouched. dense_prefill_threshold: calls with more tokens (product of the leading
    dims) than this dequantise and use a dense BLAS matmul; smaller ones use quantized_matmul.
    dense_weights: "on" keeps a float32 copy of every quantised weight and uses it for every call
    (decode too); "auto" does so, layer by layer in model order while the copies fit the budget,
    only when an optimised BLAS is loaded (with the reference BLAS a dense matvec is no faster
    than quantized_matmul); "off" never does. dense_budget_bytes defaults to a quarter of the
    machine's physical memory. numpy_matvec: single-token products with a kept float32 copy run
    through numpy's sgemv, which is ~4x faster than MLX's M=1 sgemm on the same BLAS (measured:
    1.0 ms against 4.6 ms for a 5632x2048 weight); from 2 tokens on both are equal.
    """
    backend = (backend or "").lower()
    if dense_weights not in DENSE_WEIGHT_MODES:
        raise ValueError(f"dense_weights must be one of {DENSE_WEIGHT_MODES}, not {dense_weights!r}")
    if dense_prefill_threshold < 0:
        raise ValueError("dense_prefill_threshold must be >= 0")
    from chatapp.backend.blas import current_blas

    plan = CpuPlan(backend=backend, applied=False, reason="", dense_prefill_threshold=dense_prefill_threshold,
                   dense_weights=dense_weights, numpy_matvec=numpy_matvec)
    if backend != "cpu":
        plan.reason = f"backend is {backend!r}; the dense fast path is for the 'cpu' backend only"
        return plan

    blas = current_blas()
    plan.blas_loaded, plan.blas = blas.loaded, blas.path
    plan.budget_bytes = dense_budget_bytes if dense_budget_bytes is not None else physical_memory_bytes() // 4

    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not targets:
        plan.reason = "the model has no quantised layers"
        return plan
    targets.sort(key=lambda t: _natural(t[0]))  # model order: layers.2 before layers.10

    replaced = {}
    for name, m in targets:
        if isinstance(m, nn.QuantizedEmbedding):
            new = CpuQuantizedEmbedding(m, dense_prefill_threshold, numpy_matvec)
            plan.embeddings.append(name)
        else:
            new = CpuQuantizedLinear(m, dense_prefill_threshold, numpy_matvec)
            plan.layers.append(name)
        replaced[name] = new
        plan.dense_bytes_wanted += new.dense_nbytes
    _set_modules(model, replaced)

    keep = dense_weights == "on" or (dense_weights == "auto" and blas.loaded)
    for name, new in replaced.items():
        if not keep:
            break
        if dense_weights == "auto" and plan.dense_bytes + new.dense_nbytes > plan.budget_bytes:
            continue
        new.keep_dense()
        plan.dense_bytes += new.dense_nbytes
        plan.dense_layers.append(name)
        if new._fast.dense_np is not None:
            plan.numpy_matvec_layers.append(name)

    plan.applied = True
    why = []
    if dense_weights == "auto" and not blas.loaded:
        why.append("no float32 copies kept: no optimised BLAS loaded")
    elif dense_weights == "auto" and len(plan.dense_layers) < len(replaced):
        why.append(f"float32 copies of {len(plan.dense_layers)} of {len(replaced)} layers fit the budget")
    plan.reason = "; ".join(why) or "ok"
    if not blas.loaded:
        plan.warnings.append(f"no optimised BLAS: dense matmuls run on MLX's reference BLAS ({blas.reason})")
    low = sorted({str(p.dtype) for _, p in _flat_params(model) if mx.issubdtype(p.dtype, mx.floating)
                  and p.dtype != mx.float32})
    if low:
        plan.warnings.append(
            f"floating parameters in {', '.join(low)}: activations will not be float32, and "
            "quantized_matmul on the CPU is 7-30x slower in half precision; cast the model to float32"
        )
    return plan


def _natural(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def _flat_params(model: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def _set_modules(model: nn.Module, replaced: dict[str, nn.Module]) -> None:
    """Put each module at its dotted path on its parent (modules and dicts by key, lists by index;
    an nn.Module keeps its children as dict items, so one rule covers both)."""
    for path, new in replaced.items():
        *parents, leaf = path.split(".")
        obj = model
        for part in parents:
            obj = obj[int(part)] if isinstance(obj, (list, tuple)) else obj[part]
        obj[int(leaf) if isinstance(obj, list) else leaf] = new


def apply_fast_path(model: nn.Module, *, backend: str, fast_attention: bool = True, **options) -> CpuPlan:
    """Everything the app does for a model on the CPU backend: `accelerate_model(model, **options)`
    for the weight products, and the numpy prefill attention kernel (`cpu_attention.py`).
    A no-op on other backends (and it removes a kernel installed earlier)."""
    from chatapp.backend.cpu_attention import install_prefill_attention

    plan = accelerate_model(model, backend=backend, **options)
    plan.attention = install_prefill_attention(backend, fast_attention)
    return plan
