"""Which architectures the fused steps serve, decided from the layers' modules
(backend/fused_support.fused_unsupported): Qwen2's q/k/v biases and Qwen3's per-head q/k norms
run in the kernels, so those models run fused with MLX's logits over every cache policy; a layer
with modules Llama's block lacks is refused, naming them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from mlx_lm.models import qwen2, qwen3  # noqa: E402

from cache import CacheSettings, install_attention, make_caches  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.fused_support import fused_unsupported  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from chatapp.model.synthetic import randomize  # noqa: E402
from tests.fused_llama import _no_leftover_kernels  # noqa: E402, F401

CONFIG = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256, max_position_embeddings=4096,
              rope_theta=10000.0, tie_word_embeddings=False)


def _qwen2(seed: int = 5):
    config = {"model_type": "qwen2", **CONFIG}
    m = randomize(qwen2.Model(qwen2.ModelArgs.from_dict(config)), config, seed, quantize_bits=4, group_size=32)
    install_attention(m)
    return m


@pytest.mark.parametrize("mode", ["prealloc", "window-quant", "scored"])
def test_qwen2_runs_fused_with_mlx_logits(mode):
    ref, fast = _qwen2(), _qwen2()
    assert float(mx.abs(ref.model.layers[0].self_attn.k_proj.bias).max()) > 0  # biases that matter
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert fused_unsupported(fast) is None and is_fused(fast)
    _same_logits(ref, fast, mode)


def _same_logits(ref, fast, mode: str) -> None:
    """A prefill, a second chunk over what the first left (evicted, quantised), then 20 decode
    steps: the fused model's logits equal MLX's route's."""
    s = CacheSettings(mode=mode, sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16,
                      kv_group_size=32)
    caches = [make_caches(m, s) for m in (ref, fast)]
    rng = np.random.default_rng(1)
    tol = 5e-3 if mode == "window-quant" else 2e-4

    def close(a, b):
        return float(np.abs(b - a).max()) <= tol * max(1.0, float(np.abs(a).max()))

    for n in (37, 9):  # a prefill, then a second chunk over what the first left (evicted, quantised)
        prompt = [int(t) for t in rng.integers(0, CONFIG["vocab_size"], n)]
        outs = []
        for m, c in zip((ref, fast), caches):
            with last_position_only():
                outs.append(np.array(m(mx.array([prompt]), cache=c)[0, -1]))
        assert close(*outs)
    for t in rng.integers(0, CONFIG["vocab_size"], 20):
        a, b = (np.array(m(mx.array([[int(t)]]), cache=c)[0, -1]) for m, c in zip((ref, fast), caches))
        assert close(a, b)


def _mistral3(seed: int = 5):
    """mlx-lm's mistral3 (Mistral Small 3.x's multimodal checkpoints) around a random Mistral text
    model: its call hands the tokens to ``language_model``."""
    from mlx_lm.models import llama, mistral3

    config = {"model_type": "mistral", **CONFIG}
    m = mistral3.Model(mistral3.ModelArgs(model_type="mistral3", text_config=dict(config)))
    m.language_model = randomize(llama.Model(llama.ModelArgs.from_dict(config)), config, seed, quantize_bits=4,
                                 group_size=32)
    install_attention(m)
    return m


@pytest.mark.parametrize("mode", ["prealloc", "window-quant"])
def test_the_multimodal_mistral3_type_runs_fused_with_mlx_logits(mode):
    ref, fast = _mistral3(), _mistral3()
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert fused_unsupported(fast) is None and is_fused(fast)
    _same_logits(ref, fast, mode)


def _qwen3(seed: int = 5):
    config = {"model_type": "qwen3", "head_dim": 32, **CONFIG}
    m = randomize(qwen3.Model(qwen3.ModelArgs.from_dict(config)), config, seed, quantize_bits=4, group_size=32)
    rng = np.random.default_rng(seed)
    for layer in m.model.layers:  # randomize leaves norms at ones: weights that matter
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight = mx.array(1 + 0.5 * rng.standard_normal(norm.weight.shape).astype(np.float32))
    install_attention(m)
    return m


@pytest.mark.parametrize("mode", ["prealloc", "window-quant", "scored"])
def test_qwen3_runs_fused_with_mlx_logits(mode):
    """Qwen3's per-head q/k RMSNorms run in the kernels, before RoPE, in decode and prefill."""
    ref, fast = _qwen3(), _qwen3()
    w = np.array(ref.model.layers[0].self_attn.k_norm.weight)
    assert float(np.abs(w - 1).max()) > 0.01  # norms whose weights matter
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert fused_unsupported(fast) is None and is_fused(fast)
    _same_logits(ref, fast, mode)


def test_layers_with_other_modules_are_refused_naming_them():
    config = {"model_type": "qwen3", "head_dim": 32, **CONFIG}
    m = randomize(qwen3.Model(qwen3.ModelArgs.from_dict(config)), config, 1, quantize_bits=4, group_size=32)
    m.model.layers[1].self_attn.extra_norm = m.model.layers[1].self_attn.q_norm
    why = fused_unsupported(m)
    assert why is not None and "extra_norm" in why
