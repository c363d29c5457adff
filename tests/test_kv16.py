"""16-bit K/V (cpu.kv_dtype): the kernels read float16 bits as their float32 values, the fused
routes make float16 buffers and write them, and every other reader of the cache (MLX's
attention, the decode kernels, other cache modes, conversion, saved state) keeps working."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from numba import njit  # noqa: E402

from cache import CacheSettings, convert_caches, make_caches  # noqa: E402
from cache.buffers import FullBuffer  # noqa: E402
from cache.factory import restore_caches  # noqa: E402
from chatapp.backend import fused_install  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.decode_attention import decode_full, decode_mixed  # noqa: E402
from chatapp.backend.fused_install import fused_decoder  # noqa: E402
from chatapp.backend.fused_settings import resolve_kv_dtype  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from chatapp.kernels import half  # noqa: E402
from chatapp.kernels.attention import attend_full, heads_view  # noqa: E402
from chatapp.kernels.half import store_f32  # noqa: E402
from chatapp.kernels.pool import chunks, pool  # noqa: E402
from tests.fused_llama import _no_leftover_kernels, fused_small_llama, small_llama  # noqa: E402, F401


def _model(kv_dtype: str | None, seed: int = 3):
    """The random Llama, fused with ``kv_dtype`` K/V (None: not fused, MLX's own step)."""
    return small_llama(seed) if kv_dtype is None else fused_small_llama(seed, kv_dtype=kv_dtype)


def _close(a, b, tol=2e-3) -> bool:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= tol * float(np.abs(np.asarray(b)).max())


def _decode(model, prompt: list[int], steps: int, mode: str = "prealloc"):
    caches = make_caches(model, CacheSettings(mode=mode))
    with last_position_only():
        logits = model(mx.array([prompt]), cache=caches)[0, -1]
    outs = [np.array(logits)]
    for _ in range(steps):
        logits = model(mx.array([[int(np.argmax(outs[-1]))]]), cache=caches)[0, -1]
        outs.append(np.array(logits))
    return outs, caches


# ---- kernels ----------------------------------------------------------------------------------

@njit(cache=False)
def _store_all(x, out):
    for i in range(x.shape[0]):
        store_f32(out, i, x[i])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_stored_half_bits_are_numpys_float16_rounding(values):
    x = np.array(values, np.float32)
    out = np.empty(x.shape[0], np.uint16)
    _store_all(x, out)
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as the conversion gives
        assert np.array_equal(out, x.astype(np.float16).view(np.uint16))
    same = np.empty(x.shape[0], np.float32)
    _store_all(x, same)  # a float32 buffer takes the value as it is
    assert np.array_equal(same, x)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kvh=st.sampled_from([1, 2, 3]), groups=st.sampled_from([1, 3]), n=st.integers(1, 300),
       D=st.sampled_from([32, 64, 128]), spare=st.integers(0, 40), seed=st.integers(0, 1000))
def test_float16_attention_equals_the_float32_kernel_and_a_recompute(kvh, groups, n, D, spare, seed):
    """A strided float16 cache view (spare capacity) read in place gives the float32 kernel's
    output on the same values widened, and softmax(q K^T) V recomputed in float64."""
    rng = np.random.default_rng(seed)
    H = kvh * groups
    cap = n + spare
    k16 = (rng.standard_normal((kvh, cap, D)) * 2).astype(np.float16)
    v16 = rng.standard_normal((kvh, cap, D)).astype(np.float16)
    q = rng.standard_normal((H, D)).astype(np.float32)
    scale = np.float32(D ** -0.5)
    outs = []
    for k, v in ((k16.view(np.uint16), v16.view(np.uint16)), (k16.astype(np.float32), v16.astype(np.float32))):
        (kf, ks), (vf, vs) = heads_view(k[:, :n]), heads_view(v[:, :n])
        out = np.empty((H, D), np.float32)
        pool().run(attend_full, chunks(H, 1), 1, q, kvh, kf, ks, vf, vs, n, scale, out)
        outs.append(out)
    assert np.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    kk = np.repeat(k16[:, :n].astype(np.float64), groups, axis=0)
    vv = np.repeat(v16[:, :n].astype(np.float64), groups, axis=0)
    s = np.einsum("hd,hnd->hn", q.astype(np.float64), kk) * float(scale)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    ref = np.einsum("hn,hnd->hd", p / p.sum(axis=1, keepdims=True), vv)
    assert np.allclose(outs[0], ref, rtol=1e-4, atol=1e-5)


