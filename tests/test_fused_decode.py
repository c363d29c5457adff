"""The fused decode step (one native call per Llama layer on the CPU backend) against MLX's own
model: logits, greedy tokens, what it writes into chatapp's caches, and where it is not used."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cache import CacheSettings, install_attention, make_caches  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_decode import FusedDecoder  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.fused_support import fused_unsupported  # noqa: E402
from chatapp.model.synthetic import LlamaShape, build_random_llama  # noqa: E402
from tests.fused_llama import _no_leftover_kernels  # noqa: E402, F401

# SmolLM2-135M's layer geometry (576 wide, 9 heads of 64 over 3 KV heads, MLP 1536), 2 layers
SMOL = LlamaShape(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                  head_dim=64, intermediate_size=1536, vocab_size=640, rope_theta=100000.0)


def _model(bits=4, group_size=32, tied=True, traditional=True, seed=0, shape=SMOL, embed_bits=8):
    m, _ = build_random_llama(LlamaShape(**{**shape.__dict__, "tie_word_embeddings": tied,
                                            "rope_traditional": traditional}),
                              seed=seed, quantize_bits=bits, group_size=group_size)
    if tied:  # a tied Q8_0-like embedding, the output head too
        nn.quantize(m, group_size=32, bits=embed_bits, class_predicate=lambda _, x: isinstance(x, nn.Embedding))
    mx.eval(m.parameters())
    install_attention(m)
    return m


def _decode(model, prompt: list[int], steps: int, mode: str | None = "prealloc", caches: list | None = None):
    """Greedy decode through chatapp's caches (made for ``mode``, or ``caches``): (tokens,
    per-step logits, caches)."""
    caches = caches if caches is not None else make_caches(model, CacheSettings(mode=mode))
    logits = model(mx.array([prompt]), cache=caches)[0, -1]
    toks, outs = [], []
    for _ in range(steps):
        tok = int(mx.argmax(logits).item())
        toks.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)[0, -1]
        mx.eval(logits)
        outs.append(np.array(logits))
    return toks, outs, caches


def _close(a, b, tol=2e-3):
    return float(np.abs(a - b).max()) <= tol * float(np.abs(b).max())


@pytest.mark.parametrize("tied, traditional, bits", [(True, True, 4), (False, False, 4), (True, False, 8)])
def test_fused_step_equals_mlx_logits_and_greedy(tied, traditional, bits):
    ref = _model(bits=bits, tied=tied, traditional=traditional)
    fast = _model(bits=bits, tied=tied, traditional=traditional)
    plan = apply_fast_path(fast, backend="cpu")
    assert is_fused(fast), plan.fused_decode
    assert "one native call per token" in plan.summary()
    assert all(r.route == "kernel" for r in plan.routes)  # small layers too, once fused
    prompt = [int(t) for t in mx.random.randint(0, SMOL.vocab_size, (12,), key=mx.random.key(1))]
    t_ref, l_ref, c_ref = _decode(ref, prompt, 10)
    t_fast, l_fast, c_fast = _decode(fast, prompt, 10)
    assert t_fast == t_ref
    for a, b in zip(l_fast, l_ref):
        assert _close(a, b)
    # the fused step wrote the same K/V rows, at the same places, as MLX's step
    for cf, cr in zip(c_fast, c_ref):
        assert cf.offset == cr.offset == len(prompt) + 10
        (kf, vf), (kr, vr) = cf.full.view(), cr.full.view()
        assert _close(np.array(kf), np.array(kr)) and _close(np.array(vf), np.array(vr))


def test_fused_step_is_the_one_taken(monkeypatch):
    fast = _model()
    apply_fast_path(fast, backend="cpu")
    calls = []
    real = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, t, c: calls.append(t) or real(self, t, c))
    toks, _, _ = _decode(fast, [1, 2, 3], 4)
    assert calls == toks  # every single-token step over prealloc caches, and only those


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([4, 8]), group_size=st.sampled_from([32, 64]), traditional=st.booleans(),
       prompt_len=st.integers(1, 40), seed=st.integers(0, 3))
def test_fused_step_matches_dequantize_then_matmul(bits, group_size, traditional, prompt_len, seed):
    """Any bits/group size/RoPE layout and cache depth: the step's logits are MLX's (which
    computes each projection as dequantise-then-matmul at float32 here)."""
    shape = LlamaShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=256, vocab_size=256)
    ref = _model(bits, group_size, tied=False, traditional=traditional, seed=seed, shape=shape)
    fast = _model(bits, group_size, tied=False, traditional=traditional, seed=seed, shape=shape)
    apply_fast_path(fast, backend="cpu", warm_up=False)
    assert is_fused(fast)
    prompt = [int(t) for t in mx.random.randint(0, 256, (prompt_len,), key=mx.random.key(seed))]
    outs = []
    for m in (ref, fast):
        caches = make_caches(m, CacheSettings())
        m(mx.array([prompt]), cache=caches)
        outs.append(np.array(m(mx.array([[prompt[-1]]]), cache=caches)[0, -1]))
    assert _close(outs[1], outs[0])


@pytest.mark.parametrize("mode", ["window", "window-quant", "quantized", "scored", "scored-quant"])
def test_every_policy_takes_the_fused_step(mode, monkeypatch):
    ref, fast = _model(), _model()
    apply_fast_path(fast, backend="cpu", warm_up=False)
    calls = []
    real = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, t, c: calls.append(t) or real(self, t, c))
    t_ref, _, _ = _decode(ref, [5, 6, 7], 4, mode)
    t_fast, _, _ = _decode(fast, [5, 6, 7], 4, mode)
    assert t_fast == t_ref and calls == t_fast


@pytest.mark.parametrize("settings_", [CacheSettings(mode="concat"),
                                       CacheSettings(mode="window-quant", kv_key_layout="channel")])
def test_concat_and_per_channel_keys_keep_the_per_op_step(settings_, monkeypatch):
    """concat shows what per-token concatenation costs; keys quantised per channel are a layout
    the step's kernels do not read (cache_refusal says so): both stay on MLX's route."""
    from chatapp.backend.fused_support import cache_refusal

    ref, fast = _model(), _model()
    apply_fast_path(fast, backend="cpu", warm_up=False)
    monkeypatch.setattr(FusedDecoder, "step", lambda *a: pytest.fail("fused step over a cache it does not read"))
    outs = []
    for m in (ref, fast):
        caches = make_caches(m, settings_)
        outs.append(_decode(m, [5, 6, 7], 4, settings_.mode if settings_.mode == "concat" else None, caches)[0])
    assert outs[0] == outs[1]
    assert cache_refusal(make_caches(fast, settings_), SMOL.num_hidden_layers)


def test_trim_then_decode_again_equals_mlx():
    ref, fast = _model(), _model()
    apply_fast_path(fast, backend="cpu", warm_up=False)
    outs = []
    for m in (ref, fast):
        caches = make_caches(m, CacheSettings())
        m(mx.array([[3, 4, 5, 6]]), cache=caches)
        for t in (7, 8, 9):
            m(mx.array([[t]]), cache=caches)
        for c in caches:
            c.trim(2)
        outs.append(np.array(m(mx.array([[11]]), cache=caches)[0, -1]))
    assert _close(outs[1], outs[0])


@pytest.mark.parametrize("backend", ["metal", "cuda"])
def test_never_installed_off_the_cpu(backend, monkeypatch):
    import chatapp.model.device as device

    fast = _model()
    monkeypatch.setattr(device, "pick_backend", lambda *a, **k: type("B", (), {"name": backend})(), raising=False)
    plan = apply_fast_path(fast, backend=device.pick_backend().name)
    assert not is_fused(fast) and not plan.applied
    assert type(fast).__name__ == "Model"


def test_unfusable_models_say_why_and_setting_off():
    m = _model()
    m.args.model_type = "granite"
    assert "granite" in fused_unsupported(m)
    plan = apply_fast_path(m, backend="cpu", warm_up=False)
    assert not is_fused(m) and "fused decode: off (model type 'granite'" in plan.fused_decode
    m2 = _model()
    plan = apply_fast_path(m2, backend="cpu", warm_up=False, fused_decode=False)
    assert not is_fused(m2) and "cpu.fused_decode = false" in plan.fused_decode
    assert any(r.route == "mlx" for r in plan.routes)  # small layers stay on MLX unfused
    apply_fast_path(m2, backend="cpu", warm_up=False)
    assert is_fused(m2)
    apply_fast_path(m2, backend="cpu", warm_up=False, fused_decode=False)  # re-applied: removed again
    assert not is_fused(m2)


def test_session_reply_through_the_fused_step_equals_mlx_lm(monkeypatch):
    """chatapp's session (prefill on the kernel routes, then fused steps) against
    mlx_lm.stream_generate on the same weights without any of it."""
    from mlx_lm import stream_generate

    from chatapp.engine.events import TokenEvent
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session
    from chatapp.model.synthetic import byte_tokenizer

    tok = byte_tokenizer()
    shape = LlamaShape(**{**SMOL.__dict__, "vocab_size": 258})
    ref, fast = _model(shape=shape, seed=5), _model(shape=shape, seed=5)
    apply_fast_path(fast, backend="cpu")
    steps = []
    real = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, t, c: steps.append(t) or real(self, t, c))
    session = Session(fast, tok, generation=GenerationSettings(temp=0.0, max_tokens=24, ignore_eos=True), raw=True)
    got = [e.token for e in session.send("The fused step must agree with MLX.") if isinstance(e, TokenEvent)
           and e.token >= 0]
    asked = session.conversation.copy()
    asked.messages.pop()
    want = [int(r.token) for r in stream_generate(ref, tok, mx.array(session.format.tokens(asked)), max_tokens=24)]
    assert got == want and len(steps) >= 20


def test_numerics_auto_is_fast_only_where_the_cpu_has_vector_int8_products(monkeypatch):
    import chatapp.kernels.int8dot as int8dot
    from chatapp.backend.fused_settings import numerics_line, resolve_numerics

    for isa, want in (("vnni512", "fast"), ("vnni", "fast"), ("avx2", "fast"), ("generic", "exact")):
        monkeypatch.setattr(int8dot, "ISA", isa)
        assert resolve_numerics("auto") == want
        assert numerics_line("auto").startswith(f"numerics {want}")
        assert resolve_numerics("exact") == "exact" and resolve_numerics("fast") == "fast"


def test_the_plan_says_where_the_prefills_8_bit_rows_stay_on_floats(monkeypatch):
    """--verbose's numerics line names the one product fast numerics leaves on floats on AVX2."""
    import chatapp.kernels.int8panel as int8panel
    from chatapp.backend.fused_settings import numerics_line

    monkeypatch.setattr(int8panel, "PANEL8", False)
    assert "8-bit rows on floats" in numerics_line("fast")
    monkeypatch.setattr(int8panel, "PANEL8", True)
    assert "8-bit rows" not in numerics_line("fast") and "8-bit rows" not in numerics_line("exact")


