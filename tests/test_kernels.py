"""chatapp.kernels: the packed-weight products and the decode attention kernels against MLX
(`mx.dequantize` then a matmul; MLX's SDPA), and the work pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from chatapp.kernels import attention as A  # noqa: E402
from chatapp.kernels import kernel_info  # noqa: E402
from chatapp.kernels import qmatmul as Q  # noqa: E402
from chatapp.kernels.pool import WorkPool, pool  # noqa: E402

SLOW = settings(max_examples=25, deadline=None)


def packed(w: mx.array, bits: int, group_size: int, scale_dtype=mx.float32) -> tuple[Q.PackedWeight, np.ndarray]:
    """The kernels' view of quantize(w), and the float32 weight MLX dequantises it to."""
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    mx.eval(wq, s, b)
    view = (lambda a: np.asarray(a.view(mx.uint16))) if scale_dtype == mx.float16 else np.asarray
    pw = Q.PackedWeight(np.asarray(wq).view(np.uint8), view(s), view(b), bits, group_size)
    ref = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=bits)
    return pw, np.asarray(ref)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


def product_err(got: np.ndarray, x: np.ndarray, w: np.ndarray) -> float:
    """got's error against x @ w.T relative to the size of the terms summed (|x| @ |w|.T): a
    product that cancels to near zero (one row, one token) is still held to float32 rounding."""
    return float(np.abs(got - x @ w.T).max() / max((np.abs(x) @ np.abs(w).T).max(), 1e-6))


@st.composite
def weights(draw):
    bits = draw(st.sampled_from(Q.BITS))
    group_size = draw(st.sampled_from(Q.GROUP_SIZES))
    k = draw(st.integers(1, 4)) * 128  # a multiple of 64 and of every group size
    n = draw(st.integers(1, 70))
    tokens = draw(st.integers(1, 6))
    scale_dtype = draw(st.sampled_from([mx.float32, mx.float16]))
    seed = draw(st.integers(0, 2**16))
    return bits, group_size, n, k, tokens, scale_dtype, seed


@SLOW
@given(weights())
@example((4, 32, 1, 128, 1, mx.float32, 1212))  # one row whose product cancels to -0.06 from terms of ~96
def test_products_match_dequantize_then_matmul(case):
    bits, group_size, n, k, tokens, scale_dtype, seed = case
    key = mx.random.key(seed)
    pw, w = packed(mx.random.normal((n, k), key=key), bits, group_size, scale_dtype)
    x = np.random.default_rng(seed).standard_normal((tokens, k)).astype(np.float32)
    assert product_err(Q.matmul(pw, x), x, w) < 2e-6
    # one token takes the four-row route (rows4.py), several the row route: the same sums
    np.testing.assert_array_equal(Q.matmul(pw, x[:1]), Q.matmul(pw, np.repeat(x[:1], 2, axis=0))[:1])
    assert product_err(Q.matmul_dequantized(pw, x, Q.Scratch()), x, w) < 2e-6
    np.testing.assert_allclose(Q.dequantize(pw), w, rtol=0, atol=1e-5 * float(np.abs(w).max()))


def test_dequantized_products_cross_several_blocks(monkeypatch):
    monkeypatch.setattr(Q, "SCRATCH_BYTES", 16 * 256 * 4)  # 16-row blocks: 5 blocks + a short one
    pw, w = packed(mx.random.normal((90, 256)), 4, 64)
    x = np.random.default_rng(1).standard_normal((9, 256)).astype(np.float32)
    scratch = Q.Scratch()
    assert rel_err(Q.matmul_dequantized(pw, x, scratch), x @ w.T) < 2e-5
    assert rel_err(Q.matmul_dequantized(pw, x[:3], scratch), x[:3] @ w.T) < 2e-5  # scratch reused


@pytest.mark.parametrize("bits, group_size, width, why", [
    (3, 64, 128, "3-bit"), (6, 64, 128, "6-bit"), (4, 16, 128, "group size 16"),
    (4, 32, 96, "not a multiple of 64"), (4, 64, 128, None), (8, 128, 256, None),
])
def test_unsupported_says_why(bits, group_size, width, why):
    got = Q.unsupported(bits, group_size, width)
    assert (got is None) if why is None else why in got
    assert "mode" in Q.unsupported(4, 32, 128, mode="mxfp4")


