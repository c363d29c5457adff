"""cpu.numerics = fast: the int8 dot-product rows (kernels/int8dot.py) against the exact float
rows, every instruction variant this CPU can run, the fused decode step with them, and the
choice of instruction from the CPU's features (mocked: no feature is assumed)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from numba import njit  # noqa: E402

from chatapp.kernels import int8dot  # noqa: E402
from chatapp.kernels.int8dot import detect_isa, make_rows4_i8, quantise_blocks  # noqa: E402
from chatapp.kernels.rows4 import q4_rows4_dot  # noqa: E402

# int8 per 32-element block: each activation carries at most scale/2 = max|x|/254 of rounding,
# so a row's relative error stays around 1%; we allow 3% of the largest output
REL_TOL = 3e-2


def _runnable_isas() -> list[str]:
    host = detect_isa()
    return {"vnni": ["vnni", "avx2", "generic"], "avx2": ["avx2", "generic"]}.get(host, ["generic"])


def _case(seed: int, n: int, k: int, gs: int, half: bool):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    sc = (rng.random((n, k // gs), dtype=np.float32) + 0.1).astype(np.float32)
    if half:
        sc = sc.astype(np.float16).view(np.uint16)
    x = rng.standard_normal(k).astype(np.float32) * rng.choice([0.01, 1.0, 30.0], k).astype(np.float32)
    return w, sc, x


@njit
def _exact(w, xe, xo, sc, gs, out):
    q4_rows4_dot(w, 0, xe, xo, sc, gs, out)


def _variant(isa: str):
    k = make_rows4_i8(isa)

    @njit
    def run(w, a, b, c, d, gs, out):
        k(w, 0, a, b, c, d, gs, out)

    return run


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("half", [False, True])
def test_int8_rows_match_exact_rows_within_tolerance(gs, half):
    k = 576 if gs != 128 else 640  # SmolLM2's width (9 chunks of 64); 128-groups need K % 128 == 0
    w, sc, x = _case(gs + half, 4, k, gs, half)
    exact = np.empty(4, np.float32)
    _exact(w, x[0::2].copy(), x[1::2].copy(), sc, gs, exact)
    xqe, xqo, ls = np.empty(k // 2, np.int8), np.empty(k // 2, np.int8), np.empty(k // 8, np.float32)
    quantise_blocks(x, xqe, xqo, ls)
    # the dequantised activation is within half a step of x
    xq = np.empty(k, np.float32)
    xq[0::2], xq[1::2] = xqe, xqo
    step = np.repeat(ls.reshape(-1, 2, 4)[:, :, 0].reshape(-1), 32)
    assert np.all(np.abs(xq * step - x) <= step / 2 * 1.001 + 1e-30)
    results = {}
    for isa in _runnable_isas():
        out = np.empty(4, np.float32)
        _variant(isa)(w, xqe, xqo, ls, sc, gs, out)
        results[isa] = out
        assert np.abs(out - exact).max() <= REL_TOL * np.abs(exact).max(), isa
    # every instruction sums the same integers: the variants agree to float rounding
    first = next(iter(results.values()))
    for isa, out in results.items():
        np.testing.assert_allclose(out, first, rtol=1e-5, atol=1e-5 * np.abs(first).max(), err_msg=isa)


def test_zero_block_quantises_to_zero():
    x = np.zeros(64, np.float32)
    x[32:] = np.linspace(-1, 1, 32, dtype=np.float32)
    xqe, xqo, ls = np.empty(32, np.int8), np.empty(32, np.int8), np.empty(8, np.float32)
    quantise_blocks(x, xqe, xqo, ls)
    assert not xqe[:16].any() and not xqo[:16].any() and not ls[:4].any()
    assert ls[4] == pytest.approx(1 / 127) and np.abs(xqe[16:]).max() <= 127


@pytest.mark.parametrize("features, isa", [
    ({"avx512vnni": True, "avx512vl": True, "avx2": True}, "vnni"),
    ({"avxvnni": True, "avx2": True}, "vnni"),
    ({"avx512vnni": True, "avx512vl": False, "avx2": True}, "avx2"),  # no 256-bit form without VL
    ({"avx2": True}, "avx2"),
    ({}, "generic"),  # no features known (another architecture, or LLVM could not tell)
])
def test_isa_follows_the_cpu_features(features, isa):
    assert detect_isa(features) == isa


def test_no_features_falls_back_to_portable_code(monkeypatch):
    monkeypatch.setattr(int8dot, "cpu_features", lambda: {})
    assert detect_isa() == "generic"
    w, sc, x = _case(5, 4, 128, 32, False)
    xqe, xqo, ls = np.empty(64, np.int8), np.empty(64, np.int8), np.empty(16, np.float32)
    quantise_blocks(x, xqe, xqo, ls)
    out, exact = np.empty(4, np.float32), np.empty(4, np.float32)
    _variant(detect_isa())(w, xqe, xqo, ls, sc, 32, out)
    _exact(w, x[0::2].copy(), x[1::2].copy(), sc, 32, exact)
    assert np.abs(out - exact).max() <= REL_TOL * np.abs(exact).max()
    with pytest.raises(ValueError, match="isa must be one of"):
        make_rows4_i8("sse9")


def test_fused_fast_decode_stays_close_to_exact():
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.backend.fused_decode import is_fused
    from tests.test_fused_decode import SMOL, _decode, _model

    exact, fast = _model(), _model()
    apply_fast_path(exact, backend="cpu")
    plan = apply_fast_path(fast, backend="cpu", numerics="fast")
    assert is_fused(fast) and "numerics fast" in plan.summary(), plan.summary()
    prompt = [int(t) for t in mx.random.randint(0, SMOL.vocab_size, (12,), key=mx.random.key(3))]
    t_exact, l_exact, _ = _decode(exact, prompt, 6)
    t_fast, l_fast, _ = _decode(fast, prompt, 6)
    # one step from the same history: the logits differ by the int8 rounding only
    assert np.abs(l_fast[0] - l_exact[0]).max() <= REL_TOL * np.abs(l_exact[0]).max()
    assert t_fast[0] == t_exact[0]
    with pytest.raises(ValueError, match="numerics must be one of"):
        apply_fast_path(_model(), backend="cpu", numerics="fastest")
