"""Cache maintenance in place on the buffers' host views (cache/row_ops.py's protocol).

The fused decode step keeps host views of every cache's buffers (``FullBuffer.pinned``) and
writes its rows through them. Between steps, a window-quant cache quantises ``evict_chunk`` rows
leaving its recent window and the evicting modes drop rows and turn the kept keys back; through
MLX each of those rewrote whole buffers. Measured on SmolLM2 (30 layers, 3 KV heads of 64, Zen 4,
3,000 tokens held), one 256-row flush: MLX quantise 14.5 ms, writing the middle (grown by a chunk,
so copied) 16.6, the window's left shift 62 (a slice update whose source is the same buffer
copies it), and the next step re-reading every changed buffer's host views another 10. Here the
rows are quantised by kernels/kv_rows.py (bit for bit ``mx.quantize``), written at the end of the
middle, and the window moved back in place; the middle doubles when full, so its views stay valid
between growths.

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


def host_scales(a: mx.array) -> np.ndarray:
    """An evaluated scales or biases array as the kernels read it: its own memory (float32, or
    float16 as uint16 bits where the CPU converts them natively), else a float32 copy
    (qlinear.scales_for_kernels). numpy's views cost nothing; an MLX view op evaluated per array
    made re-reading a middle's 180 arrays (SmolLM2) ~57 ms."""
    from chatapp.kernels import half_scales_native

    from .qlinear import scales_for_kernels

    if a.dtype == mx.float32:
        return np.asarray(a)
    if a.dtype == mx.float16 and half_scales_native():
        return np.asarray(a).view(np.uint16)
    return np.asarray(scales_for_kernels(a))


def _reread_copies(quant) -> None:
    """A native reader's views of float16 scales are float32 copies where the CPU lacks F16C
    (host_scales): after rows change in place, it must take them afresh."""
    from chatapp.kernels import half_scales_native

    if quant.keys[1].dtype == mx.float16 and not half_scales_native():
        quant.pinned = None


