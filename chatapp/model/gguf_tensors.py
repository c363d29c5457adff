"""A GGUF file's tensors read one at a time into the arrays the model keeps.

``mx.load`` maps the whole file and converts every tensor before it returns: for a moment the
process holds the file's pages and all the converted arrays (2.2x a 7B Q4_0 file at peak), and
the q/k rows are then un-permuted into copies. Here each tensor is read in chunks of rows
(16 MiB), each chunk mapped from the file on its own (the page cache's pages themselves: no copy
into a read buffer) and converted by chatapp.kernels.gguf_blocks straight into its MLX arrays,
rows un-permuted on the way: the peak is the model's arrays plus one chunk. The arrays are bit for
bit what ``mx.load`` gives (same names, shapes, dtypes; tests/test_gguf.py).

Every array is made before the first is filled, in one evaluation spread over as many of MLX's
CPU streams as there are kernel threads: making an array writes it (zeros), and that first
write of fresh memory is what costs, one page fault per 4 KiB. On one stream it was the larger
part of a 7B load on this 2-core VM (4 GiB: 4.1-10.7 s; over two streams 0.9-3.8 s, mostly ~1).

Needs numba (chatapp's kernels); :func:`can_read` says whether it is there (else the caller
uses ``mx.load``).
"""

from __future__ import annotations

import importlib.util
import math
import mmap
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .gguf_file import QUANT_BITS, REPACKED_BITS, GGUFError, GGUFHeader, TensorInfo

CHUNK_BYTES = 1 << 24  # file bytes mapped and converted at a time (a tensor's rows, whole rows)
_FLOATS = {"F32": (mx.float32, np.uint32), "F16": (mx.float16, np.uint16), "BF16": (mx.bfloat16, np.uint16)}
# the pages of a mapped chunk are mapped in one call (Linux), not faulted in one at a time
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def can_read() -> bool:
    """Whether the block kernels (numba) are installed."""
    return importlib.util.find_spec("numba") is not None


@dataclass
class _Target:
    """One tensor: where its rows are in the file and the arrays they become."""

    t: TensorInfo
    rows: int  # along the first axis when the rows are reordered, else every leading axis
    row_bytes: int
    # array name -> (shape, MLX dtype, the numpy dtype the kernels write it as)
    specs: dict[str, tuple[tuple[int, ...], mx.Dtype, type]]

    def views(self, arrays: dict[str, mx.array]) -> list[np.ndarray]:
        """Writable numpy views [rows, -1] of this target's evaluated arrays, as the kernels write them."""
        return [np.frombuffer(memoryview(arrays[name]), dtype=view).reshape(self.rows, -1)
                for name, (_, _, view) in self.specs.items()]

    def truncated(self, where: str) -> GGUFError:
        return GGUFError(f"{where} is truncated (tensor {self.t.name!r} ends early)")


