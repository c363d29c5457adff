"""Preallocated K/V storage: one full-precision buffer and one quantised buffer.

Both grow by whole chunks, write new tokens in place with slice assignment, and hand out
slices of their contiguous storage; MLX reuses the buffer when nothing else holds it.
Shapes follow the models: [batch, kv_heads, tokens, head_dim].
"""

from __future__ import annotations

import mlx.core as mx

from .rope import Repositioner
from .settings import CacheConfigError


def _grown(buf: mx.array | None, needed: int, step: int, like: mx.array) -> mx.array:
    """A buffer with room for ``needed`` tokens, grown by whole chunks of ``step``."""
    have = 0 if buf is None else buf.shape[2]
    if buf is not None and needed <= have:
        return buf
    # one chunk at least: a restored cache whose full-precision part holds no rows (a quantized
    # cache right after a flush) still gets its buffers, which its readers expect
    new_cap = max(1, (needed + step - 1) // step) * step
    B, H, _, D = like.shape
    # a buffer keeps its dtype (a float16 cache taking float32 rows stays float16)
    extra = mx.zeros((B, H, new_cap - have, D), like.dtype if buf is None else buf.dtype)
    return extra if buf is None else mx.concatenate([buf, extra], axis=2)


def _shift_left(buf: mx.array, start: int, n: int, length: int) -> mx.array:
    """Remove tokens [start, start+n) by moving the tail left (one copy of the tail)."""
    if start + n < length:
        buf[:, :, start : length - n] = buf[:, :, start + n : length]
    return buf


class _TokenBuffer:
    """What both buffers share: a token count, a memoised view of the held tokens, and sizes."""

    length: int
    _held_view: tuple | None

    def _arrays(self) -> list[mx.array]:
        raise NotImplementedError

    def trim(self, n: int) -> None:
        self.length -= n
        self._held_view = None

    def token_bytes(self) -> int:
        """Bytes one token takes in K and V together (packed values, scales and biases included)."""
        return sum(b.shape[0] * b.shape[1] * b.shape[3] * b.itemsize for b in self._arrays())


class FullBuffer(_TokenBuffer):
    """Contiguous full-precision K/V with chunked growth.

    The buffers' dtype is ``dtype`` when set before the first write (the CPU fused routes set
    float16: backend/fused_decode.py), else that of the first rows written; rows of another
    dtype are cast to it on the way in (MLX's slice update), so every reader sees one dtype."""

    def __init__(self, step: int, dtype: mx.Dtype | None = None, geometric: bool = False):
        self.step = step
        self.dtype = dtype
        # Growing copies every row held into new memory, and in a VM the new memory's first
        # touch (a page fault per 4 KiB) costs more than the copy: 8 layers of a 7B model at
        # 4,096 tokens took 0.4-1.2 s a growth, and growth by whole chunks repeats that every
        # chunk (16 times to 4,096 tokens, 8.5x the final buffer faulted and 7.5x copied). An
        # unbounded buffer (prealloc) grows by half its capacity at least: 6 growths to 4,096,
        # 3.1x faulted and 1.9x copied, at most a third of the capacity spare. Bounded ones (a
        # window, a budget) keep whole chunks: their size is capped anyway.
        self.geometric = geometric
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = 0
        # The slices of the held tokens, made once per change: a decode step hands them to the
        # model, to attention and to eval, and each slice costs a few microseconds of Python.
        self._held_view: tuple[mx.array, mx.array] | None = None
        # Writes in place (a native decode step writing its new rows through the buffers'
        # addresses, outside MLX): ``shared`` is how many leading rows of the current buffers
        # have been handed out (views, state, snapshots), which such a write must never change;
        # ``pinned`` is whatever the writer keeps for the current buffers (host views and
        # addresses), dropped before MLX writes so that MLX may reuse the buffer.
        self.shared = 0
        self.pinned: object | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: mx.array, values: mx.array) -> None:
        self.pinned = None  # before the write: a held host view would make MLX copy the buffer
        self.reserve(keys.shape[2], keys, values)
        end = self.length + keys.shape[2]
        self.keys[:, :, self.length : end] = keys  # cast to the buffers' dtype by MLX's slice update
        self.values[:, :, self.length : end] = values
        self.length = end
        self._held_view = None
        # MLX's slice update made new buffers (or reused the old ones where nothing else held
        # them): no row of these has been handed out yet
        self.shared = 0

    def reserve(self, n: int, keys: mx.array, values: mx.array) -> None:
        """Room for ``n`` more rows, writing none (a native step then writes them in place, or
        ``append`` through MLX); ``keys``/``values`` are rows whose batch, heads and head_dim the
        buffers take, and their dtype for the first buffers when ``dtype`` is not set.

        A native writer must not make room by appending zeros then trimming: where one zeros array
        given as keys and values covers a new buffer whole, MLX's slice update hands the update's
        own buffer back, making both the same memory (a 256-token prefill into an empty cache)."""
        end = self.length + n
        if end <= self.capacity and self.keys is not None:
            return
        self.pinned = None  # MLX may reuse the buffers only where no host view holds them
        if self.keys is None and self.dtype is not None:
            keys, values = keys.astype(self.dtype), values.astype(self.dtype)
        target = max(end, self.capacity + self.capacity // 2) if self.geometric and self.keys is not None else end
        self.keys = _grown(self.keys, target, self.step, keys)
        self.values = _grown(self.values, target, self.step, values)
        self._held_view = None
        self.shared = 0  # new buffers: no row of them handed out

    def writable_in_place(self, n: int) -> bool:
        """Whether rows [length, length + n) may be written in place, outside MLX: they exist,
        and no view handed out of these buffers covers them (after a ``trim`` below what was
        handed out, a snapshot may still hold those rows: the next write goes through MLX)."""
        return self.keys is not None and self.length + n <= self.capacity and self.length >= self.shared

    def wrote_in_place(self, n: int) -> None:
        """Count ``n`` rows written in place at [length, length + n) (``writable_in_place``)."""
        if not self.writable_in_place(n):
            raise ValueError("rows written in place over rows handed out, or past the capacity")
        self.length += n
        self._held_view = None

    def view(self, start: int = 0, end: int | None = None) -> tuple[mx.array, mx.array]:
        if start == 0 and end is None:
            if self._held_view is None:
                self._held_view = (self.keys[:, :, : self.length], self.values[:, :, : self.length])
                self.shared = max(self.shared, self.length)
            return self._held_view
        end = self.length if end is None else end
        self.shared = max(self.shared, end)
        return self.keys[:, :, start:end], self.values[:, :, start:end]

    def remove(self, start: int, n: int) -> None:
        self.pinned = None
        self.keys = _shift_left(self.keys, start, n, self.length)
        self.values = _shift_left(self.values, start, n, self.length)
        self.length -= n
        self._held_view = None
        self.shared = 0  # MLX's slice update copied the buffers a view held, or no view was alive

    def rotate(self, start: int, delta: int, repos: Repositioner) -> None:
        """Re-position keys [start, length) by ``delta`` positions."""
        if delta and start < self.length:
            self.pinned = None
            self.keys[:, :, start : self.length] = repos.shift(self.keys[:, :, start : self.length], delta)
            self._held_view = None
            self.shared = 0

    def _arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


class QuantBuffer(_TokenBuffer):
    """Quantised K/V (packed uint32 + scales + biases), quantised along head_dim."""

    kind = "quant"  # its part in attention.attend_mixed (quant_channel.py has the other layout)

    def __init__(self, step: int, bits: int, group_size: int):
        self.step, self.bits, self.group_size = step, bits, group_size
        self.keys: list[mx.array] | None = None  # [packed, scales, biases]
        self.values: list[mx.array] | None = None
        self.length = 0
        self._held_view: tuple | None = None
        # what a native reader keeps for the current arrays (host views, addresses: the fused
        # decode step), dropped whenever the arrays change
        self.pinned: object | None = None
        # how many leading rows of the current arrays may be held outside (views, state,
        # snapshots, a lazy dequantisation): native maintenance never changes those (row_ops.py)
        self.shared = 0

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys[0].shape[2]

    def _check(self, x: mx.array) -> None:
        if x.shape[-1] % self.group_size:
            raise CacheConfigError(
                f"kv_group_size: head_dim {x.shape[-1]} is not a multiple of kv_group_size {self.group_size}; "
                "quantised KV groups along head_dim"
            )

    def append(self, keys: mx.array, values: mx.array) -> None:
        self._check(keys)
        self._check(values)
        n = keys.shape[2]
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self.pinned = None
        self.keys = self._write(self.keys, qk, n)
        self.values = self._write(self.values, qv, n)
        self.length += n
        self._held_view = None
        self.shared = 0  # MLX's slice update: new arrays, or the old ones where no view held them

    def grow(self, n: int) -> None:
        """Room for ``n`` more rows, writing none (native maintenance then writes them in place);
        the arrays double at least, so growth stays rare: each growth copies the middle and makes
        a native reader take new host views of it (re-pinning SmolLM2's 30 layers: ~60 ms)."""
        needed = self.length + n
        if needed <= self.capacity:
            return
        self.pinned = None
        target = max(needed, 2 * self.capacity)
        self.keys = [_grown(b, target, self.step, b) for b in self.keys]
        self.values = [_grown(b, target, self.step, b) for b in self.values]
        self._held_view = None
        self.shared = 0

    def _write(self, bufs: list[mx.array] | None, parts: tuple, n: int) -> list[mx.array]:
        bufs = [None] * 3 if bufs is None else bufs
        out = []
        for buf, part in zip(bufs, parts):
            buf = _grown(buf, self.length + n, self.step, part)
            buf[:, :, self.length : self.length + n] = part
            out.append(buf)
        return out

    def packed(self) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """(packed, scales, biases) for K and for V, sliced to the tokens held (made once per change)."""
        if self._held_view is None:
            L = self.length
            self._held_view = (tuple(b[:, :, :L] for b in self.keys), tuple(b[:, :, :L] for b in self.values))
            self.shared = max(self.shared, L)
        return self._held_view

    def hold(self, keys: list[mx.array] | None, values: list[mx.array] | None, length: int) -> None:
        """Replace what is held by these (packed, scales, biases) arrays of ``length`` tokens
        (None and 0: nothing); a restore and the scored caches' eviction make them."""
        self.keys, self.values, self.length = keys, values, length
        self._held_view = None
        self.pinned = None
        self.shared = length  # arrays made elsewhere: whoever made them may hold them

    def dequantized(self, start: int = 0, end: int | None = None) -> tuple[mx.array, mx.array]:
        end = self.length if end is None else end
        self.shared = max(self.shared, end)
        k, v = ([b[:, :, start:end] for b in bufs] for bufs in (self.keys, self.values))
        return (
            mx.dequantize(*k, group_size=self.group_size, bits=self.bits),
            mx.dequantize(*v, group_size=self.group_size, bits=self.bits),
        )

    def flushable(self, n: int) -> int:
        return n  # any number of tokens (per-channel keys take whole groups)

    def front_cut(self, n: int) -> int:
        return n

    def to_state(self) -> list[mx.array]:
        k, v = self.packed()
        return [*k, *v]

    def from_state(self, arrays: list[mx.array]) -> None:
        self.keys, self.values, self.length = list(arrays[:3]), list(arrays[3:6]), arrays[0].shape[2]
        self._held_view = None
        self.pinned = None
        self.shared = self.length  # the state's own arrays: a snapshot holds them

    def remove_front(self, n: int) -> None:
        self.pinned = None
        self.keys = [_shift_left(b, 0, n, self.length) for b in self.keys]
        self.values = [_shift_left(b, 0, n, self.length) for b in self.values]
        self.length -= n
        self._held_view = None
        self.shared = 0

    def _arrays(self) -> list[mx.array]:
        return [] if self.keys is None else [*self.keys, *self.values]