def test_the_half_loops_vectorise_where_the_cpu_has_f16c():
    """The float16 scores and accumulation loops compile to vector conversions (numba's disk
    cache keeps no assembly: the same Python functions compiled afresh, as the kernels are)."""
    from chatapp.kernels.attention import accumulate_full, scores_full

    if not half.HAS_F16C:
        pytest.skip("no F16C here: the conversions are scalar calls")
    k = np.zeros((8, 64), np.uint16)
    s = np.zeros(8, np.float32)
    for fn, args in ((scores_full, (np.zeros(64, np.float32), k, np.float32(1.0), s)),
                     (accumulate_full, (s, k, np.zeros(64, np.float32)))):
        fresh = njit(fastmath=True, nogil=True)(fn.py_func)
        fresh(*args)
        asm = fresh.inspect_asm(fresh.signatures[0])
        assert "vcvtph2ps" in asm and "__extendhfsf2" not in asm


def test_auto_is_float16_only_with_f16c(monkeypatch):
    monkeypatch.setattr(half, "HAS_F16C", True)
    assert resolve_kv_dtype("auto") == "float16"
    monkeypatch.setattr(half, "HAS_F16C", False)
    assert resolve_kv_dtype("auto") == "float32"
    assert resolve_kv_dtype("float16") == "float16" and resolve_kv_dtype("float32") == "float32"
    with pytest.raises(ValueError):
        resolve_kv_dtype("bfloat16")


# ---- the buffers --------------------------------------------------------------------------------

def test_a_float16_buffer_keeps_its_dtype_through_float32_rows_and_growth():
    buf = FullBuffer(step=4, dtype=mx.float16)
    rows = mx.random.normal((1, 2, 3, 8))
    buf.append(rows, rows + 1)
    buf.append(rows, rows + 1)  # grows past the first chunk
    k, v = buf.view()
    assert k.dtype == v.dtype == mx.float16 and k.shape[2] == 6 and buf.capacity == 8
    assert np.array_equal(np.array(k[:, :, 3:]), np.array(rows.astype(mx.float16)))
    plain = FullBuffer(step=4)
    plain.append(rows.astype(mx.float16), rows.astype(mx.float16))
    plain.append(rows, rows)  # the first rows decided: float16
    assert plain.view()[0].dtype == mx.float16
    assert buf.token_bytes() == 2 * 2 * 8 * 2  # K and V, 2 heads of 8, 2 bytes each


# ---- the fused routes ----------------------------------------------------------------------------

def test_fused_float16_route_matches_float32_and_writes_float16_buffers():
    prompt = [int(t) for t in mx.random.randint(0, 256, (40,), key=mx.random.key(2))]
    o32, c32 = _decode(_model("float32"), prompt, 12)
    o16, c16 = _decode(_model("float16"), prompt, 12)
    ref, _ = _decode(_model(None), prompt, 12)
    for a, b, r in zip(o16, o32, ref):
        assert _close(a, b) and _close(a, r)
    for a, b in zip(c16, c32):
        (k16, v16), (k32, v32) = a.full.view(), b.full.view()
        assert k16.dtype == v16.dtype == mx.float16 and k32.dtype == mx.float32
        assert a.offset == b.offset == len(prompt) + 12
        # the rows written (prefill, steps in place) are the float32 route's rows rounded
        assert _close(k16.astype(mx.float32), k32, 1e-3) and _close(v16.astype(mx.float32), v32, 1e-3)


def test_the_models_own_call_over_fused_caches_writes_float16_and_reads_it():
    """A call the fused routes do not take (all positions' logits) over caches the fused model
    met empty: MLX's attention over the float16 buffers, then the fused step goes on."""
    prompt = list(range(3, 30))
    m16, ref = _model("float16"), _model(None)
    outs = []
    for m in (m16, ref):
        caches = make_caches(m, CacheSettings())
        full = m(mx.array([prompt]), cache=caches)  # every position: MLX's route
        step = m(mx.array([[7]]), cache=caches)[0, -1]
        outs.append((np.array(full), np.array(step), caches))
    assert outs[0][2][0].full.keys.dtype == mx.float16 and outs[1][2][0].full.keys.dtype == mx.float32
    assert _close(outs[0][0], outs[1][0]) and _close(outs[0][1], outs[1][1])


