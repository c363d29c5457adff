"""3-, 5- and 6-bit weights on the fused steps (fused_layers.widened: a byte a value, the
module's own scales and biases): a Q4_K_M file's Q5_0/Q5_1/Q5_K matrices and MLX's 3/5/6-bit
models, with scales of mixed dtypes (Q4_K's float32 beside Q5_0's float16), against MLX's route."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from cache import CacheSettings, make_caches  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from tests.fused_llama import _no_leftover_kernels  # noqa: E402, F401
from tests.test_fused_decode import _close, _decode, _model  # noqa: E402


def _as_q8_0(model, layer: int, proj: tuple[str, str]) -> None:
    """One projection of one layer requantised to 8 bits with float16 scales and biases (as a
    Q4_K_M file's Q8_0 v_proj beside float32-scaled matrices: the kernels read those as stored)."""
    parent, name = proj
    m = model["model"]["layers"][layer][parent][name]
    w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
    m.weight, scales, biases = mx.quantize(w, group_size=32, bits=8)
    m.scales, m.biases, m.bits, m.group_size = scales.astype(mx.float16), biases.astype(mx.float16), 8, 32
    mx.eval(m.parameters())


@pytest.mark.parametrize("bits", [3, 5, 6])
def test_widened_weights_take_the_fused_steps_and_equal_mlx(bits):
    ref, fast = _model(bits=bits, tied=False, seed=5), _model(bits=bits, tied=False, seed=5)
    for m in (ref, fast):  # float16 scales in one layer's v_proj, float32 in every other matrix
        _as_q8_0(m, 1, ("self_attn", "v_proj"))
    plan = apply_fast_path(fast, backend="cpu", warm_up=False)
    assert is_fused(fast), plan.fused_decode
    n = len(fast["model"]["layers"]) * 7 - 1
    assert f"{n} 3/5/6-bit matrices read widened to a byte a value" in plan.fused_decode
    prompt = [int(t) for t in mx.random.randint(0, 256, (12,), key=mx.random.key(2))]
    t_ref, l_ref, _ = _decode(ref, prompt, 8)
    t_fast, l_fast, _ = _decode(fast, prompt, 8)
    assert t_fast == t_ref
    assert all(_close(a, b) for a, b in zip(l_fast, l_ref))
    # and the fused prefill chunk (the session's route: only the last position wanted)
    outs = []
    for m in (ref, fast):
        caches = make_caches(m, CacheSettings(mode="prealloc"))
        with last_position_only():
            outs.append(np.array(m(mx.array([prompt * 3]), cache=caches)[0, -1]))
    assert _close(outs[1], outs[0])


def test_four_and_eight_bit_weights_are_read_as_stored():
    """Only the widths the kernels cannot read are widened: a 4-bit model's plan says nothing of it."""
    fast = _model(bits=4)
    plan = apply_fast_path(fast, backend="cpu", warm_up=False)
    assert is_fused(fast) and "widened" not in plan.fused_decode


@pytest.mark.parametrize("bits", [5, 8])
def test_eight_bit_rows_on_int8_activations_stay_near_exact(bits):
    """numerics fast: 8-bit layers (and widened 5-bit ones) run four rows at a time on int8
    activations (int8head.q8_rows4_i8) rather than one by one on floats: the logits move by int8
    rounding only, and differ from the exact route's (the int8 route is taken)."""
    exact, fast = _model(bits=bits, tied=False, seed=7), _model(bits=bits, tied=False, seed=7)
    apply_fast_path(exact, backend="cpu", warm_up=False, numerics="exact")
    apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    fast._chatapp_fused.set_fast(True, last_exact=False, head="exact")
    prompt = [int(t) for t in mx.random.randint(0, 256, (12,), key=mx.random.key(3))]
    _, l_exact, _ = _decode(exact, prompt, 4)
    _, l_fast, _ = _decode(fast, prompt, 4)
    assert any(not np.array_equal(a, b) for a, b in zip(l_fast, l_exact))
    assert all(_close(a, b, tol=3e-2) for a, b in zip(l_fast, l_exact))


@pytest.mark.parametrize("bits", [5, 8])
def test_eight_bit_rows_take_the_prefill_panel(bits):
    """numerics fast, the prefill chunk: 8-bit rows (and widened 5-bit ones) run on the int8
    panel (int8panel.PANEL8) rather than the float tile. With the attention's scores kept on
    floats every other product of these models is 8-bit, so the chunk's logits equal the exact
    route's unless the panel is taken; they move by int8 rounding only."""
    from chatapp.kernels.int8panel import PANEL8

    exact, fast = _model(bits=bits, tied=False, seed=9), _model(bits=bits, tied=False, seed=9)
    apply_fast_path(exact, backend="cpu", warm_up=False, numerics="exact")
    apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    fast._chatapp_fused.set_fast(True, last_exact=False, head="exact", prefill_scores="exact")
    prompt = [int(t) for t in mx.random.randint(0, 256, (40,), key=mx.random.key(4))]
    outs = []
    for m in (exact, fast):
        caches = make_caches(m, CacheSettings(mode="prealloc"))
        with last_position_only():
            outs.append(np.array(m(mx.array([prompt]), cache=caches)[0, -1]))
    assert np.array_equal(outs[0], outs[1]) != PANEL8
    assert _close(outs[1], outs[0], tol=3e-2)


@pytest.mark.parametrize("bits", [5, 8])
def test_a_short_chunk_keeps_eight_bit_rows_on_the_float_tile(bits):
    """Below PANEL8_MIN_TOKENS tokens an 8-bit panel costs more to pack than the float tile's
    products (prefill_step.py): a short chunk's 8-bit rows run exact, as numerics exact runs them,
    so its logits equal the exact route's bit for bit."""
    from chatapp.kernels.prefill_step import PANEL8_MIN_TOKENS

    exact, fast = _model(bits=bits, tied=False, seed=9), _model(bits=bits, tied=False, seed=9)
    apply_fast_path(exact, backend="cpu", warm_up=False, numerics="exact")
    apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    fast._chatapp_fused.set_fast(True, last_exact=False, head="exact", prefill_scores="exact")
    prompt = [int(t) for t in mx.random.randint(0, 256, (PANEL8_MIN_TOKENS - 1,), key=mx.random.key(4))]
    outs = []
    for m in (exact, fast):
        caches = make_caches(m, CacheSettings(mode="prealloc"))
        with last_position_only():
            outs.append(np.array(m(mx.array([prompt]), cache=caches)[0, -1]))
    assert np.array_equal(outs[0], outs[1])
