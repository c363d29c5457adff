"""Simple quantisers for GGUF's Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks (numpy), for test models.

Plain min/max (or max-abs) rounding, not llama.cpp's error-minimising search: the blocks are
valid (llama.cpp and the ``gguf`` package read them) and the values they stand for are returned
with them, which is all the tests and benches need. Byte layouts as in ggml-common.h; the
reader's side is :mod:`chatapp.model.gguf_kquants`.
"""

from __future__ import annotations

import numpy as np

Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = 6, 7, 12, 13, 14


def _rows(x: np.ndarray, block: int) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape[-1] % block:
        raise ValueError(f"the innermost dimension ({x.shape[-1]}) must be a multiple of {block}")
    return x.reshape(-1, block)


def _h(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 of ``v`` [n] as bytes [n, 2], and its float32 value."""
    h = np.asarray(v, np.float32).astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _inv(d: np.ndarray) -> np.ndarray:
    return np.where(d == 0, 0, 1 / np.where(d == 0, 1, d))


def _five(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """32 5-bit values a row -> (qh: 4 bytes of fifth bits, qs: 16 bytes, j low / j + 16 high)."""
    qh = np.packbits((q >> 4).astype(np.uint8), axis=1, bitorder="little")
    qs = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)
    return qh, qs.astype(np.uint8)


def quantize_q5_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = _rows(x, 32)
    idx = np.abs(b).argmax(axis=1)
    db, d = _h(b[np.arange(len(b)), idx] / -16)
    q = np.clip(np.floor(b * _inv(d)[:, None] + 16.5), 0, 31).astype(np.uint8)
    qh, qs = _five(q)
    raw = np.concatenate([db, qh, qs], axis=1)
    return raw.tobytes(), ((q.astype(np.float32) - 16) * d[:, None]).reshape(np.shape(x))


def quantize_q5_1(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = _rows(x, 32)
    lo, hi = b.min(axis=1), b.max(axis=1)
    db, d = _h((hi - lo) / 31)
    mb, m = _h(lo)
    q = np.clip(np.floor((b - m[:, None]) * _inv(d)[:, None] + 0.5), 0, 31).astype(np.uint8)
    qh, qs = _five(q)
    raw = np.concatenate([db, mb, qh, qs], axis=1)
    return raw.tobytes(), (q * d[:, None] + m[:, None]).reshape(np.shape(x))


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins a block -> Q4_K/Q5_K's 12 bytes (inverse of gguf_kquants.k_scale_min)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((len(sc), 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _k_affine(x: np.ndarray, levels: int):
    """Super-blocks of 256 -> (d, dmin bytes, 12 scale bytes, quants [n, 8, 32], values)."""
    b = _rows(x, 256).reshape(-1, 8, 32)
    lo = np.minimum(b.min(axis=2), 0)  # the sub-blocks' mins (x = d*sc*q - dmin*m, m >= 0)
    span = (b.max(axis=2) - lo) / levels
    db, d = _h(span.max(axis=1) / 63)
    mb, dmin = _h(-lo.min(axis=1) / 63)
    sc = np.clip(np.rint(span * _inv(d)[:, None]), 0, 63)
    mn = np.clip(np.rint(-lo * _inv(dmin)[:, None]), 0, 63)
    scale = d[:, None] * sc.astype(np.float32)
    bias = dmin[:, None] * mn.astype(np.float32)
    q = np.clip(np.rint((b + bias[:, :, None]) * _inv(scale)[:, :, None]), 0, levels).astype(np.uint8)
    values = scale[:, :, None] * q.astype(np.float32) - bias[:, :, None]
    return np.concatenate([db, mb, pack_k_scales(sc, mn)], axis=1), q, values


def quantize_q4_k(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    head, q, values = _k_affine(x, 15)
    runs = q.reshape(-1, 4, 2, 32)
    qs = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qs], axis=1).tobytes(), values.reshape(np.shape(x))


def quantize_q5_k(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    head, q, values = _k_affine(x, 31)
    qh = np.zeros((len(q), 32), np.uint8)
    for s in range(8):  # bit s of byte l: the fifth bit of value l of sub-block s
        qh |= ((q[:, s] >> 4) & 1) << s
    runs = (q & 15).reshape(-1, 4, 2, 32)
    qs = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([head, qh, qs], axis=1).tobytes(), values.reshape(np.shape(x))


def quantize_q6_k(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = _rows(x, 256).reshape(-1, 16, 16)
    idx = np.abs(b).argmax(axis=2)
    signed_max = np.take_along_axis(b, idx[:, :, None], 2)[:, :, 0]
    scale = signed_max / -32  # x = scale * (q - 32), the extreme at q = 0
    big = np.abs(scale).max(axis=1)
    db, d = _h(big / 127)
    sc = np.clip(np.rint(scale * _inv(d)[:, None]), -128, 127).astype(np.int8)
    s = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(b * _inv(s)[:, :, None]) + 32, 0, 63).astype(np.uint8)
    values = s[:, :, None] * (q.astype(np.float32) - 32)
    h = q.reshape(-1, 2, 4, 32)  # per half of 128: values 32j + l
    low, high = h & 15, h >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    raw = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), db], axis=1)
    return raw.tobytes(), values.reshape(np.shape(x))


QUANTIZERS = {Q5_0: quantize_q5_0, Q5_1: quantize_q5_1, Q4_K: quantize_q4_k, Q5_K: quantize_q5_k,
              Q6_K: quantize_q6_k}
