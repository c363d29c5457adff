"""The route each quantised layer takes on the CPU backend (packed-weight kernels, float32 copy,
MLX), the fallbacks and their reasons, and replies with the kernels on equal to MLX's/mlx-lm's."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

import chatapp.kernels  # noqa: E402
from cache import CacheSettings, set_decode_kernels  # noqa: E402
from cache.attention import decode_kernels  # noqa: E402
from chatapp.backend import cpu, decode_attention  # noqa: E402
from chatapp.backend.cpu import CpuQuantizedLinear, accelerate_model, apply_fast_path  # noqa: E402
from chatapp.engine.events import TokenEvent
from chatapp.engine.generate import GenerationSettings  # noqa: E402
from chatapp.engine.session import Session  # noqa: E402
from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer  # noqa: E402
from tests.test_backend_cpu import greedy  # noqa: E402 (mlx-lm's KVCache, argmax each step)

SHAPE = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=512, vocab_size=512)


@pytest.fixture(autouse=True)
def _no_leftover_decode_kernels():
    set_decode_kernels(None, None)
    yield
    set_decode_kernels(None, None)


def model(bits: int = 4, group_size: int = 64, tied: bool = False, shape: LlamaShape = SHAPE, seed: int = 0):
    m, _ = build_random_llama(LlamaShape(**{**shape.__dict__, "tie_word_embeddings": tied}), seed=seed,
                              quantize_bits=bits, group_size=group_size)
    if tied:
        nn.quantize(m, group_size=group_size, bits=bits, class_predicate=lambda _, x: isinstance(x, nn.Embedding))
    mx.eval(m.parameters())
    return m


def close(a: mx.array, b: mx.array, tol: float = 1e-4) -> bool:
    return float(mx.abs(a - b).max()) <= tol * float(mx.abs(b).max())


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bits, group_size", [(4, 64), (4, 32), (8, 128)])
def test_kernel_route_logits_and_greedy_equal(tied, bits, group_size):
    ref, fast = model(bits, group_size, tied), model(bits, group_size, tied)
    plan = accelerate_model(fast, backend="cpu", kernel_min_elements=0)
    assert len(plan.kernel_layers) == len(plan.layers) + len(plan.embeddings) == 15
    assert all(r.route == "kernel" for r in plan.routes) and not plan.dense_layers
    prompt = mx.random.randint(0, SHAPE.vocab_size, (1, 40), key=mx.random.key(3))
    for n in (1, 3, 40):  # the packed kernel (up to kernel_max_tokens), then dequantise + gemm
        assert close(fast(prompt[:, :n]), ref(prompt[:, :n])), n
    assert greedy(fast, prompt, 16) == greedy(ref, prompt, 16)


def test_weights_stay_packed_and_shared():
    fast = model()
    before = {id(p) for _, p in __import__("mlx.utils").utils.tree_flatten(fast.parameters())}
    accelerate_model(fast, backend="cpu", kernel_min_elements=0)
    layer = fast.model.layers[0].self_attn.q_proj
    assert isinstance(layer, CpuQuantizedLinear) and layer.route == "kernel" and not layer.has_dense
    import numpy as np

    assert np.shares_memory(layer.routing.packed.packed, np.asarray(layer["weight"]))  # no copy
    after = {id(p) for _, p in __import__("mlx.utils").utils.tree_flatten(fast.parameters())}
    assert before == after


def test_unsupported_layers_fall_back_to_mlx_with_the_reason():
    m3 = model(bits=3)
    plan = accelerate_model(m3, backend="cpu", kernel_min_elements=0)
    assert not plan.kernel_layers and all(r.route == "mlx" and "3-bit" in r.why for r in plan.routes)
    x = mx.random.randint(0, SHAPE.vocab_size, (1, 20), key=mx.random.key(1))
    ref = model(bits=3)
    assert close(m3(x), ref(x))

    small = model()
    # the default unfused: 256x256 layers are too small (a fused model takes the kernel for all)
    plan = accelerate_model(small, backend="cpu", fused_decode=False)
    assert all(r.route == "mlx" and "under 1024x1024" in r.why for r in plan.routes)


def test_mixed_widths_route_per_layer():
    odd = LlamaShape(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, intermediate_size=480, vocab_size=512)  # 480 % 64 != 0: down_proj's input
    m = model(group_size=32, shape=odd)
    plan = accelerate_model(m, backend="cpu", kernel_min_elements=0)
    routes = {r.name.rsplit(".", 1)[-1]: r for r in plan.routes}
    assert routes["down_proj"].route == "mlx" and "480" in routes["down_proj"].why
    assert routes["up_proj"].route == "kernel" and routes["q_proj"].route == "kernel"
    lines = plan.route_lines()
    assert "gate_proj, up_proj, k_proj, o_proj, q_proj, v_proj, lm_head: kernel (4-bit, group 32)" in lines
    assert "down_proj: mlx (4-bit, group 32; input width 480 is not a multiple of 64)" in lines


def test_kernels_off_and_numba_missing(monkeypatch):
    plan = apply_fast_path(model(), backend="cpu", kernels="off", kernel_min_elements=0)
    assert all(r.route == "mlx" and r.why == "cpu.kernels = off" for r in plan.routes)
    assert decode_kernels() == (None, None) and "decode attention: MLX SDPA" in plan.attention
    monkeypatch.setattr(chatapp.kernels, "kernel_info",
                        lambda: chatapp.kernels.KernelInfo(False, "numba is not installed (pip install numba)"))
    plan = apply_fast_path(model(), backend="cpu", kernel_min_elements=0)
    assert all(r.route == "mlx" and "numba is not installed" in r.why for r in plan.routes)
    assert "kernels: off (numba is not installed" in plan.summary() and decode_kernels() == (None, None)


def test_other_backends_remove_the_decode_kernels():
    apply_fast_path(model(), backend="cpu", kernel_min_elements=0)
    assert decode_kernels() == (decode_attention.decode_full, decode_attention.decode_mixed)
    plan = apply_fast_path(model(), backend="metal")
    assert not plan.applied and decode_kernels() == (None, None)


def test_bad_kernel_arguments():
    with pytest.raises(ValueError):
        accelerate_model(model(), backend="cpu", kernels="maybe")
    with pytest.raises(ValueError):
        accelerate_model(model(), backend="cpu", kernel_max_tokens=0)


def _reply_tokens(session: Session, text: str) -> list[int]:
    return [e.token for e in session.send(text) if isinstance(e, TokenEvent) and e.token >= 0]


def test_session_reply_equals_mlx_lm_with_kernels_on():
    """One end-to-end greedy reply: chatapp's session with every kernel on (packed products,
    dequantise + gemm prefill, decode attention) against mlx_lm.stream_generate on the same
    weights without them."""
    from mlx_lm import stream_generate

    tok = byte_tokenizer()
    shape = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=512, vocab_size=258)
    ref, fast = model(shape=shape, seed=5), model(shape=shape, seed=5)
    # unfused, so that decode steps go through the decode attention kernel (test_fused_decode
    # has the same reply through the fused step)
    plan = apply_fast_path(fast, backend="cpu", kernel_min_elements=0, fused_decode=False)
    assert plan.kernel_layers and decode_kernels()[0] is not None
    calls = []
    real = decode_attention.decode_full
    set_decode_kernels(lambda *a: calls.append(1) or real(*a), decode_attention.decode_mixed)
    session = Session(fast, tok, generation=GenerationSettings(temp=0.0, max_tokens=24, ignore_eos=True), raw=True)
    got = _reply_tokens(session, "The kernels must agree with MLX here.")
    asked = session.conversation.copy()
    asked.messages.pop()  # the reply
    prompt = session.format.tokens(asked)
    want = [int(r.token) for r in stream_generate(ref, tok, mx.array(prompt), max_tokens=24)]
    assert got == want and len(calls) >= 23 * shape.num_hidden_layers


def test_window_quant_decode_reads_the_quantised_history():
    """window-quant past its budget on the per-op route (no fused step; the fused one has its own
    tests, test_fused_policies.py): decode attention goes through the mixed kernel (packed K/V
    read in place) and the reply equals the MLX route's."""
    tok = byte_tokenizer()
    shape = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=512, vocab_size=258)
    settings = CacheSettings(mode="window-quant", sinks=4, window=32, evict_chunk=16, max_kv_tokens=400,
                             kv_bits=8, kv_group_size=32)
    gen = GenerationSettings(temp=0.0, max_tokens=16, ignore_eos=True)
    text = "A long prompt, so that most of it is quantised. " * 4
    ref = Session(model(shape=shape, seed=2), tok, generation=gen, mode="window-quant", cache_settings=settings,
                  raw=True)
    want = _reply_tokens(ref, text)
    fast_model = model(shape=shape, seed=2)
    apply_fast_path(fast_model, backend="cpu", kernel_min_elements=0, fused_decode=False)
    mixed = []
    real = decode_attention.decode_mixed
    set_decode_kernels(decode_attention.decode_full, lambda *a: mixed.append(1) or real(*a))
    fast = Session(fast_model, tok, generation=gen, mode="window-quant", cache_settings=settings, raw=True)
    assert _reply_tokens(fast, text) == want
    assert fast.cache_view().quant_tokens > 0 and len(mixed) >= 15 * shape.num_hidden_layers


