"""Read and check a GGUF file's header: its metadata and tensor table, without MLX.

The header is parsed here (not by ``mx.load``) for three reasons: a truncated or corrupt file
must be a one-line :class:`GGUFError`, never a crash inside the C++ loader; the tensor types are
needed to say what the file holds and to refuse types MLX cannot read; and ``--show-config``
describes a file without importing MLX. The tensor data is left to ``mx.load``.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GGUFError(Exception):
    """A GGUF file chatapp cannot use; ``str(err)`` is one line for the user."""


@dataclass(frozen=True)
class GGMLType:
    name: str
    block: int  # elements per block
    nbytes: int  # bytes per block


# ggml's tensor types (ggml.h), with their block sizes: what a tensor's byte size is computed from.
GGML_TYPES: dict[int, GGMLType] = {
    0: GGMLType("F32", 1, 4), 1: GGMLType("F16", 1, 2), 2: GGMLType("Q4_0", 32, 18), 3: GGMLType("Q4_1", 32, 20),
    6: GGMLType("Q5_0", 32, 22), 7: GGMLType("Q5_1", 32, 24), 8: GGMLType("Q8_0", 32, 34), 9: GGMLType("Q8_1", 32, 36),
    10: GGMLType("Q2_K", 256, 84), 11: GGMLType("Q3_K", 256, 110), 12: GGMLType("Q4_K", 256, 144),
    13: GGMLType("Q5_K", 256, 176), 14: GGMLType("Q6_K", 256, 210), 15: GGMLType("Q8_K", 256, 292),
    16: GGMLType("IQ2_XXS", 256, 66), 17: GGMLType("IQ2_XS", 256, 74), 18: GGMLType("IQ3_XXS", 256, 98),
    19: GGMLType("IQ1_S", 256, 50), 20: GGMLType("IQ4_NL", 32, 18), 21: GGMLType("IQ3_S", 256, 110),
    22: GGMLType("IQ2_S", 256, 82), 23: GGMLType("IQ4_XS", 256, 136), 24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2), 26: GGMLType("I32", 1, 4), 27: GGMLType("I64", 1, 8), 28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", 256, 56), 30: GGMLType("BF16", 1, 2), 34: GGMLType("TQ1_0", 256, 54),
    35: GGMLType("TQ2_0", 256, 66),
}
# What MLX's GGUF reader takes: the block-32 quants map onto its affine layout (group 32, packed
# uint32 words plus float16 scales and biases); floats load as they are.
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# What chatapp repacks itself at load (chatapp.model.gguf_kquants): the MLX affine group-32 bit
# width each becomes (Q6_K's 16-value sub-blocks become 8-bit groups of 32).
REPACKED_BITS = {"Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 8}
FLOAT_TYPES = ("F32", "F16", "BF16")
READABLE_TYPES = frozenset(QUANT_BITS) | frozenset(REPACKED_BITS) | frozenset(FLOAT_TYPES)


def mlx_bits(type_name: str) -> int | None:
    """The bit width of the MLX affine layer a block-quantised type becomes (None for floats)."""
    return QUANT_BITS.get(type_name) or REPACKED_BITS.get(type_name)

# metadata value types (gguf spec)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 31  # no header field holds more items than this; a bigger count is corruption


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost (contiguous) dimension first
    type_id: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        kind = GGML_TYPES.get(self.type_id)
        return kind.name if kind else f"type {self.type_id}"

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def nbytes(self) -> int:
        kind = GGML_TYPES[self.type_id]
        return self.n_elements // kind.block * kind.nbytes


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    file_size: int
    type_counts: dict[str, int] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def types_line(self) -> str:
        """'Q4_1 x210, F32 x61, Q8_0 x1': the tensor types and how many of each, most first."""
        return ", ".join(f"{name} x{n}" for name, n in sorted(self.type_counts.items(), key=lambda kv: (-kv[1], kv[0])))


_U64 = struct.Struct("<Q")


class _Reader:
    def __init__(self, f: BinaryIO, size: int, where: str):
        self.f, self.size, self.where = f, size, where

    def truncated(self) -> GGUFError:
        return GGUFError(f"{self.where} is truncated (its header ends early at byte {self.f.tell()})")

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise self.truncated()
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = self.unpack("<Q")
        if n > _MAX_COUNT or n > self.size:
            raise GGUFError(f"{self.where} is corrupt (a {what} count of {n})")
        return n

    def string(self) -> str:
        raw = self.read(self.count("string length"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        """n strings in a row (a vocabulary, the merges): string() with its calls inlined, which
        took 0.47 s of SmolLM2's load for 98k of them (Gemma 3 has 262k tokens)."""
        read, length, limit = self.f.read, _U64.unpack, min(_MAX_COUNT, self.size)
        out = []
        for _ in range(n):
            head = read(8)
            if len(head) != 8:
                raise self.truncated()
            (size,) = length(head)
            if size > limit:
                raise GGUFError(f"{self.where} is corrupt (a string length count of {size})")
            raw = read(size)
            if len(raw) != size:
                raise self.truncated()
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(raw.decode("utf-8", errors="replace"))
        return out

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            n = self.count("array length")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                return list(struct.unpack(f"<{n}{fmt[1]}", self.read(n * struct.calcsize(fmt))))
            if etype == _STRING:
                return self.strings(n)
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"{self.where} is corrupt (unknown metadata value type {vtype})")


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of a GGUF file, checked against the file's size.

    Raises GGUFError (one line) for a file that is not GGUF, is of an unknown version, is
    truncated (a tensor reaches past the end) or has a corrupt header.
    """
    path = Path(path)
    where = path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            r = _Reader(f, size, where)
            if r.read(4) != GGUF_MAGIC:
                raise GGUFError(f"{where} is not a GGUF file (it does not start with 'GGUF')")
            version = r.unpack("<I")
            if version not in (2, 3):
                raise GGUFError(f"{where} is GGUF version {version}; chatapp reads versions 2 and 3")
            n_tensors, n_kv = r.count("tensor"), r.count("metadata")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                metadata[key] = r.value(r.unpack("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.unpack("<I")
                if n_dims > 8:
                    raise GGUFError(f"{where} is corrupt (tensor {name!r} has {n_dims} dimensions)")
                shape = tuple(r.unpack("<Q") for _ in range(n_dims))
                tensors.append(TensorInfo(name, shape, r.unpack("<I"), r.unpack("<Q")))
            align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT)
            data_offset = -(-f.tell() // align) * align
    except OSError as err:
        raise GGUFError(f"cannot read {where}: {err.strerror or err}") from err
    header = GGUFHeader(path, version, metadata, tensors, data_offset, size,
                        dict(Counter(t.type_name for t in tensors)))
    _check_tensors(header, where)
    return header


def _check_tensors(header: GGUFHeader, where: str) -> None:
    for t in header.tensors:
        kind = GGML_TYPES.get(t.type_id)
        if kind is None:
            raise GGUFError(f"{where} is corrupt or too new (tensor {t.name!r} has unknown type {t.type_id})")
        if t.n_elements % kind.block or (t.shape and t.shape[0] % kind.block):
            raise GGUFError(f"{where} is corrupt (tensor {t.name!r} of shape {list(t.shape)} is not whole "
                            f"{kind.name} blocks of {kind.block} values a row)")
        end = header.data_offset + t.offset + t.nbytes()
        if end > header.file_size:
            raise GGUFError(f"{where} is truncated: tensor {t.name!r} ends at byte {end} but the file has "
                            f"{header.file_size}")


def unreadable_types(header: GGUFHeader) -> dict[str, int]:
    """Tensor types in the file that MLX cannot read, with their counts."""
    return {name: n for name, n in header.type_counts.items() if name not in READABLE_TYPES}