class NativeRowOps:
    """RowOps for the caches of one fused decoder: its RoPE frequencies and pairing."""

    def __init__(self, inv_freq: np.ndarray, traditional: bool):
        self.inv_freq = inv_freq
        self.traditional = bool(traditional)
        # operations done here and declined (to MLX), by name: what tests and --verbose read
        self.done: dict[str, int] = {}
        self.declined: dict[str, int] = {}
        self._scratches: dict[str, np.ndarray] = {}

    def _scratch(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A float32 array of ``shape`` over memory kept from call to call (grown as needed): the
        votes' keys and scores are ~4 MB a layer for SmolLM2 at 4k held, which a fresh array
        would take as new pages from the system 30 times an eviction."""
        size = int(np.prod(shape))
        buf = self._scratches.get(name)
        if buf is None or buf.size < size:
            buf = self._scratches[name] = np.empty(max(size, 2 * buf.size if buf is not None else 0), np.float32)
        return buf[:size].reshape(shape)

    def _count(self, name: str, ok: bool) -> bool:
        tally = self.done if ok else self.declined
        tally[name] = tally.get(name, 0) + 1
        return ok

    @staticmethod
    def _per_token(quant) -> bool:
        """Whether ``quant`` is a per-token middle whose scales numpy can view (no bfloat16)."""
        return quant.kind == "quant" and (quant.keys is None or quant.keys[1].dtype in _HOST_DTYPES)

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

        if not self._may_change(full, start) or not self._per_token(quant) or n <= 0:
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
        _reread_copies(quant)
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

        if not self._per_token(quant) or quant.keys is None or quant.shared:
            return self._count("remove_front", False)
        for a in (*quant.keys, *quant.values):
            buf, stride = _flat(a)
            shift_rows(buf, a.shape[1], stride, 0, n, quant.length, stride // a.shape[2])
        quant.length -= n
        quant._held_view = None
        _reread_copies(quant)
        return self._count("remove_front", True)

    # ---- the scored caches (cache/scored.py) ---------------------------------------------
    def turn_rows(self, x: np.ndarray, delta: int) -> bool:
        """Move float32 rows x [..., D] by ``delta`` positions in place, with the angles and the
        operations ``rotate`` turns the window's keys with (a cos - b sin, a sin + b cos in
        float32): the scored caches' kept queries, which sit in the window, after an eviction
        moved it. numpy's: 16 queries a layer are ~10 us of it, and a kernel specialised for
        float32 rows would be one more to compile, and to load from numba's cache in each process."""
        if x.dtype != np.float32 or x.ndim < 2 or x.shape[-1] % 2:
            return self._count("turn_rows", False)
        if delta and x.size:
            cos, sin = self._angles(delta)
            half = x.shape[-1] // 2
            a, b = (x[..., 0::2], x[..., 1::2]) if self.traditional else (x[..., :half], x[..., half:])
            a_new = a * cos - b * sin
            b[...] = a * sin + b * cos
            a[...] = a_new
        return self._count("turn_rows", True)

    def _key_rows(self, full, quant, sinks: int):
        """held_keys(h, out) writing head h's held keys [held * D] float32 into ``out``, with
        (heads, held, D); None where there are no host views or the middle is not per-token."""
        if full.pinned is None or full.keys.dtype not in _HOST_DTYPES:
            return None
        n_mid = quant.length if quant is not None else 0
        if n_mid and not self._per_token(quant):
            return None
        from chatapp.kernels.kv_rows import held_keys

        H, D = full.keys.shape[1], full.keys.shape[3]
        s, n_full = min(sinks, full.length), full.length
        buf, stride = _flat(full.keys)
        if n_mid:
            (p, ps), (sc, ss), (bi, _) = (_flat(a) for a in quant.keys)
            bits, group = quant.bits, quant.group_size
        else:  # nothing quantised: empty buffers of the types the kernel compiles for
            p, ps, sc, bi, ss = np.empty(0, np.uint8), 0, np.empty(0, buf.dtype), np.empty(0, buf.dtype), 0
            bits, group = 8, D

        def rows(h: int, out: np.ndarray) -> None:
            held_keys(buf, h * stride, n_full, s, D, p, sc, bi, h * ps, h * ss, n_mid, bits, group, out)

        return rows, (H, n_full + n_mid, D)

    def keys(self, full, quant, sinks: int) -> np.ndarray | None:
        """Every held key [heads, held, D] float32 in sequence order (sinks | middle | recent),
        the middle dequantised as stored (the scored caches keep no rotation delta); None where
        there are no host views or the middle is not per-token."""
        found = self._key_rows(full, quant, sinks)
        if found is None:
            return None
        rows, shape = found
        out = np.empty(shape, np.float32)
        for h in range(shape[0]):
            rows(h, out[h].reshape(-1))
        return out

    def votes(self, full, quant, sinks: int, queries: np.ndarray, scale: float) -> np.ndarray | None:
        """Attention mass per KV head and held token ([kv_heads, held] float32) of ``queries``
        [heads, L, D] (roped; the last L held tokens', causal among themselves), as
        sparsity.attention_mass gives it: the products through numpy's BLAS (MLX's CPU matmul
        runs on its reference BLAS here: SmolLM2's 30 layers at 4,352 tokens took 0.9 s)."""
        return self.votes_many([(self, full, quant, sinks, queries, scale)])[0]

    def votes_many(self, requests: list[tuple]) -> list[np.ndarray | None]:
        """``votes`` for each (ops, full, quant, sinks, queries, scale) of ``requests`` (None where
        one declines, counted on its layer's ``ops``), every layer's KV heads items of one pool map.

        Each KV head (its keys, its queries' scores, their softmax into its mass) is one item of
        the kernel pool's threads, numpy's BLAS on one thread in each: left to its own threads,
        an OpenBLAS whose cores another process holds spun and waited: on the 2-core Xeon with
        other work running, a SmolLM2 eviction's votes (30 layers, 4,352 held) took 0.5-1.5 s,
        against 70-80 ms this way."""
        from chatapp.kernels.pool import pool
        from chatapp.kernels.softmax_lanes import attention_mass_rows

        from .numpy_blas import numpy_blas

        out: list[np.ndarray | None] = [None] * len(requests)
        items = []  # (rows, scaled queries [H, G * L, D], mass [H, N], head, N, D, L)
        for i, (ops, full, quant, sinks, queries, scale) in enumerate(requests):
            found = self._key_rows(full, quant, sinks)
            ops._count("votes", found is not None)
            if found is None:
                continue
            rows, (H, N, D) = found
            heads, L, _ = queries.shape
            q = (queries.astype(np.float32) * np.float32(scale)).reshape(H, heads // H * L, D)
            out[i] = np.zeros((H, N), np.float32)
            items += [(rows, q, out[i], h, N, D, L) for h in range(H)]
        if not items:
            return out
        work = pool()
        keys = self._scratch("keys", (work.threads, max(t[4] * t[5] for t in items)))
        scores = self._scratch("scores", (work.threads, max(t[1].shape[1] * t[4] for t in items)))

        def head(k: int, worker: int) -> None:
            rows, q, mass, h, N, D, L = items[k]
            kw = keys[worker, : N * D]
            rows(h, kw)
            sw = scores[worker, : q.shape[1] * N].reshape(q.shape[1], N)
            np.matmul(q[h], kw.reshape(N, D).T, out=sw)
            # each row's causal softmax, summed into the mass, on 16-lane vectors (numpy's max,
            # exp and sums over these rows had been half of an eviction's votes)
            attention_mass_rows(sw, N, L, mass[h])

        with numpy_blas().single_threaded():
            work.map(head, len(items))
        return out

    def select(self, quant, keep: np.ndarray, deltas: np.ndarray, first: int) -> bool:
        """Keep the middle rows ``keep`` (ascending, middle indices), each moving to its place in
        that list; keys from ``first`` (the first evicted row) on move by their own ``deltas``
        (<= 0) positions, re-quantised (kernels/kv_rows.move_keys); values as stored."""
        from chatapp.kernels.kv_rows import compact_rows, move_keys

        if not self._per_token(quant) or quant.keys is None or quant.shared or not len(keep):
            return self._count("select", False)
        keep = np.ascontiguousarray(keep, np.int64)
        deltas = np.ascontiguousarray(deltas, np.int64)
        H, D = quant.keys[0].shape[1], quant.keys[0].shape[3] * 32 // quant.bits
        for a in quant.values:
            buf, stride = _flat(a)
            compact_rows(buf, H, stride, stride // a.shape[2], keep)
        cos, sin = self._shift_table(deltas)
        (p, ps), (sc, ss), (bi, _) = (_flat(a) for a in quant.keys)
        move_keys(p, sc, bi, H, ps, ss, keep, deltas, first, D, quant.bits, quant.group_size, cos, sin,
                  self.traditional)
        quant.length = len(keep)
        quant._held_view = None
        _reread_copies(quant)
        return self._count("select", True)

    def select_full(self, full, keep: np.ndarray, deltas: np.ndarray, start: int) -> bool:
        """Keep the full-precision rows ``keep`` (ascending held indices; every row before
        ``start`` among them), each moving to its place in that list, keys turned by their own
        ``deltas`` (<= 0) positions: the scored cache's eviction with no quantised middle."""
        from chatapp.kernels.kv_rows import compact_rows, move_rows

        if not self._may_change(full, start) or not len(keep):
            return self._count("select_full", False)
        keep = np.ascontiguousarray(keep, np.int64)
        deltas = np.ascontiguousarray(deltas, np.int64)
        H, D = full.keys.shape[1], full.keys.shape[3]
        buf, stride = _flat(full.values)
        compact_rows(buf, H, stride, D, keep)
        cos, sin = self._shift_table(deltas)
        buf, stride = _flat(full.keys)
        move_rows(buf, H, stride, D, keep, deltas, cos, sin, self.traditional)
        full.length = len(keep)
        full._held_view = None
        return self._count("select_full", True)

    def _shift_table(self, deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [max shift + 1, D/2]: row d turns a key back by d positions (the prefill's
        table of positions 0 .. max shift, with the frequencies negated)."""
        from chatapp.kernels.prefill_step import rope_table

        return rope_table(0, int(-deltas.min()) + 1 if len(deltas) else 1, -self.inv_freq)
