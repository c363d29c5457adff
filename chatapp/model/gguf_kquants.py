"""GGUF's 5-bit and K-quant blocks rewritten as MLX's affine group-32 layout, once, at load (numpy).

MLX's quantised layers hold, per group of 32 values of a row, ``bits``-bit unsigned quants
packed as a little-endian bit stream into uint32 words, plus a scale and a bias:
``x = scale * q + bias``. Each GGUF type below becomes such a layer (never a float matrix):

========  =================================================  =======================  =========
type      GGUF block                                         MLX layout               exact?
========  =================================================  =======================  =========
Q5_0      32 values, fp16 ``d``, ``x = d * (q - 16)``        5-bit, fp16 scale/bias   yes
Q5_1      32 values, fp16 ``d``, ``m``, ``x = d * q + m``    5-bit, fp16 scale/bias   yes
Q4_K      256 values, 8 sub-blocks of 32 with 6-bit scale    4-bit, fp32 scale/bias   yes
          ``sc`` and min ``m``: ``x = d*sc*q - dmin*m``
Q5_K      as Q4_K with a fifth bit per value                 5-bit, fp32 scale/bias   yes
Q6_K      256 values, 16 sub-blocks of *16* with int8        8-bit, fp32 scale/bias   no (below)
          scales: ``x = d * sc * (q - 32)``
========  =================================================  =======================  =========

"Exact": scale * q + bias is the value llama.cpp's (and the ``gguf`` package's) dequantisation
gives, in float32 (the products are exact: an fp16 ``d`` times a 6-bit ``sc`` needs 17 of
float32's 24 bits, hence float32 scales for the K-quants; the 5-bit types' ``-16 d`` is exact in
fp16 while it fits: |d| < 4096, where weights' ``d`` are ~1e-3..1e-1, as for mx.load's Q4_0).

Q6_K's sub-blocks are 16 values and MLX's smallest group is 32, so a group holds two sub-blocks
with different scales ``s1 = d*sc1`` and ``s2 = d*sc2``. It becomes 8-bit: the group's scale is
``S = |s_big| / 4`` for the sub-block with the larger ``|sc|``, whose 64 levels are then every
4th of the 256 (exact, up to float32's rounding of ``S * k + bias``); the other sub-block's
values are rounded to that grid, an error of at most ``S / 2 = d * max|sc| / 8`` per value (an
eighth of the larger sub-block's step; zero when ``4 * sc2 / sc1`` is a whole number), or ``S``
in the rare group whose two sub-blocks, of opposite signs, need 257 levels. On Gaussian weights
the added error is ~0.20 of Q6_K's own rounding error (rms; tests/test_gguf_kquants.py).
Memory: 10 bits a weight where the file has 6.56.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP = 32


@dataclass(frozen=True)
class Layout:
    """What a GGUF type becomes in MLX."""

    bits: int
    scale_dtype: type  # numpy dtype of the scales and biases (np.float16 or np.float32)
    exact: bool
    block_bytes: int
    block: int  # values per GGUF block

    def describe(self) -> str:
        kind = "fp16" if self.scale_dtype is np.float16 else "fp32"
        return f"{self.bits}-bit g{GROUP} {kind} scales" + ("" if self.exact else " (requantised, not exact)")


LAYOUTS: dict[str, Layout] = {
    "Q5_0": Layout(5, np.float16, True, 22, 32),
    "Q5_1": Layout(5, np.float16, True, 24, 32),
    "Q4_K": Layout(4, np.float32, True, 144, 256),
    "Q5_K": Layout(5, np.float32, True, 176, 256),
    "Q6_K": Layout(8, np.float32, False, 210, 256),
}


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 quants [..., K] (each < 2**bits, K a multiple of 8) -> the bytes of MLX's packed
    words [..., K * bits / 8]: a little-endian bit stream, value i at bits [i*bits, (i+1)*bits)."""
    if bits == 8:
        return q
    if bits == 4:
        return q[..., 0::2] | (q[..., 1::2] << 4)
    from chatapp.kernels.bitstream import pack_bits_rows

    return pack_bits_rows(q, bits)  # natively: eight numpy passes took 0.38 s of a Q4_K_M load


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row (uint8 [n, 2]) -> float32 [n] from their float16."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _five_bit(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: 16 bytes of nibbles (element j low, j + 16 high) + 4 bytes of fifth bits
    (bit j of the little-endian uint32 for element j) -> uint8 [n, 32] (kernels/kquant_blocks.py)."""
    from chatapp.kernels.kquant_blocks import five_bit_values

    out = np.empty((qs.shape[0], 32), np.uint8)
    five_bit_values(np.ascontiguousarray(qs), np.ascontiguousarray(qh), out)
    return out


def _q5_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    q = _five_bit(b[:, 6:22], b[:, 2:6])
    return q, d[:, None], (-16 * d)[:, None]


def _q5_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _five_bit(b[:, 8:24], b[:, 4:8])
    return q, d[:, None], m[:, None]


def k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> the 8 sub-blocks' 6-bit scales and mins (ggml's
    get_scale_min_k4): bytes 0-3 and 4-7 hold sub-blocks 0-3's scale and min in their low 6 bits
    and sub-blocks 4-7's top 2 bits in their top 2; bytes 8-11 hold sub-blocks 4-7's low nibbles."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=1)
    return sc, mn


def _k_affine(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    return (d[:, None] * sc.astype(np.float32)), -(dmin[:, None] * mn.astype(np.float32))


def _q4_k(b: np.ndarray):
    scale, bias = _k_affine(b)
    qs = b[:, 16:144].reshape(-1, 4, 32)  # 4 runs of 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 256)
    return q, scale, bias


def _q5_k(b: np.ndarray):
    scale, bias = _k_affine(b)
    qh = b[:, 16:48]  # bit s of byte l: the fifth bit of value l of sub-block s
    qs = b[:, 48:176].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (q | (high << 4)).reshape(-1, 256), scale, bias


def q6_k_values(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks -> (signed quants int16 [n, 256] in -32..31, sub-block scales float32 [n, 16] =
    d * sc): value i is ``scales[i // 16] * quants[i]``."""
    ql = b[:, 0:128].reshape(-1, 2, 64)  # per half of 128 values: 64 bytes of nibbles
    qh = b[:, 128:192].reshape(-1, 2, 32)  # per half: 32 bytes of 2-bit pairs
    low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(-1, 2, 4, 32)  # values l, l+32, l+64, l+96
    high = (qh[:, :, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.int16) - 32
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    return q.reshape(-1, 256), d[:, None] * sc


def _q6_k(b: np.ndarray):
    """8-bit groups of 32 from two 16-value sub-blocks (see the module's docstring), natively
    (kernels/kquant_blocks.py)."""
    from chatapp.kernels.kquant_blocks import q6_k_groups

    q, s = q6_k_values(b)
    groups = q.size // 32
    k = np.empty((groups, 32), np.uint8)
    scale, bias = np.empty(groups, np.float32), np.empty(groups, np.float32)
    q6_k_groups(np.ascontiguousarray(q.reshape(groups, 32)), np.ascontiguousarray(s.reshape(groups, 2)), k, scale,
                bias)
    return k.reshape(-1, 256), scale.reshape(-1, 8), bias.reshape(-1, 8)


_AFFINE = {"Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def affine_blocks(kind: str, raw: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rows`` rows of ``kind`` blocks (raw uint8 bytes) -> MLX's arrays for them: the packed
    words' bytes (uint8 [rows, cols * bits / 8]) and the scales and biases ([rows, cols / 32] of
    the layout's dtype)."""
    lay = LAYOUTS[kind]
    blocks = np.ascontiguousarray(raw).reshape(-1, lay.block_bytes)
    q, scale, bias = _AFFINE[kind](blocks)
    packed = pack_bits(q.reshape(rows, -1), lay.bits)
    dt = lay.scale_dtype
    return packed, scale.reshape(rows, -1).astype(dt), bias.reshape(rows, -1).astype(dt)


def dequantize(kind: str, raw: np.ndarray, rows: int) -> np.ndarray:
    """The float32 values the MLX layout of ``raw`` stands for ([rows, cols]), by numpy: what the
    tests compare with the ``gguf`` package's reference."""
    lay = LAYOUTS[kind]
    blocks = np.ascontiguousarray(raw).reshape(-1, lay.block_bytes)
    q, scale, bias = _AFFINE[kind](blocks)
    dt = lay.scale_dtype
    q = q.reshape(rows, -1, GROUP).astype(np.float32)
    scale = scale.reshape(rows, -1, 1).astype(dt).astype(np.float32)
    bias = bias.reshape(rows, -1, 1).astype(dt).astype(np.float32)
    return (q * scale + bias).reshape(rows, -1)
