"""The CPU fast path: which route each quantised layer's products take on MLX's CPU backend.

On MLX's CPU backend `quantized_matmul` neither batches over tokens nor runs fast for one
token (~1.1 G weights/s: 15 ms for a 4096x4096 4-bit product, 6.5 s per token for a 7B model),
and the wheel's BLAS is the reference one. `accelerate_model` swaps every quantised layer for a
subclass with the same parameters (qlinear.py) and gives each one a route:

- ``kernel`` (the default wherever it applies): numba kernels on the packed 4-/8-bit weights
  for decode, dequantise-a-block + numpy's bundled OpenBLAS gemm for prefill
  (`chatapp.kernels`). Weights stay at their quantised size; nothing but `pip install` needed.
- ``dense``: a float32 copy per layer (8x the 4-bit bytes) through the BLAS; kept when asked
  for (``dense_weights="on"``), or under ``"auto"`` when the kernels are unavailable and an
  optimised BLAS is loaded, while the copies fit the budget.
- ``mlx``: MLX's own products; for what the kernels do not cover (see the plan's reasons).

`apply_fast_path` adds the attention kernels: numpy for prefill chunks (cpu_attention.py), the
numba single-query kernels for decode steps (decode_attention.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

# The one list of each [cpu] choice lives in config (MLX-free, read by the CLI too).
from chatapp.config import DENSE_WEIGHT_MODES, KERNEL_MODES, KV_DTYPES, NUMERICS  # noqa: E402

from .params import activation_dtype
from .qlinear import (
    NUMPY_MIN_ELEMENTS,
    ROUTES,
    CastingEmbedding,
    CpuQuantizedEmbedding,
    CpuQuantizedLinear,
)

KERNEL_MAX_TOKENS = 4  # packed-weight products up to this many tokens; dequantise + gemm above


@dataclass
class LayerRoute:
    """One patched layer: where it is, what it holds and which route it takes, and why."""

    name: str
    route: str
    why: str
    bits: int
    group_size: int
    shape: tuple[int, int]  # (out, in)

    @property
    def kind(self) -> str:
        """The layer's role, from its name: "q_proj", "lm_head", "embed_tokens (tied head)"..."""
        leaf = self.name.rsplit(".", 1)[-1]
        return f"{leaf} (tied head)" if leaf == "embed_tokens" else leaf