@pytest.mark.parametrize("chunks", [1, 2, 5])
def test_any_chunking_of_the_projections_gives_the_same_bits(chunks, monkeypatch):
    """How the token step cuts each projection between the threads (rows_per_chunk) moves no
    arithmetic: the logits are bit-identical to the default cut's."""
    shape = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=704, vocab_size=256)
    outs = []
    for n in (0, chunks):
        m = _model(shape=shape)
        apply_fast_path(m, backend="cpu", warm_up=False)
        assert is_fused(m)
        monkeypatch.setattr(FusedDecoder, "chunks", n)
        _, logits, _ = _decode(m, [3, 1, 4, 1, 5], 3)
        outs.append(np.stack(logits))
    assert np.array_equal(outs[0], outs[1])


def test_first_layers_is_the_decoder_of_the_model_cut_to_them():
    """first_layers(n), the warm-up's decoder, computes what the decoder of the same model with
    only its first n layers computes: same bits, step and prefill, and the full decoder's own
    state (per-layer arrays, numerics) is left as it was."""
    shape = LlamaShape(**{**SMOL.__dict__, "num_hidden_layers": 3})
    full = FusedDecoder(_model(shape=shape), "fast")
    cut_model = _model(shape=shape)
    cut_model.model.layers = cut_model.model.layers[:1]
    cut = FusedDecoder(cut_model, "fast")
    cut.fast_mask[:] = full.fast_mask[:1]  # (a one-layer model's own mask keeps its last layer exact)
    cut.prefill_mask[:] = full.prefill_mask[:1]
    part = full.first_layers(1)
    assert len(part.layers) == 1 and len(full.layers) == 3 and full._bits.shape[0] == 3
    outs = []
    for dec in (part, cut):
        caches = make_caches(cut_model, CacheSettings(mode="prealloc"))
        outs.append((dec.prefill(mx.array([5, 7, 9]), caches), dec.step(11, caches)))
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


def test_the_install_warm_up_runs_one_layer(monkeypatch):
    """The kernels load (or compile) on a one-layer decoder: a warm-up costs one layer's weights,
    not the model's."""
    seen = []
    real = FusedDecoder.warm_up
    monkeypatch.setattr(FusedDecoder, "warm_up", lambda self, *a: (seen.append(len(self.layers)), real(self, *a)))
    m = _model()
    apply_fast_path(m, backend="cpu")
    assert is_fused(m) and seen == [1] and len(m._chatapp_fused.layers) == SMOL.num_hidden_layers
