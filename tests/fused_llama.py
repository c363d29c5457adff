"""What the fused-route tests share: a small random 4-bit Llama (2 layers, 4 heads of 32 over 2 KV
heads, 256 tokens), as MLX runs it or fused on the CPU backend, and the fixture that removes the
process-wide attention kernels a fused model installs, so that no test inherits another's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from cache import install_attention, set_decode_kernels, set_prefill_kernel
from chatapp.backend.cpu import apply_fast_path
from chatapp.model.synthetic import LlamaShape, build_random_llama

SHAPE = LlamaShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, intermediate_size=256, vocab_size=256)


def clear_kernels() -> None:
    """Remove the decode and prefill attention kernels (apply_fast_path installs them process-wide)."""
    set_decode_kernels(None, None)
    set_prefill_kernel(None)


@pytest.fixture(autouse=True)
def _no_leftover_kernels():
    yield
    clear_kernels()


def small_llama(seed: int = 3) -> nn.Module:
    """The random Llama of SHAPE, 4-bit in groups of 32, on chatapp's attention (not fused)."""
    m, _ = build_random_llama(SHAPE, seed=seed, quantize_bits=4, group_size=32)
    mx.eval(m.parameters())
    install_attention(m)
    return m


def fused_small_llama(seed: int = 3, **options) -> nn.Module:
    """small_llama fused on the CPU backend; ``options`` go to apply_fast_path (kv_dtype, ...)."""
    m = small_llama(seed)
    apply_fast_path(m, backend="cpu", warm_up=False, **options)
    return m