def test_explicit_mask_arrays_stay_on_mlx():
    q = mx.zeros((1, 2, 1, 64))
    kv = mx.zeros((1, 1, 8, 64))
    assert decode_attention.decode_full(q, kv, kv, 0.1, mx.zeros((1, 8))) is None
    assert decode_attention.decode_full(mx.zeros((1, 2, 2, 64)), kv, kv, 0.1, None) is None  # 2 queries
    # float16 K/V are read in place (tests/test_kv16.py); bfloat16, or K and V of different dtypes, stay on MLX
    assert decode_attention.decode_full(q, kv.astype(mx.bfloat16), kv.astype(mx.bfloat16), 0.1, None) is None
    assert decode_attention.decode_full(q, kv.astype(mx.float16), kv, 0.1, None) is None


def test_plan_summary_names_blas_kernels_and_routes():
    plan = apply_fast_path(model(), backend="cpu", kernel_min_elements=0)
    text = "\n".join(plan.details())
    assert "kernels: numba" in text and "prefill gemm: numpy's" in text and "MLX's BLAS:" in text
    assert ("decode attention: kernel" in text and "k_proj x2, o_proj x2, q_proj x2" in text
            and text.endswith("lm_head: kernel (4-bit, group 64)"))
    assert plan.warm_up_seconds > 0
    assert cpu.KERNEL_MAX_TOKENS == plan.kernel_max_tokens


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_prefill_computes_the_head_for_the_last_position_only(tied, kernels, monkeypatch):
    from chatapp.backend import qlinear

    ref, fast = model(tied=tied), model(tied=tied)
    accelerate_model(fast, backend="cpu", kernels=kernels, kernel_min_elements=0)
    head = fast.model.embed_tokens if tied else fast.lm_head
    assert head.routing.output_head and not fast.model.layers[0].mlp.up_proj.routing.output_head
    seen = []  # positions the head really computed, whatever its route
    real_kernel, real_mlx = qlinear.kernel_matmul, type(head)._mlx_product
    monkeypatch.setattr(qlinear, "kernel_matmul",
                        lambda x, route, d: (seen.append(x.shape[1]) if route is head.routing else None)
                        or real_kernel(x, route, d))
    monkeypatch.setattr(type(head), "_mlx_product", lambda self, x: seen.append(x.shape[1]) or real_mlx(self, x))
    x = mx.random.randint(0, SHAPE.vocab_size, (1, 30), key=mx.random.key(4))
    with qlinear.last_position_only():
        out = fast(x)
    assert close(out[:, -1], ref(x)[:, -1]) and float(mx.abs(out[:, :-1]).max()) == 0
    assert seen == [1]  # the head never computed the 29 other positions
    seen.clear()
    assert close(fast(x), ref(x)) and (seen == [30] or kernels == "off")  # outside the context: all of them


