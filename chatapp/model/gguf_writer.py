"""A small GGUF (v3) writer: metadata, F32/F16 tensors and the Q4_0/Q4_1/Q8_0 block quants (and
Q5_0/Q5_1/Q4_K/Q5_K/Q6_K from gguf_kquant_writer).

Used by the benches (a random Llama for llama.cpp to run) and by the tests (small GGUF files
whose every number is known). numpy only; no MLX. The quantisers follow ggml's reference ones
(ggml-quants.c): Q4_0 ``x = d * (q - 8)``, Q4_1 ``x = d * q + m``, Q8_0 ``x = d * q``, blocks of
32 with float16 ``d`` (and ``m``). In a 4-bit block, element j sits in the low nibble of byte j
and element j + 16 in its high nibble.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .gguf_kquant_writer import Q4_K, Q5_0, Q5_1, Q5_K, Q6_K  # noqa: F401 - the type ids, with the others
from .gguf_kquant_writer import QUANTIZERS as K_QUANTIZERS

GGUF_MAGIC = b"GGUF"
ALIGN = 32
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = range(10)
T_UINT64, T_INT64, T_FLOAT64 = 10, 11, 12
_FMT = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
        T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
BLOCK = 32


@dataclass(frozen=True)
class Typed:
    """A metadata value with its GGUF type given (``etype`` for the items of an array)."""

    vtype: int
    value: Any
    etype: int | None = None


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _infer(value: Any) -> Typed:
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(T_BOOL, value)
    if isinstance(value, int):
        return Typed(T_INT32 if value < 0 else T_UINT32, value)
    if isinstance(value, float):
        return Typed(T_FLOAT32, value)
    if isinstance(value, str):
        return Typed(T_STRING, value)
    if isinstance(value, (list, tuple)):
        items = list(value)
        if all(isinstance(v, str) for v in items):
            return Typed(T_ARRAY, items, T_STRING)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            return Typed(T_ARRAY, items, T_INT32)
        return Typed(T_ARRAY, [float(v) for v in items], T_FLOAT32)
    raise TypeError(f"no GGUF type for {type(value).__name__}")


def encode_kv(key: str, value: Any) -> bytes:
    t = _infer(value)
    out = _str(key) + struct.pack("<I", t.vtype)
    if t.vtype == T_STRING:
        return out + _str(t.value)
    if t.vtype == T_ARRAY:
        out += struct.pack("<IQ", t.etype, len(t.value))
        if t.etype == T_STRING:
            return out + b"".join(_str(s) for s in t.value)
        return out + np.asarray(t.value, dtype=np.dtype(_FMT[t.etype])).tobytes()
    return out + struct.pack(_FMT[t.vtype], t.value)


# --------------------------------------------------------------------------------------------
# quantisers (rows of a 2-D float array; the last axis is split into blocks of 32)


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"the innermost dimension ({x.shape[-1]}) must be a multiple of {BLOCK}")
    return x.reshape(-1, BLOCK)


def _nibbles(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def quantize_q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Q8_0 bytes of ``x`` and the values they stand for (same shape as ``x``)."""
    b = _blocks(x)
    d = (np.abs(b).max(axis=1) / 127).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / np.maximum(d.astype(np.float32), 1e-30))
    q = np.clip(np.round(b * inv[:, None]), -127, 127).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    return raw.tobytes(), (q * d.astype(np.float32)[:, None]).reshape(np.shape(x))


def quantize_q4_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = _blocks(x)
    idx = np.abs(b).argmax(axis=1)
    signed_max = b[np.arange(len(b)), idx]
    d = (signed_max / -8).astype(np.float16)
    d32 = d.astype(np.float32)
    inv = np.where(d32 == 0, 0, 1 / np.where(d32 == 0, 1, d32))
    q = np.clip(np.floor(b * inv[:, None] + 8.5), 0, 15)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), _nibbles(q)], axis=1)
    return raw.tobytes(), ((q - 8) * d32[:, None]).reshape(np.shape(x))


