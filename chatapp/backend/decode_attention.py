"""Decode-step attention for MLX's CPU backend: the single-query kernels of
`chatapp.kernels.attention` behind the cache's dispatch (`cache.set_decode_kernels`).

MLX's CPU SDPA for one query over N cached keys runs two batched matmuls on the wheel's bundled
reference BLAS and a scalar ``exp``: with Llama-2-7B's 32 heads of 128 it took 20 ms per layer
at 4,096 tokens (0.65 s per decoded token over 32 layers) against ~4 ms for the kernel, which
streams K and V once at memory speed. A window-quant history is read as MLX stored it (packed
8- or 4-bit K/V with per-group scales): no dequantised copy, 1.8 ms per layer at 4,096 tokens
with 8-bit KV. Each call evaluates the layer's query (a sync, as every CPU kernel here does).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np


def _handles(queries: mx.array, mask: Any) -> bool:
    return queries.shape[0] == 1 and queries.shape[2] == 1 and mask is None


def _float32(a: mx.array) -> np.ndarray:
    return np.asarray(a if a.dtype == mx.float32 else a.astype(mx.float32))


# the full-precision K/V dtypes the kernels read in place (float16 as its bits, kernels/half.py)
_KV_DTYPES = (mx.float32, mx.float16)


def _heads(a: mx.array, as_bytes: bool = False) -> tuple[np.ndarray, int]:
    """A cache view [1, heads, n, width] as the kernels' flat buffer and head stride (float16
    K/V as uint16 bits)."""
    from chatapp.kernels.attention import heads_view

    x = np.asarray(a)[0]
    if as_bytes:
        x = x.view(np.uint8)
    elif x.dtype == np.float16:
        x = x.view(np.uint16)
    return heads_view(x)


def _scale_view(a: mx.array) -> tuple[np.ndarray, int]:
    from .qlinear import scales_for_kernels

    return _heads(scales_for_kernels(a))


def decode_full(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array | None:
    """softmax(q K^T * scale) V for one query [1, H, 1, D] over float keys [1, KVH, N, D]."""
    from chatapp.kernels.attention import attend_full
    from chatapp.kernels.pool import chunks, pool

    if not _handles(queries, mask) or keys.shape[2] == 0 or queries.shape[1] % keys.shape[1]:
        return None
    if keys.dtype not in _KV_DTYPES or values.dtype != keys.dtype:
        return None  # the kernel reads float32 / float16 buffers in place; anything else stays on MLX
    if values.shape[3] != keys.shape[3]:
        return None  # values narrower than keys (multi-head latent attention): the kernel reads one D
    mx.eval(queries, keys, values)
    H, D = queries.shape[1], queries.shape[3]
    q = _float32(queries).reshape(H, D)
    (kf, ks), (vf, vs) = _heads(keys), _heads(values)
    out = np.empty((H, values.shape[3]), np.float32)
    pool().run(attend_full, chunks(H, 1), 1, q, keys.shape[1], kf, ks, vf, vs, keys.shape[2], np.float32(scale), out)
    res = mx.array(out).reshape(1, H, 1, -1)
    return res if queries.dtype == mx.float32 else res.astype(queries.dtype)


_EMPTY_F32 = np.zeros(0, np.float32)


def decode_mixed(queries: mx.array, parts: Sequence[tuple[str, Any, Any]], scale: float, mask: Any,
                 bits: int, group_size: int, quant_queries: mx.array | None) -> mx.array | None:
    """One query over [full sinks] | quantised middle | full recent, as attend_mixed builds them."""
    from chatapp.kernels.attention import attend_parts
    from chatapp.kernels.pool import chunks, pool
    from chatapp.kernels.qmatmul import GROUP_SIZES, group_sums, split_even_odd

    kinds = [p[0] for p in parts]
    if not _handles(queries, mask) or kinds not in (["full", "quant", "full"], ["quant", "full"]):
        return None
    if bits not in (4, 8) or group_size not in GROUP_SIZES:
        return None
    head = parts[0] if kinds[0] == "full" else None
    (_, qk, qv), (_, tk, tv) = parts[-2], parts[-1]
    full = ([head[1], head[2]] if head else []) + [tk, tv]
    if full[0].dtype not in _KV_DTYPES or any(a.dtype != full[0].dtype for a in full):
        return None
    if any(a.shape[3] != queries.shape[3] for a in full):
        return None  # keys and values of another width than the queries (MLA): MLX's route
    B, H, _, D = queries.shape
    qq_mx = queries if quant_queries is None else quant_queries
    mx.eval(queries, qq_mx, *full, *qk, *qv)
    q = _float32(queries).reshape(H, D)
    qq_nat = _float32(qq_mx).reshape(H, D)
    qqsum = group_sums(qq_nat, group_size)
    qq = np.concatenate(split_even_odd(qq_nat), axis=1) if bits == 4 else np.ascontiguousarray(qq_nat)
    if head:
        (khf, khs), (vhf, vhs) = _heads(head[1]), _heads(head[2])
        n_head = head[1].shape[2]
    else:
        empty = _EMPTY_F32 if full[0].dtype == mx.float32 else _EMPTY_F32.view(np.uint16)
        (khf, khs), (vhf, vhs), n_head = (empty, 0), (empty, 0), 0
    (ktf, kts), (vtf, vts) = _heads(tk), _heads(tv)
    quant = [_heads(qk[0], True), _scale_view(qk[1]), _scale_view(qk[2]),
             _heads(qv[0], True), _scale_view(qv[1]), _scale_view(qv[2])]
    if len({a.dtype for a, _ in quant[1:3] + quant[4:6]}) != 1:
        return None
    kvh = tk.shape[1]
    out = np.empty((H, D), np.float32)
    pool().run(
        attend_parts, chunks(H, 1), 1, q, qq, qqsum, kvh, (khf, vhf, ktf, vtf),
        np.array([khs, vhs, kts, vts], np.int64), n_head, tk.shape[2],
        tuple(a for a, _ in quant), np.array([s for _, s in quant], np.int64), qk[0].shape[2],
        bits, group_size, np.float32(scale), out,
    )
    res = mx.array(out).reshape(1, H, 1, D)
    return res if queries.dtype == mx.float32 else res.astype(queries.dtype)


def install_decode_attention(enabled: bool) -> str:
    """Route decode-step attention through the kernels (or, disabled, back to MLX's SDPA)."""
    from cache import set_decode_kernels

    if not enabled:
        set_decode_kernels(None, None)
        return "decode attention: MLX SDPA"
    set_decode_kernels(decode_full, decode_mixed)
    return "decode attention: kernel (float32, float16 and quantised KV read in place)"
