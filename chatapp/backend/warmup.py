"""Compile the kernels a plan uses before the first reply needs them.

numba compiles a kernel for each combination of argument types on its first call: 1-3 s per
kernel the first time on a machine, then ~0.1 s to load it from numba's on-disk cache. Calling
the same glue code on tiny arrays of the same dtypes and layouts at load time moves that cost
out of the first reply's time to first token.
"""

from __future__ import annotations

import time
from typing import Iterable

import mlx.core as mx


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
