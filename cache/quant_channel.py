"""The quantised middle with KIVI's layout: keys quantised per channel, values per token.

KIVI (Liu et al. 2024) and KVQuant observed that a few key channels carry outliers across all
tokens, so grouping keys along head_dim (one scale per token, as ``QuantBuffer`` does) spends the
scale of every group on those channels; grouping each channel over ``group_size`` tokens gives
each channel its own scale. Values have no such channels and stay grouped per token.

Keys are held transposed, [batch, kv_heads, head_dim, tokens], quantised along the token axis
(MLX quantises the last axis), so the scores are ``quantized_matmul(q, keys, transpose=False)``,
the product the values already use. A group needs ``group_size`` tokens: the cache flushes the
middle in whole groups (``flushable``; the rest waits at full precision in the recent window, as
KIVI's residual does) and evicts it from the front in whole groups (``front_cut``). A partial
last group (after a trim, or a restore) is padded with copies of its last token, which widens
no scale, and filled when more tokens arrive (its live tokens are quantised again then: rare).

The attention part is ("quant-channel", ChannelKeys, value arrays); the CPU decode kernels take
only the per-token layout, so this one goes through MLX's route (attention.attend_mixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from .buffers import QuantBuffer
from .settings import CacheConfigError, CacheSettings

KIND = "quant-channel"


@dataclass(frozen=True)
class ChannelKeys:
    """Per-channel quantised keys ([B, H, D, groups * group_size] packed) and the live count."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    length: int
    bits: int
    group_size: int

    def scores(self, queries: mx.array) -> mx.array:
        """``queries @ keys^T`` for grouped queries [B, H, r, L, D]: [B, H, r, L, length]."""
        w = [mx.expand_dims(x, 2) for x in (self.packed, self.scales, self.biases)]
        s = mx.quantized_matmul(queries, *w, transpose=False, group_size=self.group_size, bits=self.bits)
        return s[..., : self.length]

    def dequantized(self) -> mx.array:
        """The keys as [B, H, length, D]."""
        k = mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        return k.swapaxes(-1, -2)[:, :, : self.length]


