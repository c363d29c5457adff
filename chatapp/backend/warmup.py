"""Compile the kernels a plan uses before the first reply needs them.

numba compiles a kernel for each combination of argument types on its first call: 1-3 s per
kernel the first time on a machine, then ~0.1 s to load it from numba's on-disk cache. Calling
the same glue code on tiny arrays of the same dtypes and layouts at load time moves that cost
out of the first reply's time to first token.

On a CPU numba has not seen (a user's first start) that compile takes tens of seconds (SmolLM2
with numerics fast, 2 cores: ~23 s with the prefill compiling in a second process, precompile.py;
~38 s without); ``announce_when_slow`` says so while it runs, so that a first start does not look
hung.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import mlx.core as mx

# a warm-up that takes longer than this is compiling, not loading from numba's disk cache
# (loading every kernel of a fused SmolLM2 plan takes ~1 s)
SLOW_WARM_UP_S = 2.0
REPEAT_S = 5.0  # how often the running notice is renewed with the time so far


def compiling_line(seconds: float | None = None) -> str:
    """The notice shown while the kernels compile (``seconds`` into it, when renewed)."""
    so_far = f": {seconds:.0f} s so far" if seconds is not None else ""
    return (f"compiling the CPU kernels for this CPU{so_far} (first start only, usually under a minute; "
            "numba keeps them on disk for the next starts)")


def compiled_line(seconds: float) -> str:
    """The load note after a slow warm-up."""
    return (f"CPU kernels ready in {seconds:.0f} s: compiled for this CPU (a first start); "
            "later starts load them from numba's disk cache in about a second")


@contextmanager
def announce_when_slow(on_slow: Callable[[str], None] | None, after_s: float | None = None,
                       every_s: float | None = None) -> Iterator[None]:
    """Run the block; if it still runs after ``after_s`` (SLOW_WARM_UP_S), call
    ``on_slow(compiling_line())`` from a helper thread, then every ``every_s`` (REPEAT_S) with the
    time so far until it ends. numba compiles under the GIL but in Python, so the helper still
    gets its turns. Nothing happens without ``on_slow``."""
    if on_slow is None:
        yield
        return
    after_s = SLOW_WARM_UP_S if after_s is None else after_s
    every_s = REPEAT_S if every_s is None else every_s
    done = threading.Event()
    start = time.perf_counter()

    def announce() -> None:
        if done.wait(after_s):
            return
        on_slow(compiling_line())
        while not done.wait(every_s):
            on_slow(compiling_line(time.perf_counter() - start))

    helper = threading.Thread(target=announce, name="chatapp-warm-up-notice", daemon=True)
    helper.start()
    try:
        yield
    finally:
        done.set()
        helper.join()


def warm_up_kernels(layers: Iterable) -> float:
    """Run each distinct (bits, group size, scale dtype) of ``layers`` through both kernel routes
    on a tiny weight, and the decode attention kernel; returns the seconds it took."""
    from .decode_attention import decode_full, decode_mixed
    from .qlinear import Route, kernel_matmul, packed_view

    start = time.perf_counter()
    seen = set()
    for layer in layers:
        key = (layer.bits, layer.group_size, layer["scales"].dtype)
        if key in seen:
            continue
        seen.add(key)
        bits, group_size, dtype = key
        w = mx.random.normal((16, 128))
        packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        route = Route(kind="kernel", kernel_max_tokens=1)
        route.packed = packed_view(packed, scales.astype(dtype), biases.astype(dtype), bits, group_size)
        for tokens in (1, 2):  # the packed kernel, then dequantise + gemm
            mx.eval(kernel_matmul(mx.zeros((tokens, 128)), route, mx.float32))
    q = mx.zeros((1, 2, 1, 64))
    kv = mx.zeros((1, 1, 8, 64))
    mx.eval(decode_full(q, kv, kv, 0.125, None))
    for bits in (8, 4):  # a window-quant history (kv_bits 8 by default, 4 possible)
        packed = mx.quantize(kv, group_size=32, bits=bits)
        parts = [("full", kv[:, :, :2], kv[:, :, :2]), ("quant", packed, packed), ("full", kv, kv)]
        mx.eval(decode_mixed(q, parts, 0.125, None, bits, 32, None))
    return time.perf_counter() - start
