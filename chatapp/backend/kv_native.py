"""Cache maintenance in place on the buffers' host views (cache/row_ops.py's protocol).

The fused decode step keeps host views of every cache's buffers (``FullBuffer.pinned``) and
writes its rows through them. Between steps, a window-quant cache quantises ``evict_chunk`` rows
leaving its recent window and the evicting modes drop rows and turn the kept keys back; through
MLX each of those rewrote whole buffers. Measured on SmolLM2 (30 layers, 3 KV heads of 64, Zen 4,
3,000 tokens held), one 256-row flush: MLX quantise 14.5 ms, writing the middle (grown by a chunk,
so copied) 16.6, the window's left shift 62 (a slice update whose source is the same buffer
copies it), and the next step re-reading every changed buffer's host views another 10. Here the
rows are quantised by kernels/kv_rows.py (bit for bit ``mx.quantize``), written at the end of the
middle, and the window moved back with one overlapping copy a head; the middle grows by half its
capacity when full, so its views stay valid between growths.

Each operation declines (returns False, and the cache goes through MLX) where it may not work in
place: no host views (the buffers changed since the last native step), rows that a view handed
out may still hold (``shared``: a snapshot, the MLX route's attention), keys per channel
(quant_channel.py), or a dtype numpy has no type for (bfloat16).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_HOST_DTYPES = (mx.float16, mx.float32)


def _flat(a: mx.array) -> tuple[np.ndarray, int]:
    """An evaluated [1, heads, capacity, width] array's memory as a flat writable numpy view the
    kernels take (float16 as uint16 bits, packed words as bytes) and its head stride."""
    mx.eval(a)
    h = np.asarray(a)
    if h.dtype == np.float16:
        h = h.view(np.uint16)
    elif h.dtype == np.uint32:
        h = h.view(np.uint8)
    return h.reshape(-1), h.shape[2] * h.shape[3]


class NativeRowOps:
    """RowOps for the caches of one fused decoder: its RoPE frequencies and pairing."""

    def __init__(self, inv_freq: np.ndarray, traditional: bool):
        self.inv_freq = inv_freq
        self.traditional = bool(traditional)
        # operations done here and declined (to MLX), by name: what tests and --verbose read
        self.done: dict[str, int] = {}
        self.declined: dict[str, int] = {}

    def _count(self, name: str, ok: bool) -> bool:
        tally = self.done if ok else self.declined
        tally[name] = tally.get(name, 0) + 1
        return ok

    @staticmethod
    def _may_change(full, start: int) -> bool:
        """Whether rows from ``start`` on of the full buffers may change in place: they have host
        views (a native step pinned them) and no view handed out covers those rows."""
        return full.pinned is not None and full.shared <= start and full.keys.dtype in _HOST_DTYPES

    def _angles(self, delta: int) -> tuple[np.ndarray, np.ndarray]:
        from chatapp.kernels.decode_step import rope_angles

        return rope_angles(delta, self.inv_freq)

    def flush(self, full, quant, start: int, n: int, delta: int) -> bool:
        from chatapp.kernels.kv_rows import flush_rows, shift_rows

        if not self._may_change(full, start) or quant.kind != "quant" or n <= 0:
            return self._count("flush", False)
        if quant.keys is None:
            like = mx.zeros((1, full.keys.shape[1], 1, full.keys.shape[3]), full.keys.dtype)
            empty = [a[:, :, :0] for a in mx.quantize(like, group_size=quant.group_size, bits=quant.bits)]
            quant.hold(empty, list(empty), 0)
            quant.shared = 0  # made here, held by no one
        quant.grow(n)
        D, H = full.keys.shape[3], full.keys.shape[1]
        cos, sin = self._angles(delta)
        for src, arrays, turn in ((full.keys, quant.keys, delta != 0), (full.values, quant.values, False)):
            buf, stride = _flat(src)
            (p, ps), (sc, ss), (bi, _) = (_flat(a) for a in arrays)
            flush_rows(buf, H, stride, start, n, D, turn, cos, sin, self.traditional, p, ps, sc, bi, ss,
                       quant.length, quant.bits, quant.group_size)
            shift_rows(buf, H, stride, start, n, full.length, D)
        full.length -= n
        full._held_view = None
        quant.length += n
        quant._held_view = None
        return self._count("flush", True)

    def remove(self, full, start: int, n: int) -> bool:
        from chatapp.kernels.kv_rows import shift_rows

        if not self._may_change(full, start):
            return self._count("remove", False)
        for a in (full.keys, full.values):
            buf, stride = _flat(a)
            shift_rows(buf, a.shape[1], stride, start, n, full.length, a.shape[3])
        full.length -= n
        full._held_view = None
        return self._count("remove", True)

    def rotate(self, full, start: int, delta: int) -> bool:
        from chatapp.kernels.kv_rows import rotate_rows

        if not delta or start >= full.length:
            return True
        if not self._may_change(full, start):
            return self._count("rotate", False)
        buf, stride = _flat(full.keys)
        cos, sin = self._angles(delta)
        rotate_rows(buf, full.keys.shape[1], stride, start, full.length, full.keys.shape[3], cos, sin,
                    self.traditional)
        full._held_view = None
        return self._count("rotate", True)

    def remove_front(self, quant, n: int) -> bool:
        from chatapp.kernels.kv_rows import shift_rows

        if quant.kind != "quant" or quant.keys is None or quant.shared:
            return self._count("remove_front", False)
        for a in (*quant.keys, *quant.values):
            buf, stride = _flat(a)
            shift_rows(buf, a.shape[1], stride, 0, n, quant.length, stride // a.shape[2])
        quant.length -= n
        quant._held_view = None
        return self._count("remove_front", True)
