"""A GGUF file's tensors read one at a time into the arrays the model keeps.

``mx.load`` maps the whole file and converts every tensor before it returns: for a moment the
process holds the file's pages and all the converted arrays (2.2x a 7B Q4_0 file at peak), and
the q/k rows are then un-permuted into copies. Here each tensor is read with ``readinto`` in
chunks of rows (16 MiB) and converted by chatapp.kernels.gguf_blocks straight into its MLX
arrays, rows un-permuted on the way: the peak is the model's arrays plus one chunk. The arrays
are bit for bit what ``mx.load`` gives (same names, shapes, dtypes; tests/test_gguf.py).

Needs numba (chatapp's kernels); :func:`can_read` says whether it is there (else the caller
uses ``mx.load``).
"""

from __future__ import annotations

import importlib.util
import math
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from .gguf_file import QUANT_BITS, GGUFError, GGUFHeader, TensorInfo

CHUNK_BYTES = 1 << 24  # read buffer per tensor: rows are converted this many file bytes at a time
_FLOATS = {"F32": (mx.float32, np.uint32), "F16": (mx.float16, np.uint16), "BF16": (mx.bfloat16, np.uint16)}


def can_read() -> bool:
    """Whether the block kernels (numba) are installed."""
    return importlib.util.find_spec("numba") is not None


def _empty(*specs: tuple[tuple[int, ...], mx.Dtype, type]) -> list[tuple[mx.array, np.ndarray]]:
    """New evaluated MLX arrays of (shape, dtype) and a writable numpy view of each one's buffer
    (flat, as the view's dtype): the kernels write the tensor into them."""
    arrays = [mx.zeros(shape, dtype) for shape, dtype, _ in specs]
    mx.eval(arrays)
    return [(a, np.frombuffer(memoryview(a), dtype=view)) for a, (_, _, view) in zip(arrays, specs)]


def _read_rows(f: BinaryIO, where: str, t: TensorInfo, offset: int, buf: np.ndarray) -> np.ndarray:
    f.seek(offset)
    got = f.readinto(buf)
    if got != buf.nbytes:
        raise GGUFError(f"{where} is truncated (tensor {t.name!r} ends early)")
    return buf


def read_tensor(f: BinaryIO, header: GGUFHeader, t: TensorInfo, dst_of_src: np.ndarray | None = None,
                buf: np.ndarray | None = None) -> dict[str, mx.array]:
    """The arrays ``mx.load`` makes of tensor ``t`` (a quantised one: name.weight, name.scales,
    name.biases), with source row i written to row ``dst_of_src[i]`` when given (rows along the
    first axis). ``buf``: a uint8 read buffer to reuse (a new one when it is too small)."""
    from chatapp.kernels.gguf_blocks import q4_blocks, q8_blocks

    where = header.path.name
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the innermost axis first
    kind = t.type_name
    n = math.prod(shape)
    rows = shape[0] if dst_of_src is not None else math.prod(shape[:-1])
    row_bytes = t.nbytes() // rows
    base = header.data_offset + t.offset
    bits = QUANT_BITS.get(kind)
    if bits:
        cols = n // rows
        lead = shape[:-1]
        groups = (*lead, shape[-1] // 32)
        words = (*lead, shape[-1] * bits // 32)  # the 4-bit kernel writes whole words, the 8-bit one bytes
        (w, wv), (s, sv), (b, bv) = _empty((words, mx.uint32, np.uint32 if bits == 4 else np.uint8),
                                           (groups, mx.float16, np.uint16), (groups, mx.float16, np.uint16))
        wv, sv, bv = wv.reshape(rows, -1), sv.reshape(rows, cols // 32), bv.reshape(rows, cols // 32)
        out = {t.name: w, f"{t.name.removesuffix('.weight')}.scales": s,
               f"{t.name.removesuffix('.weight')}.biases": b}
    elif kind in _FLOATS:
        dtype, view = _FLOATS[kind]
        ((a, av),) = _empty((shape, dtype, view))
        av = av.reshape(rows, n // rows)
        out = {t.name: a}
    else:
        raise GGUFError(f"{where}: tensor {t.name!r} is {kind}, which chatapp does not read")
    per_chunk = rows if dst_of_src is not None else max(1, CHUNK_BYTES // row_bytes)
    if buf is None or buf.nbytes < min(per_chunk, rows) * row_bytes:
        buf = np.empty(min(per_chunk, rows) * row_bytes, np.uint8)
    for r0 in range(0, rows, per_chunk):
        k = min(per_chunk, rows - r0)
        src = _read_rows(f, where, t, base + r0 * row_bytes, buf[: k * row_bytes])
        dst = dst_of_src[r0 : r0 + k] if dst_of_src is not None else np.arange(r0, r0 + k, dtype=np.int64)
        if kind == "Q8_0":
            q8_blocks(src, dst, wv, sv, bv)
        elif bits:
            q4_blocks(src.view(np.uint16), 18 if kind == "Q4_0" else 20, dst, wv, sv, bv)
        else:
            av[dst] = src.view(av.dtype).reshape(k, -1)
    return out


def read_tensors(header: GGUFHeader, row_orders: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Every tensor of the file as ``mx.load`` names them; ``row_orders``: tensor name -> the row
    each source row goes to (the un-permuted q/k rows)."""
    out: dict[str, mx.array] = {}
    buf = np.empty(CHUNK_BYTES, np.uint8)  # one buffer for every chunk (its pages fault in once)
    try:
        with open(header.path, "rb", buffering=0) as f:
            for t in header.tensors:
                out.update(read_tensor(f, header, t, row_orders.get(t.name), buf))
    except OSError as err:
        raise GGUFError(f"cannot read the tensors of {header.path.name}: {err.strerror or err}") from err
    return out
