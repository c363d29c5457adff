"""Attention over a cache, and the dispatch that lets a cache compute its own attention.

mlx-lm's models call ``scaled_dot_product_attention`` imported by name from
``mlx_lm.models.base``. ``install_attention(model)`` wraps that name in the model's module so
that a cache with an ``attend`` method computes attention itself. A mixed cache (full-precision
sinks and recent window, quantised middle) then attends without dequantising its history:
scores for the quantised part come from ``quantized_matmul`` and for the full part from a plain
matmul, one softmax runs over the joined scores (the exact joint softmax, equivalent to a
log-sum-exp merge), and the outputs are summed. Caches that hold only full-precision tokens
hand the contiguous buffer slice to the fused ``mx.fast.scaled_dot_product_attention``.
Without the dispatch, ``update_and_fetch`` still returns correct (dequantised) arrays.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import mlx.core as mx

_WRAPPED_FLAG = "_chatapp_dispatch"

# A kernel for attention of several queries (a prefill chunk) over full-precision keys:
# ``kernel(queries, keys, values, scale, mask) -> mx.array | None`` (None: not handled).
# mx.fast.scaled_dot_product_attention serves when none is set. A backend may install a faster
# one: MLX's CPU SDPA is unfused and spends most of a long-context prefill in a scalar exp
# (chatapp.backend.cpu_attention installs a vectorised one there).
_prefill_kernel: Callable[..., mx.array | None] | None = None


# Kernels for a single query (a decode step), which a backend may install for the same reason:
# ``decode(queries, keys, values, scale, mask)`` over full-precision keys, and
# ``decode_mixed(queries, parts, scale, mask, bits, group_size, quant_queries)`` over the parts
# ``attend_mixed`` takes (quantised ones read as they are, never dequantised). Each may return
# None for a call it does not handle; MLX then serves.
_decode_kernel: Callable[..., mx.array | None] | None = None
_decode_mixed_kernel: Callable[..., mx.array | None] | None = None


def set_prefill_kernel(kernel: Callable[..., mx.array | None] | None):
    """Install (or with None remove) the multi-query attention kernel; returns the previous one."""
    global _prefill_kernel
    previous, _prefill_kernel = _prefill_kernel, kernel
    return previous


def prefill_kernel() -> Callable[..., mx.array | None] | None:
    return _prefill_kernel


def set_decode_kernels(full: Callable[..., mx.array | None] | None,
                       mixed: Callable[..., mx.array | None] | None) -> tuple:
    """Install (or with None remove) the single-query kernels; returns the previous pair."""
    global _decode_kernel, _decode_mixed_kernel
    previous = (_decode_kernel, _decode_mixed_kernel)
    _decode_kernel, _decode_mixed_kernel = full, mixed
    return previous


def decode_kernels() -> tuple:
    return _decode_kernel, _decode_mixed_kernel


def attend_full(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention over full-precision keys: the installed prefill kernel for several queries or
    decode kernel for one, else the fused SDPA."""
    kernel = _prefill_kernel if queries.shape[2] > 1 else _decode_kernel
    if kernel is not None:
        out = kernel(queries, keys, values, scale, mask)
        if out is not None:
            return out
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """Queries are the last ``n_queries`` positions of ``n_keys``."""
    q = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return q >= mx.arange(n_keys)[None]


def attend_mixed(
    queries: mx.array,
    parts: Sequence[tuple[str, Any, Any]],
    scale: float,
    mask: Any,
    bits: int,
    group_size: int,
    quant_queries: mx.array | None = None,
) -> mx.array:
    """Attention over key/value parts in sequence order.

    ``parts`` holds ("full", keys, values) or ("quant", (packed, scales, biases) x2) entries, or
    ("quant-channel", ChannelKeys, (packed, scales, biases)) for keys quantised per channel.
    ``quant_queries``, when given, are the queries positioned for the quantised parts (whose
    keys carry a rotation offset, see kv.py); the full parts use ``queries``.
    """
    if queries.shape[2] == 1 and _decode_mixed_kernel is not None:
        out = _decode_mixed_kernel(queries, parts, scale, mask, bits, group_size, quant_queries)
        if out is not None:
            return out
    return attend_segments(queries, parts, scale, mask, bits, group_size, quant_queries)