class ChannelQuantBuffer:
    """The quantised middle with per-channel keys; the interface of ``QuantBuffer``."""

    kind = KIND

    def __init__(self, step: int, bits: int, group_size: int):
        self.step, self.bits, self.group_size = step, bits, group_size
        self.keys: list[mx.array] | None = None  # transposed, token axis last, whole groups
        self.values: list[mx.array] | None = None  # per token, as QuantBuffer's
        self.length = 0
        self._held_view: tuple | None = None

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        g = self.group_size
        return (self.length + g - 1) // g * g

    def token_bytes(self) -> int:
        """Bytes one token takes in K and V together: with group_size dividing head_dim, a key
        takes what a value does (head_dim packed codes, head_dim / group_size scales and biases
        spread over the group's tokens). A padded last group's padding is not counted."""
        if self.values is None:
            return 0
        per_value = sum(b.shape[0] * b.shape[1] * b.shape[3] * b.itemsize for b in self.values)
        return 2 * per_value

    def flushable(self, n: int) -> int:
        """Of ``n`` tokens leaving the recent window, how many to quantise now (whole groups)."""
        return n // self.group_size * self.group_size

    def front_cut(self, n: int) -> int:
        """The tokens to evict from the front when ``n`` are asked for: whole groups (or all)."""
        g = self.group_size
        return min(self.length, (n + g - 1) // g * g)

    # ---- writes ---------------------------------------------------------------------------
    def _check(self, x: mx.array) -> None:
        if x.shape[-1] % self.group_size:
            raise CacheConfigError(
                f"kv_group_size: head_dim {x.shape[-1]} is not a multiple of kv_group_size {self.group_size}; "
                "quantised values group along head_dim"
            )

    def _key_view(self) -> ChannelKeys:
        return ChannelKeys(*self.keys, self.length, self.bits, self.group_size)

    def _groups(self, n: int) -> int:
        return (n + self.group_size - 1) // self.group_size

    def _cut_keys(self, groups: int) -> None:
        """Keep the first ``groups`` key groups."""
        if groups == 0:
            self.keys = None
            return
        per = self.group_size * self.bits // 32  # packed words per group
        self.keys = [self.keys[0][..., : groups * per], self.keys[1][..., :groups], self.keys[2][..., :groups]]

    def _append_keys(self, keys: mx.array, start: int) -> None:
        """Quantise ``keys`` ([B, H, n, D], the tokens from ``start`` on) after the first ``start``
        held keys; a partial group at ``start`` is taken back and quantised with them."""
        g = self.group_size
        whole = start // g
        if start % g:  # the partial last group: its live tokens join the new ones
            live = self._key_view().dequantized()[:, :, whole * g : start]
            keys = mx.concatenate([live.astype(keys.dtype), keys], axis=2)
        if self.keys is not None:
            self._cut_keys(whole)
        n = keys.shape[2]
        pad = (-n) % g
        if pad:  # copies of the last token: they widen no group's range
            keys = mx.concatenate([keys, mx.repeat(keys[:, :, -1:], pad, axis=2)], axis=2)
        parts = mx.quantize(keys.swapaxes(-1, -2), group_size=g, bits=self.bits)
        if self.keys is None:
            self.keys = list(parts)
        else:
            self.keys = [mx.concatenate([a, b], axis=-1) for a, b in zip(self.keys, parts)]

    def append(self, keys: mx.array, values: mx.array) -> None:
        self._check(values)
        n = keys.shape[2]
        if n == 0:
            return
        self._append_keys(keys, self.length)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        self.values = list(qv) if self.values is None else [mx.concatenate([a, b], axis=2)
                                                            for a, b in zip(self.values, qv)]
        self.length += n
        self._held_view = None

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens (a partial last group is re-packed from its live tokens)."""
        keep = self.length - n
        if keep <= 0:
            self.keys = self.values = None
            self.length, self._held_view = 0, None
            return
        g = self.group_size
        if keep % g:
            live = self._key_view().dequantized()[:, :, keep // g * g : keep]
            self._cut_keys(keep // g)
            self._append_keys(live, keep // g * g)
        else:
            self._cut_keys(keep // g)
        self.values = [b[:, :, :keep] for b in self.values]
        self.length, self._held_view = keep, None

    def remove_front(self, n: int) -> None:
        """Drop the first ``n`` tokens: whole groups (see ``front_cut``), or all of them."""
        if n >= self.length:
            self.trim(self.length)
            return
        if n % self.group_size:
            raise ValueError(f"per-channel keys are evicted in whole groups of {self.group_size} (asked {n})")
        groups = n // self.group_size
        per = self.group_size * self.bits // 32
        self.keys = [self.keys[0][..., groups * per :], self.keys[1][..., groups:], self.keys[2][..., groups:]]
        self.values = [b[:, :, n:] for b in self.values]
        self.length -= n
        self._held_view = None

    def select(self, keep: list[int], deltas: list[int],
               move: Callable[[mx.array, mx.array], mx.array]) -> None:
        """Keep the held tokens ``keep`` (sorted), moving each kept key by its ``deltas`` entry
        with ``move(keys, deltas)`` (scored eviction). Groups before the first dropped token stay
        as packed; the keys from that group on are dequantised, moved and quantised again. (An
        eviction moves no key before the first dropped one; a key that moves is a change too, so
        keeping every token with some delta re-quantises from that key's group, where this
        returned early and dropped the moves.)"""
        changed = next((i for i, (j, d) in enumerate(zip(keep, deltas)) if i != j or d), len(keep))
        if changed == len(keep) == self.length:
            return
        cut = changed // self.group_size * self.group_size
        tail = [(j, d) for j, d in zip(keep, deltas) if j >= cut]
        values = [mx.take(b, mx.array(keep, mx.int32), axis=2) for b in self.values]
        if tail:
            k = mx.take(self._key_view().dequantized(), mx.array([j for j, _ in tail], mx.int32), axis=2)
            k = move(k, mx.array([d for _, d in tail], mx.int32))
            self._cut_keys(cut // self.group_size)
            self._append_keys(k, cut)
        else:
            self._cut_keys(cut // self.group_size)
        self.values, self.length, self._held_view = values, len(keep), None
        if not keep:
            self.keys = self.values = None

    # ---- reads ----------------------------------------------------------------------------
    def packed(self) -> tuple[ChannelKeys, tuple[mx.array, ...]]:
        """The keys (a ``ChannelKeys``) and the values' (packed, scales, biases)."""
        if self._held_view is None:
            self._held_view = (self._key_view(), tuple(self.values))
        return self._held_view

    def dequantized(self) -> tuple[mx.array, mx.array]:
        k, v = self.packed()
        return k.dequantized(), mx.dequantize(*v, group_size=self.group_size, bits=self.bits)

    # ---- persistence ----------------------------------------------------------------------
    def to_state(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def from_state(self, arrays: list[mx.array]) -> None:
        """Restore from ``to_state``'s six arrays (keys transposed, values per token); ValueError
        when they do not fit (the cache reports it as a CacheStateError)."""
        if len(arrays) != 6 or any(x.ndim != 4 for x in arrays):
            raise ValueError("per-channel quantised state must be six 4-d arrays")
        n = arrays[3].shape[2]
        if any(x.shape[2] != n for x in arrays[4:6]) or any(x.shape[-1] != self._groups(n) for x in arrays[1:3]):
            raise ValueError(f"per-channel quantised keys do not fit {n} quantised values")
        self.keys, self.values, self.length, self._held_view = list(arrays[:3]), list(arrays[3:]), n, None


def quant_buffer(settings: CacheSettings) -> QuantBuffer | ChannelQuantBuffer:
    """The quantised middle for ``settings.kv_key_layout``."""
    cls = ChannelQuantBuffer if settings.kv_key_layout == "channel" else QuantBuffer
    return cls(settings.chunk_size, settings.kv_bits, settings.kv_group_size)