def quantize_q4_1(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    b = _blocks(x)
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    inv = np.where(d32 == 0, 0, 1 / np.where(d32 == 0, 1, d32))
    q = np.clip(np.floor((b - m32[:, None]) * inv[:, None] + 0.5), 0, 15)
    raw = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), _nibbles(q)], axis=1)
    return raw.tobytes(), (q * d32[:, None] + m32[:, None]).reshape(np.shape(x))


QUANTIZERS = {Q4_0: quantize_q4_0, Q4_1: quantize_q4_1, Q8_0: quantize_q8_0, **K_QUANTIZERS}


def tensor_bytes(x: np.ndarray, kind: int) -> tuple[bytes, np.ndarray]:
    """The bytes of ``x`` stored as ``kind`` and the values a reader gets back."""
    if kind == F32:
        a = np.asarray(x, np.float32)
        return a.tobytes(), a
    if kind == F16:
        a = np.asarray(x, np.float16)
        return a.tobytes(), a.astype(np.float32)
    return QUANTIZERS[kind](x)


def q4_0_from_mlx(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MLX 4-bit rows (uint32 [N, K/8], fp16 scales [N, K/64], biases -8 s) -> Q4_0 bytes [N, K/32*18]."""
    n = packed.shape[0]
    b = packed.view(np.uint8).reshape(n, -1)
    q = np.empty((n, b.shape[1] * 2), np.uint8)
    q[:, 0::2], q[:, 1::2] = b & 15, b >> 4  # MLX: element 2j low nibble, 2j+1 high
    blocks = q.reshape(n, -1, 32)
    qs = blocks[:, :, :16] | (blocks[:, :, 16:] << 4)  # Q4_0: j low, j+16 high
    d = np.repeat(scales.astype(np.float16), 2, axis=1)  # group of 64 = two blocks of 32
    out = np.empty((n, blocks.shape[1], 18), np.uint8)
    out[:, :, :2] = d.view(np.uint8).reshape(n, -1, 2)
    out[:, :, 2:] = qs
    return out.reshape(n, -1)


def sentencepiece_vocab(tokenizer_model: str | Path) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, ggml token types) of a SentencePiece model, as llama.cpp's converter writes them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        kind = 1  # normal
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        types.append(kind)
    return tokens, scores, types


# --------------------------------------------------------------------------------------------
# the file


def nbytes_of(shape: tuple[int, ...], kind: int) -> int:
    from .gguf_file import GGML_TYPES

    t = GGML_TYPES[kind]
    return int(np.prod(shape)) // t.block * t.nbytes


def write_gguf(path: str | Path, metadata: Iterable[tuple[str, Any]],
               layout: Iterable[tuple[str, tuple[int, ...], int]], data: Iterable[bytes]) -> Path:
    """Write a GGUF v3 file.

    ``layout``: (name, dims innermost first, ggml type) of each tensor in file order; ``data``:
    their bytes in the same order (a generator is fine: tensors are written as they come).
    """
    meta = [encode_kv(k, v) for k, v in metadata]
    infos, offset = [], 0
    for name, shape, kind in layout:
        infos.append(_str(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
                     + struct.pack("<IQ", kind, offset))
        offset += -(-nbytes_of(shape, kind) // ALIGN) * ALIGN
    path = Path(path)
    with open(path, "wb") as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(infos), len(meta)))
        for m in meta:
            f.write(m)
        for info in infos:
            f.write(info)
        f.write(b"\0" * (-f.tell() % ALIGN))
        for chunk in data:
            f.write(chunk)
            f.write(b"\0" * (-len(chunk) % ALIGN))
    return path


def write_tensors(path: str | Path, metadata: Iterable[tuple[str, Any]],
                  tensors: list[tuple[str, np.ndarray, int]]) -> dict[str, np.ndarray]:
    """Write ``tensors`` (name, array in row-major numpy shape, ggml type) to a GGUF file; returns
    the values a reader gets back for each (what quantisation made of them)."""
    stored: dict[str, np.ndarray] = {}
    chunks = []
    for name, arr, kind in tensors:
        raw, values = tensor_bytes(arr, kind)
        chunks.append(raw)
        stored[name] = values
    layout = [(name, tuple(reversed(np.shape(arr))), kind) for name, arr, kind in tensors]
    write_gguf(path, metadata, layout, chunks)
    return stored