def _target(header: GGUFHeader, t: TensorInfo, reordered: bool) -> _Target:
    shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the innermost axis first
    kind = t.type_name
    rows = shape[0] if reordered else math.prod(shape[:-1])
    bits = QUANT_BITS.get(kind)
    if bits:
        lead = shape[:-1]
        stem = t.name.removesuffix(".weight")
        specs = {t.name: ((*lead, shape[-1] * bits // 32), mx.uint32, np.uint8),  # the words' bytes
                 f"{stem}.scales": ((*lead, shape[-1] // 32), mx.float16, np.uint16),
                 f"{stem}.biases": ((*lead, shape[-1] // 32), mx.float16, np.uint16)}
    elif kind in REPACKED_BITS:  # repacked by numpy (gguf_kquants): scales of the layout's dtype
        from .gguf_kquants import LAYOUTS

        lay = LAYOUTS[kind]
        lead, stem = shape[:-1], t.name.removesuffix(".weight")
        sdt = mx.float16 if lay.scale_dtype is np.float16 else mx.float32
        specs = {t.name: ((*lead, shape[-1] * lay.bits // 32), mx.uint32, np.uint8),
                 f"{stem}.scales": ((*lead, shape[-1] // 32), sdt, lay.scale_dtype),
                 f"{stem}.biases": ((*lead, shape[-1] // 32), sdt, lay.scale_dtype)}
    elif kind in _FLOATS:
        dtype, view = _FLOATS[kind]
        specs = {t.name: (shape, dtype, view)}
    else:
        raise GGUFError(f"{header.path.name}: tensor {t.name!r} is {kind}, which chatapp does not read")
    return _Target(t, rows, t.nbytes() // rows, specs)


_STREAMS: list[mx.Stream] = []  # made once: MLX keeps a thread per stream for the process's life


def _cpu_streams(n: int) -> list[mx.Stream]:
    while len(_STREAMS) < n:
        _STREAMS.append(mx.new_stream(mx.cpu))
    return _STREAMS[:n]


def _allocate(targets: list[_Target], streams: int) -> dict[str, mx.array]:
    """Every target's arrays, evaluated together over ``streams`` CPU streams (each array to the
    stream with the fewest bytes so far)."""
    pool = _cpu_streams(max(1, streams))
    load = [0] * len(pool)
    out: dict[str, mx.array] = {}
    for tg in targets:
        for name, (shape, dtype, _) in tg.specs.items():
            s = load.index(min(load))
            out[name] = mx.zeros(shape, dtype, stream=pool[s])
            load[s] += math.prod(shape) * dtype.size
    mx.eval(list(out.values()))
    return out


def _convert(kind: str, src: np.ndarray, dst: np.ndarray, views: list[np.ndarray]) -> None:
    from chatapp.kernels.gguf_blocks import Q4_0_BYTES, Q4_1_BYTES, q4_blocks, q8_blocks

    if kind == "Q8_0":
        q8_blocks(src, dst, *views)
    elif kind in ("Q4_0", "Q4_1"):
        q4_blocks(src, Q4_0_BYTES if kind == "Q4_0" else Q4_1_BYTES, dst, *views)
    elif kind in REPACKED_BITS:
        from .gguf_kquants import affine_blocks

        for view, part in zip(views, affine_blocks(kind, src, dst.shape[0])):
            view[dst] = part.view(view.dtype)
    else:
        (av,) = views
        av[dst] = src.view(av.dtype).reshape(dst.shape[0], -1)


def _chunk(fd: int, start: int, length: int) -> np.ndarray:
    """File bytes [start, start + length) as a read-only uint8 array: the page cache's pages
    mapped, or read into memory where the file cannot be mapped (some network and FUSE mounts).
    The mapping goes with the array's last reference, not closed here: a pool helper's frame may
    still hold the chunk for a moment after its kernel returns (close() would then refuse)."""
    skew = start % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
    try:
        m = mmap.mmap(fd, skew + length, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ,
                      offset=start - skew)
    except OSError:
        return np.frombuffer(os.pread(fd, length, start), np.uint8)
    return np.frombuffer(m, np.uint8, length, skew)


def _read(fd: int, header: GGUFHeader, tg: _Target, arrays: dict[str, mx.array],
          dst_of_src: np.ndarray | None) -> None:
    """The target's rows a chunk at a time, converted into its arrays."""
    views = tg.views(arrays)
    base = header.data_offset + tg.t.offset
    per_chunk = tg.rows if dst_of_src is not None else max(1, CHUNK_BYTES // tg.row_bytes)
    for r0 in range(0, tg.rows, per_chunk):
        k = min(per_chunk, tg.rows - r0)
        src = _chunk(fd, base + r0 * tg.row_bytes, k * tg.row_bytes)
        if src.nbytes != k * tg.row_bytes:  # (read: the file shrank since its size was checked)
            raise tg.truncated(header.path.name)
        dst = dst_of_src[r0:r0 + k] if dst_of_src is not None else np.arange(r0, r0 + k, dtype=np.int64)
        _convert(tg.t.type_name, src, dst, views)


def read_tensors(header: GGUFHeader, row_orders: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Every tensor of the file as ``mx.load`` names them; ``row_orders``: tensor name -> the row
    each source row goes to (the un-permuted q/k rows)."""
    from chatapp.kernels.pool import pool

    where = header.path.name
    try:
        with open(header.path, "rb", buffering=0) as f:
            # the header checked every tensor against the file's size; checked again on this
            # descriptor, since a mapping past the end would fault (SIGBUS) instead of raising
            size = os.fstat(f.fileno()).st_size
            targets = [_target(header, t, t.name in row_orders) for t in header.tensors]
            for tg in targets:
                if header.data_offset + tg.t.offset + tg.rows * tg.row_bytes > size:
                    raise tg.truncated(where)
            out = _allocate(targets, pool().threads)
            for tg in targets:
                _read(f.fileno(), header, tg, out, row_orders.get(tg.t.name))
    except OSError as err:
        raise GGUFError(f"cannot read the tensors of {where}: {err.strerror or err}") from err
    return out