def fast_exp_values(x: np.ndarray) -> np.ndarray:
    from numba import njit

    @njit(fastmath=True)
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = A.fast_exp(x[i])

    out = np.empty_like(x)
    run(x, out)
    return out


def test_fast_exp_accuracy():
    x = np.concatenate([np.linspace(-87, 88, 20001), [-1e4, -200.0]]).astype(np.float32)
    got, ref = fast_exp_values(x), np.exp(x.astype(np.float64))
    ok = x > -87
    assert np.max(np.abs(got[ok] - ref[ok]) / ref[ok]) < 1e-6
    assert np.all(got[~ok] < 1e-37) and np.all(np.isfinite(got))


def cache_view(heads: int, n: int, dim: int, capacity: int, seed: int) -> mx.array:
    """[1, heads, n, dim] held in a [1, heads, capacity, dim] buffer, as the caches hand it out."""
    buf = mx.random.normal((1, heads, capacity, dim), key=mx.random.key(seed))
    view = buf[:, :, :n]
    mx.eval(view)
    return view


def run_attend_full(q: mx.array, k: mx.array, v: mx.array, scale: float) -> np.ndarray:
    H, D = q.shape[1], q.shape[3]
    (kf, ks), (vf, vs) = A.heads_view(np.asarray(k)[0]), A.heads_view(np.asarray(v)[0])
    out = np.empty((H, D), np.float32)
    pool().run(A.attend_full, H, 1, np.asarray(q).reshape(H, D), k.shape[1], kf, ks, vf, vs, k.shape[2],
               np.float32(scale), out)
    return out


@SLOW
@given(st.sampled_from([(4, 4), (8, 2), (6, 1)]), st.sampled_from([32, 64, 128]), st.integers(1, 300),
       st.integers(0, 64), st.floats(0.05, 3.0), st.integers(0, 2**16))
def test_attend_full_matches_sdpa(heads, dim, n, spare, scale, seed):
    H, KVH = heads
    q = mx.random.normal((1, H, 1, dim), key=mx.random.key(seed)) * 3
    k, v = cache_view(KVH, n, dim, n + spare, seed + 1), cache_view(KVH, n, dim, n + spare, seed + 2)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    assert rel_err(run_attend_full(q, k, v, scale), np.asarray(ref).reshape(H, dim)) < 1e-4


def run_attend_parts(q, qq, parts, bits, group_size, scale):
    """parts: [("full", k, v)?, ("quant", (packed, s, b) x2), ("full", k, v)] as attend_mixed takes."""
    H, D = q.shape[1], q.shape[3]
    qn, qqn = np.asarray(q).reshape(H, D), np.asarray(qq).reshape(H, D)
    qqk = np.concatenate(Q.split_even_odd(qqn), axis=1) if bits == 4 else qqn
    head = parts[0] if len(parts) == 3 else None
    _, qk, qv = parts[-2]
    _, tk, tv = parts[-1]
    hv = lambda a, u8=False: A.heads_view(np.asarray(a)[0].view(np.uint8) if u8 else np.asarray(a)[0])  # noqa: E731
    empty = (np.zeros(0, np.float32), 0)
    full = [hv(head[1]), hv(head[2])] if head else [empty, empty]
    full += [hv(tk), hv(tv)]
    quant = [hv(qk[0], True), hv(qk[1]), hv(qk[2]), hv(qv[0], True), hv(qv[1]), hv(qv[2])]
    out = np.empty((H, D), np.float32)
    pool().run(A.attend_parts, H, 1, qn, qqk, Q.group_sums(qqn, group_size), tk.shape[1],
               tuple(a for a, _ in full), np.array([s for _, s in full], np.int64), head[1].shape[2] if head else 0,
               tk.shape[2], tuple(a for a, _ in quant), np.array([s for _, s in quant], np.int64), qk[0].shape[2],
               bits, group_size, np.float32(scale), out)
    return out


@SLOW
@given(st.sampled_from([4, 8]), st.sampled_from([32, 64]), st.integers(0, 4), st.integers(1, 200),
       st.integers(0, 40), st.booleans(), st.integers(0, 2**16))