@dataclass
class CpuPlan:
    """What `accelerate_model` did to a model."""

    backend: str
    applied: bool
    reason: str
    blas_loaded: bool = False
    blas: str | None = None
    kernels: str = ""  # KernelInfo.summary()
    kernels_ok: bool = False  # the kernels can run here (numba present, cpu.kernels not off)
    gemm: str = ""  # the BLAS the kernels' prefill gemms run on
    dense_prefill_threshold: int = 16
    dense_weights: str = "auto"
    numpy_matvec: bool = True
    kernel_max_tokens: int = KERNEL_MAX_TOKENS
    dense_bytes: int = 0  # float32 copies kept in memory
    dense_bytes_wanted: int = 0  # what keeping every layer dense would take
    budget_bytes: int = 0
    layers: list[str] = field(default_factory=list)  # patched QuantizedLinear layers
    embeddings: list[str] = field(default_factory=list)  # patched QuantizedEmbedding layers
    dense_layers: list[str] = field(default_factory=list)  # the ones with a kept float32 copy
    numpy_matvec_layers: list[str] = field(default_factory=list)  # of those, 1-token calls via numpy
    kernel_layers: list[str] = field(default_factory=list)
    routes: list[LayerRoute] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    attention: str = ""  # set by apply_fast_path: the prefill and decode attention routes
    fused_decode: str = ""  # whether single-token steps run as one native call per token, or why not
    warm_up_seconds: float = 0.0  # compiling / loading the kernels the plan uses
    cast_lookups: list[str] = field(default_factory=list)  # embedding tables kept as stored, rows cast

    def route_lines(self) -> list[str]:
        """One line per route and reason, naming the kinds of layer that take it:
        "q_proj x32, k_proj x32, ..., lm_head: kernel (4-bit, group 64)"."""
        groups: dict[tuple, dict[str, int]] = {}
        for r in self.routes:
            key = (r.route, f"{r.bits}-bit, group {r.group_size}", r.why if r.route != "kernel" else "")
            kinds = groups.setdefault(key, {})
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        lines = []
        for (route, detail, why), kinds in groups.items():
            names = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())
            lines.append(f"{names}: {route} ({detail}{'; ' + why if why else ''})")
        return lines

    def summary(self) -> str:
        tail = "".join(f"; {t}" for t in (self.attention, self.fused_decode) if t)
        if not self.applied:
            return f"cpu fast path: off ({self.reason}){tail}"
        total = len(self.layers) + len(self.embeddings)
        counts = ", ".join(f"{n} {route}" for route in ROUTES
                           if (n := sum(r.route == route for r in self.routes)))
        parts = [f"cpu fast path: {total} quantised layers ({counts})"]
        if self.kernel_layers:
            parts.append(f"packed kernels up to {self.kernel_max_tokens} tokens, dequantise + gemm above")
        if self.dense_layers:
            gib = 1024**3
            parts.append(f"float32 copies {self.dense_bytes / gib:.2f} GiB of {self.budget_bytes / gib:.2f} GiB budget")
        if any(r.route == "mlx" for r in self.routes):
            parts.append(f"MLX dense above {self.dense_prefill_threshold} tokens")
        parts.append(self.kernels)
        if self.gemm:
            parts.append(f"prefill gemm: {self.gemm}")
        parts.append(f"MLX's BLAS: {'optimised' if self.blas_loaded else 'bundled reference'}")
        return "; ".join(p for p in parts if p) + tail

    def headline(self) -> str:
        """The summary without its "cpu fast path:" label."""
        return self.summary().removeprefix("cpu fast path: ")

    def details(self) -> list[str]:
        """The summary, then the route of each kind of layer and why (for --verbose and notes)."""
        return [self.summary(), *(f"  {line}" for line in self.route_lines())]


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
    kernels: str = "auto",
    kernel_max_tokens: int = KERNEL_MAX_TOKENS,
    threads: int = 0,
    kernel_min_elements: int = NUMPY_MIN_ELEMENTS,
    warm_up: bool = True,
    fused_decode: bool = True,
    numerics: str = "exact",
    kv_dtype: str = "auto",
    on_slow_warm_up: Callable[[str], None] | None = None,
    precompile: bool = True,
) -> CpuPlan:
    """Give a quantised model's products the CPU fast path; a no-op on other backends.

    backend: the backend the model runs on ("cpu", "metal", "cuda"); anything but "cpu" leaves
    the model untouched. kernels: "auto" uses the packed-weight kernels for every layer they
    support (numba installed, affine 4/8-bit, group 32/64/128, input width a multiple of 64,
    at least 1024x1024); "off" never. kernel_max_tokens: calls with up to this many tokens run
    the packed kernels, longer ones dequantise blocks + gemm. threads: kernel threads (0: one
    per core). kernel_min_elements: smaller weights stay on MLX (a kernel call's sync costs
    more than they save; tests lower it). warm_up: compile (or load from numba's disk cache) the
    kernels the plan uses now rather than in the first reply. fused_decode: a Llama-style model
    whose projections the kernels all support runs each single-token step as one native call
    (fused_decode.py); every supported projection then takes the kernel route, since
    decode no longer pays a dispatch per small layer. numerics: "exact", "fast" (the fused
    step's 4-bit rows against int8-quantised activations, kernels/int8dot.py) or "auto" (fast
    where the CPU has VNNI or AVX2, fused_settings.resolve_numerics). kv_dtype: the K/V buffers the fused
    routes make, "float16", "float32" or "auto" (float16 where the CPU has F16C,
    fused_settings.resolve_kv_dtype). precompile: on a first start, compile the fused prefill kernel
    in a second process meanwhile (precompile.py). on_slow_warm_up: told, from a helper thread, while a warm-up
    runs long (compiling on a first start: warmup.announce_when_slow). dense_weights: "on" keeps a float32 copy
    of every quantised weight and uses it
    for every call; "auto" keeps copies only for layers without a kernel, when an optimised BLAS
    is loaded and while the copies fit ``dense_budget_bytes`` (default: a quarter of physical
    memory); "off" never. dense_prefill_threshold: MLX-routed calls with more tokens than this
    dequantise and use a dense matmul instead of quantized_matmul. numpy_matvec: single-token
    products with a kept float32 copy run through numpy's sgemv (~4x faster than MLX's M=1
    sgemm on the same BLAS).
    """
    backend = (backend or "").lower()
    if dense_weights not in DENSE_WEIGHT_MODES:
        raise ValueError(f"dense_weights must be one of {DENSE_WEIGHT_MODES}, not {dense_weights!r}")
    if kernels not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {kernels!r}")
    if dense_prefill_threshold < 0:
        raise ValueError("dense_prefill_threshold must be >= 0")
    if kernel_max_tokens < 1:
        raise ValueError("kernel_max_tokens must be >= 1")
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, not {numerics!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
    from chatapp.backend.blas import current_blas

    plan = CpuPlan(backend=backend, applied=False, reason="", dense_prefill_threshold=dense_prefill_threshold,
                   dense_weights=dense_weights, numpy_matvec=numpy_matvec, kernel_max_tokens=kernel_max_tokens)
    if backend != "cpu":
        plan.reason = f"backend is {backend!r}; the fast path is for the 'cpu' backend only"
        return plan

    from .heap import return_freed_memory

    return_freed_memory()  # before the kernels' first scratch: see heap.py
    blas = current_blas()
    plan.blas_loaded, plan.blas = blas.loaded, blas.path
    plan.budget_bytes = dense_budget_bytes if dense_budget_bytes is not None else physical_memory_bytes() // 4

    act = activation_dtype(model)
    if act is not None:
        plan.cast_lookups = _cast_lookups(model, act)
    # probed whatever the model holds: the decode attention kernels need it too
    kernels_ok, kernels_why = _kernels_available(kernels, threads, plan)
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    if not targets:
        plan.reason = "the model has no quantised layers"
        return plan
    fuse = None
    if fused_decode and kernels_ok and dense_weights != "on":
        from .fused_support import fused_unsupported

        fuse = fused_unsupported(model)
        if fuse is None:
            kernel_min_elements = 0  # decode dispatches once per token, not once per projection
    targets.sort(key=lambda t: _natural(t[0]))  # model order: layers.2 before layers.10
    targets.sort(key=lambda t: _is_output_head(*t))  # then the head, last
    replaced = {}
    for name, m in targets:
        if isinstance(m, nn.QuantizedEmbedding):
            new = CpuQuantizedEmbedding(m, dense_prefill_threshold, numpy_matvec, act)
            plan.embeddings.append(name)
        else:
            new = CpuQuantizedLinear(m, dense_prefill_threshold, numpy_matvec)
            plan.layers.append(name)
        new.routing.output_head = _is_output_head(name, m)
        replaced[name] = new
        plan.dense_bytes_wanted += new.dense_nbytes
    _set_modules(model, replaced)

    may_copy = dense_weights == "on" or (dense_weights == "auto" and blas.loaded)
    for name, new in replaced.items():
        why_not = kernels_why if not kernels_ok else new.kernel_unsupported(kernel_min_elements)
        if dense_weights != "on" and why_not is None:
            new.use_kernel(kernel_max_tokens)
            plan.kernel_layers.append(name)
            why = "packed-weight kernels"
        elif may_copy and (dense_weights == "on" or plan.dense_bytes + new.dense_nbytes <= plan.budget_bytes):
            new.keep_dense()
            plan.dense_bytes += new.dense_nbytes
            plan.dense_layers.append(name)
            if new.routing.dense_np is not None:
                plan.numpy_matvec_layers.append(name)
            why = "dense_weights = on" if dense_weights == "on" else f"float32 copy ({why_not})"
        else:
            new.use_mlx()
            why = why_not or "dense_weights = on but over budget"
            if may_copy and why_not:
                why = f"{why_not}; float32 copy over budget"
        plan.routes.append(LayerRoute(name, new.route, why, new.bits, new.group_size, new.shape))

    if act is not None:
        _match_scales_to_activations(replaced, plan.kernel_layers, act)
    plan.applied = True
    from .fused_install import install_fused_decode, uninstall_fused_decode
    from .precompile import prefill_types, start_prefill_compile, wait_for
    from .warmup import announce_when_slow, warm_up_kernels

    uninstall_fused_decode(model)
    fusing = fuse is None and fused_decode and kernels_ok and dense_weights != "on"
    with announce_when_slow(on_slow_warm_up if warm_up else None):
        # a first start compiles the prefill kernel in a second process meanwhile (precompile.py)
        child = start_prefill_compile(prefill_types(replaced[plan.kernel_layers[0]], numerics, kv_dtype)) \
            if warm_up and precompile and fusing and plan.kernel_layers else None
        try:
            if warm_up and plan.kernel_layers:
                plan.warm_up_seconds = warm_up_kernels(replaced[n] for n in plan.kernel_layers)
            if fusing:
                start = time.perf_counter()
                plan.fused_decode = install_fused_decode(model, warm_up=warm_up, numerics=numerics,
                                                         kv_dtype=kv_dtype, before_prefill=None if child is None
                                                         else lambda: wait_for(child))
                plan.warm_up_seconds += time.perf_counter() - start
            else:
                plan.fused_decode = f"fused decode: off ({fuse or _fused_off_reason(fused_decode, kernels_ok)})"
        except BaseException:  # a failed or interrupted load leaves no child compiling behind
            if child is not None:
                child.kill()
            raise
        finally:
            wait_for(child)  # at once: install_fused_decode waited for it, or it was killed
    reasons = []
    if not kernels_ok:
        reasons.append(kernels_why)
    if dense_weights == "auto" and not blas.loaded and not kernels_ok:
        reasons.append("no float32 copies kept: no optimised BLAS loaded")
    plan.reason = "; ".join(reasons) or "ok"
    big_mlx = [r for r in plan.routes if r.route == "mlx" and r.shape[0] * r.shape[1] >= NUMPY_MIN_ELEMENTS]
    if big_mlx:
        why = "; ".join(sorted({r.why for r in big_mlx}))
        plan.warnings.append(
            f"{len(big_mlx)} large quantised layers run on MLX's quantized_matmul ({why}): decode through them "
            "is ~20x slower than through the kernels")
    kernel_params = {f"{n}.{leaf}" for n in plan.kernel_layers for leaf in ("scales", "biases")}
    kernel_params |= {f"{n}.weight" for n in plan.cast_lookups}
    low = sorted({str(p.dtype) for path, p in _flat_params(model) if mx.issubdtype(p.dtype, mx.floating)
                  and p.dtype != mx.float32 and path not in kernel_params})
    if low:
        plan.warnings.append(
            f"floating parameters in {', '.join(low)}: activations will not be float32, and "
            "quantized_matmul on the CPU is 7-30x slower in half precision; cast the model to float32"
        )
    return plan


def _fused_off_reason(fused_decode: bool, kernels_ok: bool) -> str:
    if not fused_decode:
        return "cpu.fused_decode = false"
    return "no kernels" if not kernels_ok else "dense_weights = on"


def _is_output_head(name: str, module: nn.Module) -> bool:
    """A tied embedding (its as_linear is the head) or the model's last projection."""
    return isinstance(module, nn.QuantizedEmbedding) or name.rsplit(".", 1)[-1] in ("lm_head", "output")


def _kernels_available(kernels: str, threads: int, plan: CpuPlan) -> tuple[bool, str | None]:
    """(usable, why not); fills the plan's kernel and gemm descriptions."""
    if kernels == "off":
        plan.kernels = "kernels: off (cpu.kernels = off)"
        return False, "cpu.kernels = off"
    from chatapp.kernels import kernel_info
    from chatapp.kernels.pool import set_threads

    info = kernel_info()
    if info.ok:
        info.threads = set_threads(threads or None).threads
    plan.kernels = info.summary()
    if not info.ok:
        return False, info.reason
    from chatapp.backend.numpy_blas import numpy_blas

    plan.gemm = numpy_blas().describe()
    plan.kernels_ok = True
    return True, None


def _match_scales_to_activations(layers: dict[str, nn.Module], kernel_layers: list[str], act) -> None:
    """Layers MLX runs get scales/biases in the activations' dtype.

    The loader may leave quantised layers' scales in the checkpoint's float16
    (``load_model(cast_scales=False)``): the kernels read them as they are (half the bytes of
    float32), but MLX's CPU ``quantized_matmul`` is 2x slower with float16 scales next to
    float32 activations (measured: 29 against 15 ms for a 4096x4096 4-bit product)."""
    keep = set(kernel_layers)
    for name, layer in layers.items():
        if name in keep:
            continue
        for leaf in ("scales", "biases"):
            p = layer.get(leaf)
            if p is not None and p.dtype != act:
                setattr(layer, leaf, p.astype(act))
                mx.eval(layer[leaf])


def _cast_lookups(model: nn.Module, act) -> list[str]:
    """Lookup-only embedding tables left in another dtype by the loader cast the rows they
    return (CastingEmbedding) instead of being copied whole; returns their names."""
    from .params import lookup_only_embeddings

    tables = {path.removesuffix(".weight") for path in lookup_only_embeddings(model)}
    swap = {name: CastingEmbedding(m, act) for name, m in model.named_modules()
            if name in tables and type(m) is nn.Embedding and m["weight"].dtype != act}
    _set_modules(model, swap)
    return sorted(swap)


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
    for the weight products, the numpy prefill attention kernel (`cpu_attention.py`) and the
    decode attention kernels (`decode_attention.py`, with the packed-weight kernels).
    A no-op on other backends (and it removes kernels installed earlier)."""
    from chatapp.backend.cpu_attention import install_prefill_attention
    from chatapp.backend.decode_attention import install_decode_attention

    plan = accelerate_model(model, backend=backend, **options)
    attention = [install_prefill_attention(backend, fast_attention)]
    attention.append(install_decode_attention(fast_attention and plan.kernels_ok))
    plan.attention = "; ".join(attention)
    return plan
