"""Cache settings: one frozen dataclass, validated on construction, with clear messages.

The modes and what they mean:
- ``concat``: the naive per-token ``mx.concatenate`` (O(n^2) copying; kept so users can see the cost).
- ``prealloc``: contiguous buffer grown in whole chunks, written in place.
- ``quantized``: full precision until ``quant_start`` tokens, then K/V quantised in chunks.
- ``window``: ``sinks`` attention-sink tokens plus the most recent ``window`` tokens; older
  tokens are evicted and the kept keys re-positioned.
- ``window-quant``: sinks and a recent window at full precision, older tokens quantised, and
  beyond ``max_kv_tokens`` the oldest non-sink tokens evicted with the same re-positioning.
- ``scored``: sinks and a recent window always kept; beyond ``max_kv_tokens`` the middle tokens
  with the least accumulated attention are evicted and the kept keys re-positioned (scored.py).
- ``scored-quant``: ``scored`` with the middle (past the recent window) held quantised, as
  window-quant's: at equal KV bytes it holds 2-4x the tokens of scored or window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MODES = ("concat", "prealloc", "quantized", "window", "window-quant", "scored", "scored-quant")
# What a user may ask for: a mode, or "auto" (the session's policy: prealloc while short, a
# window mode once long). The one list that config, CLI, UI, slash commands and benches use.
AUTO = "auto"
MODE_CHOICES = (AUTO, *MODES)
# Which modes evict, quantise, and cap their tokens at max_kv_tokens (window caps at sinks + window).
EVICTING = ("window", "window-quant", "scored", "scored-quant")
QUANTIZING = ("quantized", "window-quant", "scored-quant")
CAPPED = ("window-quant", "scored", "scored-quant")
QUANT_BITS = (4, 8)
QUANT_GROUP_SIZES = (32, 64, 128)  # the group sizes mx.quantize accepts
# How the quantised middle groups its keys: "token" (each token's head_dim in groups, as values
# are) or "channel" (KIVI: each channel over groups of kv_group_size tokens; quant_channel.py).
KEY_LAYOUTS = ("token", "channel")


class CacheConfigError(ValueError):
    """A cache setting that cannot work; the message names the setting and the reason."""


@dataclass(frozen=True)
class CacheSettings:
    mode: str = "prealloc"
    chunk_size: int = 256  # preallocation growth step; a multiple of 256
    sinks: int = 4  # attention-sink tokens kept at the start (window modes)
    window: int = 1024  # recent tokens kept at full precision (window modes)
    evict_chunk: int = 256  # tokens evicted / quantised at a time, so the cost is amortised
    kv_bits: int = 8
    kv_group_size: int = 64
    quant_start: int = 512  # quantized mode: tokens held at full precision before converting
    max_kv_tokens: int = 4096  # window-quant, scored: token budget; older non-sink tokens are evicted
    kv_key_layout: str = "token"  # quantised keys grouped per token or per channel (KEY_LAYOUTS)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.mode not in MODES:
            raise CacheConfigError(f"mode: unknown cache mode {self.mode!r} (choose from {', '.join(MODES)})")
        for name in ("chunk_size", "window", "evict_chunk", "max_kv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CacheConfigError(f"{name}: must be a positive integer (got {value!r})")
        for name in ("sinks", "quant_start"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise CacheConfigError(f"{name}: must be an integer >= 0 (got {value!r})")
        if self.chunk_size % 256:
            raise CacheConfigError(f"chunk_size: must be a multiple of 256 (got {self.chunk_size})")
        if self.kv_bits not in QUANT_BITS:
            raise CacheConfigError(f"kv_bits: must be one of {QUANT_BITS} (got {self.kv_bits!r})")
        if self.kv_group_size not in QUANT_GROUP_SIZES:
            raise CacheConfigError(
                f"kv_group_size: must be one of {QUANT_GROUP_SIZES} (got {self.kv_group_size!r})"
            )
        if self.kv_key_layout not in KEY_LAYOUTS:
            raise CacheConfigError(
                f"kv_key_layout: must be one of {', '.join(KEY_LAYOUTS)} (got {self.kv_key_layout!r})"
            )
        if self.window < self.sinks:
            raise CacheConfigError(f"window: must be >= sinks ({self.sinks}) (got {self.window})")
        if self.max_kv_tokens < self.sinks + self.window:
            raise CacheConfigError(
                f"max_kv_tokens: must be >= sinks + window ({self.sinks + self.window}) (got {self.max_kv_tokens})"
            )

    @property
    def evicts(self) -> bool:
        return self.mode in EVICTING

    @property
    def quantizes(self) -> bool:
        return self.mode in QUANTIZING

    @property
    def budget(self) -> int | None:
        """Most tokens held after maintenance, or None when the cache keeps everything."""
        if self.mode == "window":
            return self.sinks + self.window
        if self.mode in CAPPED:
            return self.max_kv_tokens
        return None

    def pinning(self, n: int) -> "CacheSettings":
        """These settings with the first ``n`` tokens (the system prompt) never evicted.

        The evicting modes keep their ``sinks`` forever, so pinning raises ``sinks`` to cover
        them, within the same budget: at most half of it (and no more than the recent window,
        which validate() asks), so the prompt never crowds out the recent turns. ``window``
        gives the extra pinned tokens from its recent window (its budget is sinks + window);
        the budgeted modes keep ``max_kv_tokens`` and shrink the window only where it no
        longer fits. Modes that never evict are returned unchanged.
        """
        if not self.evicts or n <= self.sinks:
            return self
        budget = self.budget
        if self.mode == "window":
            keep = min(n, budget // 2)
            return replace(self, sinks=keep, window=budget - keep) if keep > self.sinks else self
        keep = min(n, budget // 2, self.window)
        if keep <= self.sinks:
            return self
        return replace(self, sinks=keep, window=min(self.window, budget - keep))

    def with_(self, **changes) -> "CacheSettings":
        return replace(self, **changes)

    def fitted(self, max_positions: int | None) -> tuple["CacheSettings", list[str]]:
        """Shrink the window settings so an evicting cache never passes the trained context.

        An evicting cache holds at most budget + evict_chunk tokens before it evicts, and the
        engine prefills evicting caches in steps of at most evict_chunk, so positions stay below
        budget + 2 * evict_chunk. Returns the fitted settings and a note for each change.
        """
        if not self.evicts or max_positions is None:
            return self, []
        if self.budget + 2 * self.evict_chunk <= max_positions:
            return self, []
        notes = []
        chunk = self.evict_chunk
        if 8 * chunk > max_positions:
            chunk = max(1, max_positions // 8)
            notes.append(f"evict_chunk {self.evict_chunk} -> {chunk}")
        room = max_positions - 2 * chunk
        sinks = min(self.sinks, room // 2)
        if sinks != self.sinks:
            notes.append(f"sinks {self.sinks} -> {sinks}")
        window, budget = self.window, self.max_kv_tokens
        if self.mode == "window":
            window = min(window, room - sinks)
            budget = max(budget, sinks + window)
        else:
            budget = min(budget, room)
            window = min(window, budget - sinks)
        if window != self.window:
            notes.append(f"window {self.window} -> {window}")
        if self.mode != "window" and budget != self.max_kv_tokens:
            notes.append(f"max_kv_tokens {self.max_kv_tokens} -> {budget}")
        fitted = replace(self, evict_chunk=chunk, sinks=sinks, window=window, max_kv_tokens=budget)
        why = f"to stay inside the model's trained context of {max_positions} positions"
        return fitted, [f"{n} {why}" for n in notes]