def test_a_float32_state_restored_still_takes_the_fused_route():
    """Caches restored from float32 rows (a state saved by a float32 route) are read as float32,
    and give the float32 route's logits."""
    m16, m32 = _model("float16"), _model("float32")
    prompt = list(range(5, 25))
    caches = make_caches(m32, CacheSettings())
    with last_position_only():
        m32(mx.array([prompt]), cache=caches)
    states = [[mx.array(np.array(a)) for a in c.state] for c in caches]
    restored = restore_caches(m16, CacheSettings(), states, [c.meta_state for c in caches])
    got = np.array(m16(mx.array([[9]]), cache=restored)[0, -1])
    assert restored[0].full.keys.dtype == mx.float32 and restored[0].offset == len(prompt) + 1
    want = np.array(m32(mx.array([[9]]), cache=caches)[0, -1])
    assert np.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_saved_float16_state_restores_as_float16_and_decodes_the_same():
    m = _model("float16")
    prompt = list(range(10, 50))
    outs, caches = _decode(m, prompt, 4)
    states = [[mx.array(np.array(a)) for a in c.state] for c in caches]  # copies, as a snapshot file holds
    metas = [c.meta_state for c in caches]
    restored = restore_caches(m, CacheSettings(), states, metas)
    assert restored[0].full.keys.dtype == mx.float16
    tok = int(np.argmax(outs[-1]))
    a = np.array(m(mx.array([[tok]]), cache=caches)[0, -1])
    b = np.array(m(mx.array([[tok]]), cache=restored)[0, -1])
    assert np.array_equal(a, b)


@pytest.mark.parametrize("mode", ["window", "window-quant", "quantized", "scored", "concat"])
def test_converting_a_float16_cache_to_other_modes_attends_as_float32_would(mode):
    """Conversion carries the float16 rows into modes the fused route does not take; MLX's
    attention (and the decode kernels) over them give the float32 cache's logits."""
    prompt = [int(t) for t in mx.random.randint(0, 256, (300,), key=mx.random.key(5))]
    settings = CacheSettings(mode=mode, sinks=4, window=64, evict_chunk=32, max_kv_tokens=256, quant_start=64,
                             kv_group_size=32, chunk_size=256)
    outs = []
    for kv in ("float16", "float32"):
        m = _model(kv)
        caches = make_caches(m, CacheSettings())
        with last_position_only():
            m(mx.array([prompt]), cache=caches)
        conv = convert_caches(caches, m, settings)
        assert conv.action == "converted"
        dtype = conv.caches[0].content()[0].dtype
        assert dtype == (mx.float16 if kv == "float16" else mx.float32)
        step = [np.array(m(mx.array([[t]]), cache=conv.caches)[0, -1]) for t in (1, 2, 3)]
        outs.append(step)
    for a, b in zip(*outs):
        assert _close(a, b, 5e-3)


def _views(n: int, kvh: int = 2, D: int = 32, cap: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, kvh, cap, D)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, kvh, cap, D)).astype(np.float16))
    return k[:, :, :n], v[:, :, :n]


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 100))
def test_decode_kernel_reads_float16_caches_as_mlx_sdpa_does(n, seed):
    k, v = _views(n, seed=seed)
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(seed))
    got = decode_full(q, k, v, 32 ** -0.5, None)
    assert got is not None
    ref = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float32), v.astype(mx.float32), scale=32 ** -0.5,
                                               mask=None)
    assert np.allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-5)


def test_decode_mixed_kernel_reads_float16_full_parts():
    from cache.attention import attend_segments

    k, v = _views(40)
    qk = mx.quantize(mx.random.normal((1, 2, 24, 32)), group_size=32, bits=8)
    qv = mx.quantize(mx.random.normal((1, 2, 24, 32)), group_size=32, bits=8)
    q = mx.random.normal((1, 4, 1, 32))
    parts = [("full", k[:, :, :4], v[:, :, :4]), ("quant", qk, qv), ("full", k[:, :, 4:], v[:, :, 4:])]
    got = decode_mixed(q, parts, 0.2, None, 8, 32, None)
    assert got is not None
    ref = attend_segments(q, parts, 0.2, None, 8, 32)
    assert np.allclose(np.array(got), np.array(ref), rtol=1e-4, atol=1e-5)


def test_the_plan_and_show_config_name_the_kv_dtype():
    from chatapp.backend.describe import cpu_backend_lines
    from chatapp.config import CpuConfig

    m = _model("float16")
    assert "K/V cache float16" in apply_fast_path(m, backend="cpu", warm_up=False, kv_dtype="float16").fused_decode
    assert fused_decoder(m).kv_dtype == "float16"
    lines = cpu_backend_lines(CpuConfig(kv_dtype="float32"))
    assert any("K/V cache float32 (cpu.kv_dtype = float32" in ln for ln in lines)
    with pytest.raises(ValueError):
        apply_fast_path(_model(None), backend="cpu", warm_up=False, kv_dtype="half")
    assert fused_install.KV_MX["float16"] == mx.float16
    # what the prefix store's namespace names as the caches' dtype (store/prefixes.namespace_for)
    assert fused_install.cache_kv_dtype(m) == mx.float16 and fused_install.cache_kv_dtype(_model(None)) is None
    assert fused_install.cache_kv_dtype(_model("float32")) == mx.float32
