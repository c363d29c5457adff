"""What the int8 kernel tests share: random MLX-quantised 4-bit (or 8-bit) weights, their float dequantisation
from the scales and biases exactly as the kernels read them (float32, or float16 bits), and the
instruction sets this host can run."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from chatapp.kernels.int8dot import ISAS, detect_isa


def runnable_isas() -> list[str]:
    """The host's instruction and every weaker one (each CPU that has one has the next)."""
    return list(ISAS[ISAS.index(detect_isa()):])


def quantized(seed: int, n: int, k: int, gs: int, half: bool, bits: int = 4):
    """An MLX-quantised weight: (bytes, scales, biases as the kernels read them, dequantised)."""
    w = mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    deq = np.array(mx.dequantize(wq, s, b, group_size=gs, bits=bits))
    packed = np.array(wq).view(np.uint8).reshape(n, k * bits // 8)
    s, b = np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))
    if half:  # the kernels read float16 bits: dequantise with the rounded scales
        s, b = s.astype(np.float16).view(np.uint16), b.astype(np.float16).view(np.uint16)
        deq = dequant(packed, s, b, gs, bits)
    return packed, s, b, deq


def as_f32(a):
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


def dequant(packed, s, b, gs, bits: int = 4):
    if bits == 8:
        q = packed.astype(np.float32)
    else:
        q = np.empty((packed.shape[0], packed.shape[1] * 2), np.float32)
        q[:, 0::2], q[:, 1::2] = packed & 15, packed >> 4
    return q * np.repeat(as_f32(s), gs, 1) + np.repeat(as_f32(b), gs, 1)
