"""CPU kernels on MLX's packed weights and KV caches, compiled with numba.

Pure numpy/numba: nothing here imports MLX. ``chatapp.backend`` hands these kernels numpy views
of MLX's arrays. Modules:

- ``qmatmul``: products with 4- and 8-bit affine-quantised weights (decode and prefill).
- ``attention``: single-query attention over float32 and quantised KV caches.
- ``pool``: the threads that share a kernel's chunks without waiting on a busy core.
- ``llvm``: small LLVM-IR helpers that keep the inner loops vectorisable.

numba compiles for the machine it runs on (LLVM's host CPU detection), so the same source
becomes AVX-512, AVX2 or NEON code as the CPU allows; nothing assumes a feature. Compiled code is
cached on disk (``cache=True``, in a folder named for this source: cache_dir.py): the first start
on a machine compiles (seconds), later ones load.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field

from .cache_dir import use_kernel_cache_dir

use_kernel_cache_dir()  # before any kernel module defines a cached function (cache_dir.py: why)


@dataclass
class KernelInfo:
    """Whether the kernels can run here, and on what."""

    ok: bool
    reason: str = ""
    numba: str = ""
    cpu: str = ""
    features: list[str] = field(default_factory=list)  # the SIMD features LLVM will use
    threads: int = 0

    def summary(self) -> str:
        if not self.ok:
            return f"kernels: off ({self.reason})"
        simd = ", ".join(self.features) or "no SIMD beyond the baseline"
        return f"kernels: numba {self.numba} on {self.cpu} ({simd}), {self.threads} threads"


_SIMD = ("avx512vnni", "avx512bw", "avx512f", "avx2", "fma", "f16c", "neon", "sve", "dotprod")


def kernel_info() -> KernelInfo:
    """Probe numba and the host CPU without compiling anything."""
    if importlib.util.find_spec("numba") is None:
        return KernelInfo(False, "numba is not installed (pip install numba)")
    try:
        import numba
        from llvmlite import binding as llvm

        from .pool import pool

        cpu = llvm.get_host_cpu_name()
        feats = llvm.get_host_cpu_features()
        enabled = {f[1:] for f in feats.flatten().split(",") if f.startswith("+")}
    except Exception as e:  # a broken numba/llvmlite install: say so, run without kernels
        return KernelInfo(False, f"numba could not start: {type(e).__name__}: {e}")
    return KernelInfo(True, "ok", numba.__version__, cpu, [f for f in _SIMD if f in enabled], pool().threads)


@functools.lru_cache(maxsize=None)
def half_scales_native() -> bool:
    """Whether the kernels may read float16 scales as uint16 bits: LLVM converts them with one
    instruction where the CPU has one (F16C on x86-64, always on aarch64); elsewhere the
    conversion would need a runtime helper that numba's JIT does not provide, so callers convert
    such scales to float32 once instead."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    try:
        from llvmlite import binding as llvm

        return "+f16c" in llvm.get_host_cpu_features().flatten().split(",")
    except Exception:  # no way to tell: take the safe route
        return False
