"""The thread count of numpy's own BLAS (the OpenBLAS bundled in numpy's wheel).

The CPU fast path runs two kinds of products through numpy: single-token matvecs in decode
(`cpu.py`: numpy's sgemv is ~4x faster than MLX's M=1 sgemm) and the small products of the
prefill attention kernel (`cpu_attention.py`). numpy's BLAS is a second OpenBLAS next to the one
MLX uses, each with its own thread pool whose threads spin for a while after a call. When the
two alternate within milliseconds (prefill: MLX's dense weight products, then numpy's attention,
layer after layer) the spinning pools fight over the cores: on two cores a prefill became up to
4x slower and bimodal. So the attention kernel runs numpy's BLAS on one thread
(`single_threaded()`), and decode keeps numpy's default (all cores), where MLX's BLAS is idle.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
from typing import Callable, Iterator

import numpy as np

_SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_", "openblas_set_num_threads")
_GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
            "openblas_get_num_threads64_", "openblas_get_num_threads")


class NumpyBlas:
    """ctypes handles on numpy's bundled OpenBLAS (none when numpy uses another BLAS)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._set: Callable | None = None
        self._get: Callable | None = None
        self._lib: ctypes.CDLL | None = None
        libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
        for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas*"))
                           + glob.glob(os.path.join(libs, "libopenblas*"))):
            try:
                lib = ctypes.CDLL(path)  # numpy has it loaded already: the same handle
            except OSError:
                continue
            setter = next((getattr(lib, n) for n in _SETTERS if hasattr(lib, n)), None)
            getter = next((getattr(lib, n) for n in _GETTERS if hasattr(lib, n)), None)
            if setter is not None and getter is not None:
                self.path, self._set, self._get, self._lib = path, setter, getter, lib
                setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
                return

    @property
    def found(self) -> bool:
        return self._set is not None

    def threads(self) -> int | None:
        return self._get() if self._get is not None else None

    def describe(self) -> str:
        """"numpy's bundled OpenBLAS 0.3.31 (SkylakeX kernels, 2 threads)", for the plan."""
        if self._lib is None:
            return "numpy's BLAS (not a bundled OpenBLAS)"
        config = self._string(("scipy_openblas_get_config64_", "scipy_openblas_get_config", "openblas_get_config"))
        core = self._string(("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"))
        version = config.split()[1] if config.startswith("OpenBLAS ") and len(config.split()) > 1 else ""
        detail = ", ".join(x for x in (f"{core} kernels" if core else "", f"{self.threads()} threads") if x)
        return f"numpy's bundled OpenBLAS{' ' + version if version else ''} ({detail})"

    def _string(self, names: tuple[str, ...]) -> str:
        fn = next((getattr(self._lib, n) for n in names if hasattr(self._lib, n)), None)
        if fn is None:
            return ""
        fn.restype = ctypes.c_char_p
        return (fn() or b"").decode(errors="replace").strip()

    def set_threads(self, n: int) -> None:
        if self._set is not None:
            self._set(n)

    @contextlib.contextmanager
    def single_threaded(self) -> Iterator[None]:
        before = self.threads()
        if before is None or before == 1:
            yield
            return
        self._set(1)
        try:
            yield
        finally:
            self._set(before)


_instance: NumpyBlas | None = None


def numpy_blas() -> NumpyBlas:
    global _instance
    if _instance is None:
        _instance = NumpyBlas()
    return _instance