def attend_segments(queries: mx.array, parts: Sequence[tuple[str, Any, Any]], scale: float, mask: Any, bits: int,
                    group_size: int, quant_queries: mx.array | None = None) -> mx.array:
    """MLX's attention over key/value parts in sequence order.

    Scores for quantised parts come from ``quantized_matmul``, for full parts from a plain
    matmul; one softmax runs over the joined scores and the parts' outputs are summed.
    Half-precision queries on the CPU are cast to float32, since MLX's CPU quantized_matmul is
    ~7x slower with them.
    """
    B, n_q, L, D = queries.shape
    out_dtype = queries.dtype
    if out_dtype != mx.float32 and mx.default_device() == mx.cpu:
        queries = queries.astype(mx.float32)
        quant_queries = None if quant_queries is None else quant_queries.astype(mx.float32)
    n_kv = parts[0][2].shape[1] if parts[0][0] == "full" else parts[0][2][0].shape[1]
    grouped = lambda x: (x * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    qf = grouped(queries)
    qq = qf if quant_queries is None else grouped(quant_queries)
    scores = []
    for kind, k, _ in parts:
        if kind == "full":
            scores.append(qf @ mx.expand_dims(k, 2).swapaxes(-1, -2))
        elif kind == "quant-channel":  # keys per channel (quant_channel.ChannelKeys)
            scores.append(k.scores(qq))
        else:
            kq = [mx.expand_dims(x, 2) for x in k]
            scores.append(mx.quantized_matmul(qq, *kq, transpose=True, group_size=group_size, bits=bits))
    s = mx.concatenate(scores, axis=-1) if len(scores) > 1 else scores[0]
    if isinstance(mask, str) or (mask is None and L > 1):
        mask = causal_mask(L, s.shape[-1])
    if mask is not None:
        s = mx.where(mask, s, mx.finfo(s.dtype).min) if mask.dtype == mx.bool_ else s + mask
    p = mx.softmax(s, axis=-1, precise=True)
    out, start = None, 0
    for (kind, _, v), sc in zip(parts, scores):
        pi = p[..., start : start + sc.shape[-1]]
        start += sc.shape[-1]
        if kind == "full":
            o = pi @ mx.expand_dims(v, 2)
        else:
            vq = [mx.expand_dims(x, 2) for x in v]
            o = mx.quantized_matmul(pi, *vq, transpose=False, group_size=group_size, bits=bits)
        out = o if out is None else out + o
    return out.reshape(B, n_q, L, -1).astype(out_dtype)


def _make_dispatch(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        attend = getattr(cache, "attend", None)
        if attend is not None and not cache.serves(keys, values):
            # the model attends over arrays of its own (latent attention): use them as passed
            cache.decline_attend()
            attend = None
        if attend is not None and sinks is None and not kwargs:
            return attend(queries, scale=scale, mask=mask)
        if attend is not None:  # a call attend() cannot serve: use the whole (dequantised) history
            keys, values = cache.content()
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs)

    setattr(scaled_dot_product_attention, _WRAPPED_FLAG, original)
    return scaled_dot_product_attention


def install_attention(model) -> list[str]:
    """Route the model's attention through caches that provide ``attend``.

    Patches the ``scaled_dot_product_attention`` name in every module that defines one of the
    model's classes (and mlx-lm's base). Idempotent; returns the patched module names.
    """
    names = {"mlx_lm.models.base"}
    for _, m in model.named_modules():
        names.add(type(m).__module__)
    names.add(type(model).__module__)
    patched = []
    for name in sorted(names):
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None) if mod else None
        if fn is None or hasattr(fn, _WRAPPED_FLAG):
            continue
        setattr(mod, "scaled_dot_product_attention", _make_dispatch(fn))
        patched.append(name)
    return patched