def test_float16_scales_stay_for_kernels_and_are_cast_for_mlx():
    """The loader leaves a checkpoint's float16 scales alone (load_model(cast_scales=False)): the
    kernels read them as they are, the layers MLX runs get float32 ones (its fast CPU path)."""
    from mlx.utils import tree_flatten, tree_unflatten

    odd = LlamaShape(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, intermediate_size=480, vocab_size=512)
    ref, fast = model(group_size=32, shape=odd), model(group_size=32, shape=odd)
    half = [(k, v.astype(mx.float16)) for k, v in tree_flatten(fast.parameters()) if k.endswith((".scales", ".biases"))]
    fast.update(tree_unflatten(half))
    ref.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in half]))  # the same numbers in float32
    plan = accelerate_model(fast, backend="cpu", kernel_min_elements=0)
    layers = fast.model.layers[0]
    assert layers.mlp.up_proj.route == "kernel" and layers.mlp.up_proj["scales"].dtype == mx.float16
    assert layers.mlp.down_proj.route == "mlx" and layers.mlp.down_proj["scales"].dtype == mx.float32
    assert not plan.warnings  # float16 scales read by a kernel are not "half-precision activations"
    x = mx.random.randint(0, odd.vocab_size, (1, 12), key=mx.random.key(2))
    assert close(fast(x), ref(x)) and close(fast(x[:, :1]), ref(x[:, :1]))


def test_lookup_only_embedding_stays_float16_and_rows_are_cast(tmp_path):
    """load_model(cast_scales=False) + accelerate: an untied model's float16 embedding table
    stays float16 (half the memory), its rows come out float32, logits equal the all-float32
    load's."""
    from chatapp.model.loader import load_model, save_model_dir
    from tests.conftest import shared_model

    tokenizer_dir = shared_model("stories260K")
    m, config = build_random_llama(SHAPE, seed=3, dtype=mx.float16, quantize_bits=4)
    save_model_dir(tmp_path / "m", m, config, tokenizer_dir)
    ref = load_model(str(tmp_path / "m"))  # everything float32
    kept = load_model(str(tmp_path / "m"), cast_scales=False)
    emb = kept.model.model.embed_tokens
    assert emb["weight"].dtype == mx.float16 and kept.model.model.norm["weight"].dtype == mx.float32
    plan = accelerate_model(kept.model, backend="cpu", kernel_min_elements=0)
    assert plan.cast_lookups == ["model.embed_tokens"] and not plan.warnings
    assert kept.model.model.embed_tokens(mx.array([1, 2])).dtype == mx.float32
    x = mx.random.randint(0, SHAPE.vocab_size, (1, 9), key=mx.random.key(1))
    assert close(kept.model(x), ref.model(x))
