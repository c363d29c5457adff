"""The RoPE variants the fused steps serve (backend/fused_support.rope_frequencies): Llama 3's
per-frequency scaling (mlx-lm's Llama3RoPE, GGUF's ``rope_freqs``) turns each pair as MLX's
``mx.fast.rope(freqs=...)`` does, so the fused model's logits equal MLX's route past the
original context where the scaling matters; other RoPE modules are refused with their name."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE  # noqa: E402

from cache import CacheSettings, make_caches  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.fused_support import fused_unsupported, rope_frequencies  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from tests.fused_llama import SHAPE, _no_leftover_kernels, small_llama  # noqa: E402, F401

# Llama 3.1's rule with an original context of 64 tokens, so most pairs are scaled within a short test
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama3(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:
        layer.self_attn.rope = Llama3RoPE(SHAPE.head_dim, 4096, False, SHAPE.rope_theta, SCALING)
    return model


def test_llama3_frequencies_turn_as_mlx_does():
    rope = Llama3RoPE(SHAPE.head_dim, 4096, False, SHAPE.rope_theta, SCALING)
    inv = rope_frequencies(rope, SHAPE.head_dim)
    assert isinstance(inv, np.ndarray) and inv.shape == (SHAPE.head_dim // 2,)
    x = mx.random.normal((1, 1, 1, SHAPE.head_dim))
    got = np.array(rope(x, offset=300))[0, 0, 0]
    theta = 300 * inv.astype(np.float64)
    h = SHAPE.head_dim // 2
    a, b = np.array(x)[0, 0, 0, :h], np.array(x)[0, 0, 0, h:]
    want = np.concatenate([a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)])
    np.testing.assert_allclose(got, want, atol=2e-4)
    plain = rope_frequencies(nn.RoPE(SHAPE.head_dim, base=SHAPE.rope_theta), SHAPE.head_dim)
    assert not np.allclose(inv, plain)  # the scaling really moved the low frequencies


@pytest.mark.parametrize("mode", ["prealloc", "window-quant"])
def test_a_llama3_model_runs_fused_with_mlx_logits(mode):
    ref, fast = _llama3(small_llama()), _llama3(small_llama())
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert is_fused(fast) and fused_unsupported(fast) is None
    s = CacheSettings(mode=mode, sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16, kv_group_size=32)
    caches = [make_caches(m, s) for m in (ref, fast)]
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, SHAPE.vocab_size, 90)]
    outs = []
    for m, c in zip((ref, fast), caches):
        with last_position_only():
            outs.append(np.array(m(mx.array([prompt]), cache=c)[0, -1]))
    tol = 5e-3 if mode == "window-quant" else 2e-4
    assert np.abs(outs[1] - outs[0]).max() <= tol * max(1.0, np.abs(outs[0]).max())
    for t in rng.integers(0, SHAPE.vocab_size, 12):
        a, b = (np.array(m(mx.array([[int(t)]]), cache=c)[0, -1]) for m, c in zip((ref, fast), caches))
        assert np.abs(b - a).max() <= tol * max(1.0, np.abs(a).max())


def test_other_rope_modules_are_refused_by_name():
    m = small_llama()
    for layer in m.model.layers:
        layer.self_attn.rope = SuScaledRoPE(SHAPE.head_dim, max_position_embeddings=4096,
                                            original_max_position_embeddings=64, short_factor=1.0, long_factor=2.0)
    assert "SuScaledRoPE" in fused_unsupported(m)
    assert "8 of the head's 32" in rope_frequencies(nn.RoPE(8), SHAPE.head_dim)