def test_attend_parts_matches_sdpa_over_dequantised(bits, group_size, sinks, middle, recent, shifted, seed):
    H, KVH, D = 8, 4, 64
    n = sinks + middle + recent
    k, v = cache_view(KVH, n, D, n + 16, seed), cache_view(KVH, n, D, n + 16, seed + 1)
    q = mx.random.normal((1, H, 1, D), key=mx.random.key(seed + 2))
    qq = mx.random.normal((1, H, 1, D), key=mx.random.key(seed + 3)) if shifted else q
    kq = mx.quantize(k[:, :, sinks:sinks + middle], group_size=group_size, bits=bits)
    vq = mx.quantize(v[:, :, sinks:sinks + middle], group_size=group_size, bits=bits)
    mx.eval(kq, vq)
    deq = lambda t: mx.dequantize(*t, group_size=group_size, bits=bits)  # noqa: E731
    parts = [("full", k[:, :, :sinks], v[:, :, :sinks]), ("quant", kq, vq),
             ("full", k[:, :, sinks + middle:], v[:, :, sinks + middle:])]
    if not sinks:
        parts = parts[1:]
    scale = D**-0.5
    # reference: scores of the quantised part use the shifted queries, the full parts q
    s_full = lambda kk: (q * scale).reshape(1, KVH, 2, 1, D) @ mx.expand_dims(kk, 2).swapaxes(-1, -2)  # noqa: E731
    s_quant = (qq * scale).reshape(1, KVH, 2, 1, D) @ mx.expand_dims(deq(kq), 2).swapaxes(-1, -2)
    scores = mx.concatenate([s_full(k[:, :, :sinks]), s_quant, s_full(k[:, :, sinks + middle:])], axis=-1)
    p = mx.softmax(scores, axis=-1, precise=True)
    vals = mx.concatenate([v[:, :, :sinks], deq(vq), v[:, :, sinks + middle:]], axis=2)
    ref = (p @ mx.expand_dims(vals, 2)).reshape(H, D)
    assert rel_err(run_attend_parts(q, qq, parts, bits, group_size, scale), np.asarray(ref)) < 1e-4


def test_heads_view_shares_memory_and_copies_only_scattered_rows():
    buf = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    flat, stride = A.heads_view(buf[:, :3])
    assert stride == 40 and np.shares_memory(flat, buf) and flat.shape == (40 + 12,)
    assert flat[stride:stride + 12].reshape(3, 4).tolist() == buf[1, :3].tolist()
    flat, stride = A.heads_view(buf[:, :3, ::2])  # rows not contiguous: copied
    assert (not np.shares_memory(flat, buf)
            and flat[stride:stride + 6].reshape(3, 2).tolist() == buf[1, :3, ::2].tolist())


def test_pool_map_covers_every_item_once_and_reraises():
    p = WorkPool(3)
    try:
        seen = []
        p.map(lambda i, worker: seen.append(i), 50)
        assert sorted(seen) == list(range(50))
        with pytest.raises(ZeroDivisionError):
            p.map(lambda i, worker: 1 // (i - 7), 10)
        p.map(lambda i, w: None, 0)
    finally:
        p.close()


def test_pool_run_with_one_thread_and_no_chunks():
    pw, w = packed(mx.random.normal((40, 128)), 4, 32)
    x = np.ones((1, 128), np.float32)
    single = WorkPool(1)
    out = np.empty((1, 40), np.float32)
    xe, xo = Q.split_even_odd(x)
    single.run(Q._matmul, 3, 16, pw.packed, pw.scales, pw.biases, xe, xo, Q.group_sums(x, 32), out, 32, 4)
    assert rel_err(out, x @ w.T) < 2e-5
    single.run(Q._matmul, 0, 16)  # nothing to do: no call at all


def test_kernel_info_names_cpu_and_threads():
    info = kernel_info()
    assert info.ok and info.cpu and info.threads >= 1
    assert info.numba in info.summary() and "threads" in info.summary()


def test_float16_scales_fall_back_to_float32_without_native_conversion(monkeypatch):
    """Where the CPU cannot convert half floats in one instruction (x86-64 without F16C) the
    kernels get float32 scales instead of float16 bits."""
    import chatapp.kernels as K
    from chatapp.backend.qlinear import packed_view

    wq, s, b = mx.quantize(mx.random.normal((8, 64)), group_size=32, bits=4)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    assert packed_view(wq, s16, b16, 4, 32).scales.dtype == (np.uint16 if K.half_scales_native() else np.float32)
    monkeypatch.setattr(K, "half_scales_native", lambda: False)
    pw = packed_view(wq, s16, b16, 4, 32)
    assert pw.scales.dtype == np.float32 and pw.biases.dtype == np.float32
