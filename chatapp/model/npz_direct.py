"""An uncompressed ``.npz`` read straight into MLX arrays, one array at a time.

``mx.load`` reads an npz member through Python's zipfile when it is evaluated, as one Python
bytes object the size of the array, then copied: the largest array twice for a moment (a 7B
model's float16 embedding: 0.25 GB above the weights) and Python's chunked reads (5 s for a
1.2 GB file here). An npz that numpy wrote without compression (``np.savez``, the early
mlx-community files) holds each ``.npy`` as plain bytes at a known offset, so each array is read
with ``readinto`` into its own MLX buffer: no copy and no transient. Anything else (compressed
members, Fortran order, dtypes MLX has no twin for) returns None and the caller uses ``mx.load``.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header (30 bytes)
_CHUNK = 1 << 24  # bytes per readinto
_DTYPES = {np.dtype(k): v for k, v in {
    "<f4": mx.float32, "<f2": mx.float16, "<u4": mx.uint32, "<i4": mx.int32, "<u1": mx.uint8, "<i1": mx.int8,
    "<u2": mx.uint16, "<i2": mx.int16, "<i8": mx.int64, "<u8": mx.uint64, "|u1": mx.uint8, "|i1": mx.int8,
    "|b1": mx.bool_}.items()}


def _members(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo] | None:
    members = [i for i in zf.infolist() if i.filename.endswith(".npy")]
    if any(i.compress_type != zipfile.ZIP_STORED for i in members):
        return None
    return members


def _array_at(f, info: zipfile.ZipInfo) -> tuple[int, tuple[int, ...], mx.Dtype] | None:
    """(file offset of the data, shape, MLX dtype) of a stored ``.npy`` member, or None."""
    f.seek(info.header_offset)
    head = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
    if head[0] != b"PK\x03\x04":
        return None
    f.seek(info.header_offset + _LOCAL_HEADER.size + head[9] + head[10])
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    if (fortran and len(shape) > 1) or dtype not in _DTYPES:
        return None
    return f.tell(), tuple(int(d) for d in shape), _DTYPES[dtype]


def read_npz(path: str | Path) -> dict[str, mx.array] | None:
    """The arrays of an uncompressed npz, by member name without ``.npy`` (as ``mx.load`` names
    them), each read into its own evaluated MLX array; None for a file this cannot read so."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = _members(zf)
        if members is None:
            return None
        out: dict[str, mx.array] = {}
        with open(path, "rb", buffering=0) as f:
            for info in members:
                found = _array_at(f, info)
                if found is None:
                    return None
                offset, shape, dtype = found
                a = mx.zeros(shape, dtype)
                mx.eval(a)
                if a.size:
                    view = memoryview(a).cast("B")
                    f.seek(offset)
                    for start in range(0, view.nbytes, _CHUNK):
                        part = view[start : start + _CHUNK]
                        if f.readinto(part) != part.nbytes:
                            return None  # truncated: mx.load says so in its own words
                out[info.filename[: -len(".npy")]] = a
        return out
    except (OSError, ValueError, zipfile.BadZipFile, struct.error):
        return None
