"""Prefill attention for MLX's CPU backend, vectorised with numpy.

MLX's CPU `scaled_dot_product_attention` is not a fused kernel: it materialises the scores, runs
a scalar `exp` over them (about 12 ns per element on this x86_64 box; numpy's SIMD exp takes
0.4 ns) and does its products as slow batched matmuls. With a long conversation that is most of
a turn's time to first token. Measured here (one layer, 2 cores, ms):

    heads  kv  dim  queries  keys    MLX SDPA   this kernel
      8     4    8      27   1210       5.5        0.42     (stories260K at turn 20)
     32    32  128      27   1210     142         14        (Llama-2-7B geometry)
     32     8  128      27   1210     143          8.2
     32    32  128     512   2048   4,649        252

The kernel runs only for several queries (prefill chunks); decode steps keep MLX's SDPA, whose
single-query path has no such cost and stays inside MLX's lazy graph. Computing here evaluates
the layer's queries, keys and values first (one sync per layer), which prefill can afford.
Scores are formed in float32 per KV head group, in query blocks that keep the score matrix under
`MAX_SCORE_BYTES`, with the causal mask MLX uses (queries are the last positions).

numpy's products run on numpy's own bundled OpenBLAS, on one thread here: its thread pool next
to MLX's made prefill up to 4x slower and bimodal on two cores (see numpy_blas.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from .numpy_blas import numpy_blas

MAX_SCORE_BYTES = 64 * 1024 * 1024
SMALL_KEYS = 256 * 1024  # elements; see _attention
SAFE_EXP = 80.0  # float32 exp overflows past ~88.7 and leaves normal numbers below ~-87.3


def numpy_prefill_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                            mask: Any) -> mx.array | None:
    """softmax(q k^T * scale + causal) v for queries [B, H, L, D] over keys [B, KVH, N, D].

    Handles mask None or "causal"; returns None (use MLX) for explicit mask arrays.
    """
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        return None
    B, H, L, D = queries.shape
    KVH, N = keys.shape[1], keys.shape[2]
    if H % KVH or N < L:
        return None
    with numpy_blas().single_threaded():
        return _attention(queries, keys, values, scale, mask)


def _attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    B, H, L, D = queries.shape
    KVH, N = keys.shape[1], keys.shape[2]
    G, Dv = H // KVH, values.shape[-1]
    # numpy has no bfloat16, and float32 is the precision the softmax wants anyway.
    q, k, v = (np.asarray(x if x.dtype == mx.float32 else x.astype(mx.float32)) for x in (queries, keys, values))
    out = np.empty((B, H, L, Dv), np.float32)
    block = max(1, min(L, MAX_SCORE_BYTES // (4 * H * N)))
    first = N - L  # position of the first query
    for b in range(B):
        kb = k[b]
        if kb.size <= SMALL_KEYS:
            # a cache view is strided (its buffer has spare capacity); BLAS wants each head's keys
            # contiguous, and copying a small history is cheaper than numpy's strided fallback
            kb = np.ascontiguousarray(kb)
        kt = kb.transpose(0, 2, 1)  # [KVH, D, N]
        for l0 in range(0, L, block):
            l1 = min(L, l0 + block)
            n = l1 - l0
            # query head h uses KV head h // G: the heads of one group are adjacent
            qb = (q[b, :, l0:l1] * np.float32(scale)).reshape(KVH, G * n, D)
            s = np.matmul(qb, kt).reshape(KVH, G, n, N)
            if mask is not None:
                # query i (position first + l0 + i) sees keys 0 .. first + l0 + i
                lo = first + l0
                s[..., lo:lo + n] += np.triu(np.full((n, n), -np.inf, np.float32), 1)
                s[..., lo + n:] = -np.inf
            m = s.max(axis=-1, keepdims=True)
            # Softmax is shift-invariant; the usual max subtraction only guards exp against
            # overflow (and whole rows underflowing). When every row's max lies within +-80,
            # exp(s) is safe in float32 as it is, and skipping the pass saves ~10% here.
            if not (-SAFE_EXP <= m.min() and m.max() <= SAFE_EXP):
                s -= m
            np.exp(s, out=s)
            den = s.sum(axis=-1, keepdims=True)
            o = np.matmul(s.reshape(KVH, G * n, N), v[b]).reshape(KVH, G, n, Dv) / den
            out[b, :, l0:l1] = o.reshape(H, n, Dv)
    res = mx.array(out)
    return res if queries.dtype == mx.float32 else res.astype(queries.dtype)


def install_prefill_attention(backend: str, enabled: bool = True) -> str:
    """Use the numpy kernel for prefill attention when running on MLX's CPU backend.

    Returns a one-line description for the startup summary.
    """
    from cache import set_prefill_kernel

    if (backend or "").lower() != "cpu":
        set_prefill_kernel(None)
        return f"prefill attention: MLX SDPA (backend {backend})"
    if not enabled:
        set_prefill_kernel(None)
        return "prefill attention: MLX SDPA (cpu.fast_attention = false)"
    set_prefill_kernel(numpy_prefill_attention)
    return "prefill attention: numpy kernel"
