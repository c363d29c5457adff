"""Statistics of a turn, updated live, plus per-step timings kept for plotting."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .cache_map import MessageCache


@dataclass
class StepStat:
    context: int  # tokens the model attended to at this step
    ms: float  # wall time of the step


@dataclass
class CacheView:
    """Cache usage as the UI shows it; plain numbers only (the UI never touches MLX arrays)."""

    mode: str = ""
    tokens: int = 0
    capacity: int = 0
    full_tokens: int = 0
    quant_tokens: int = 0
    evicted: int = 0
    bytes_held: int = 0
    bytes_allocated: int = 0
    full_bytes: int = 0
    quant_bytes: int = 0
    memory_total: int = 0  # bytes of device memory: the budget the share is taken of
    conversation_tokens: int = 0  # tokens the whole conversation renders to
    first_visible_message: int = 0  # messages before this one are outside the model's window
    per_layer_bytes: list[int] = field(default_factory=list)
    # Evicting modes: share of the last queries' attention mass that fell on tokens the policy
    # could evict (scored, scored-quant, window-quant: the middle, not sinks or recent window;
    # window: the oldest evict_chunk non-sink tokens, its next eviction); None for other modes.
    attention_sparsity: float | None = None
    # What the cache holds of each message (engine/cache_map.py); empty in live views while streaming.
    messages: list[MessageCache] = field(default_factory=list)
    # Tokens each policy (cache mode) has evicted / quantised in this conversation, across mode
    # switches: {"window": 512, "scored-quant": 256}.
    evicted_by_policy: dict[str, int] = field(default_factory=dict)
    quantised_by_policy: dict[str, int] = field(default_factory=dict)

    @property
    def memory_share(self) -> float:
        return self.bytes_held / self.memory_total if self.memory_total else 0.0

    @property
    def in_view(self) -> float:
        """Share of the conversation's tokens the model still sees."""
        if not self.conversation_tokens:
            return 1.0
        return min(1.0, self.tokens / self.conversation_tokens)


@dataclass
class MemoryGauges:
    """One reading of MLX's allocator (see chatapp/engine/memory.py), next to the KV bytes the
    caches hold; plain numbers, so the UI can show them without touching MLX."""

    active: int = 0  # bytes in arrays MLX holds
    cache: int = 0  # bytes of freed buffers MLX keeps for reuse
    peak: int = 0  # highest active since the turn started
    total: int = 0  # device memory: the budget the shares are taken of
    kv_held: int = 0  # KV bytes the caches hold (CacheView.bytes_held)
    tokens: int = 0  # tokens of the conversation the caches represent

    def share(self, n: int) -> float:
        return n / self.total if self.total else 0.0

    def shares(self) -> dict[str, float]:
        return {f"{name}_share": self.share(getattr(self, name)) for name in ("active", "cache", "peak", "kv_held")}


@dataclass
class TurnStats:
    mode: str = ""
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens already in the cache
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    ttft: float = 0.0  # seconds from the turn's start to its first token
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    finish: str = ""  # "eos", "stop", "length", "cancelled", "error" (a reply that raised part-way)
    route: str = ""  # the decode's route: "fused" (the native step) or "mlx (why)", engine/route.py
    peak_memory: int = 0
    prefix_tokens: int = 0  # prompt tokens loaded from the prefix store when the turn started
    prefix_seconds: float = 0.0  # reading them and converting them into the cache mode
    cache: CacheView = field(default_factory=CacheView)
    memory: MemoryGauges = field(default_factory=MemoryGauges)  # the latest reading
    memory_trace: list[MemoryGauges] = field(default_factory=list)  # readings during the turn
    notices: list[str] = field(default_factory=list)
    steps: list[StepStat] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # The first token comes from the prefill's logits; decode rate counts the steps after it.
        n = self.generated_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def to_json(self, with_steps: bool = True) -> dict:
        d = asdict(self)
        d["prefill_tps"] = self.prefill_tps
        d["decode_tps"] = self.decode_tps
        d["cache"]["memory_share"] = self.cache.memory_share
        d["cache"]["in_view"] = self.cache.in_view
        d["memory"].update(self.memory.shares())
        if not with_steps:
            d.pop("steps")
            d.pop("memory_trace")
        return d

    def prefix_line(self) -> str:
        """What the prefix store saved this turn ("" when it was not used)."""
        if not self.prefix_tokens:
            return ""
        return (f"reused {self.prefix_tokens} prefix tokens from the prefix store "
                f"({self.prefix_seconds * 1000:.0f} ms)")

    def short(self) -> str:
        c = self.cache
        return (
            f"[{self.mode}] prompt {self.prompt_tokens} (reused {self.reused_tokens}) | "
            f"prefill {self.prefill_tps:.1f} tok/s | TTFT {self.ttft * 1000:.0f} ms | "
            f"decode {self.decode_tps:.1f} tok/s ({self.generated_tokens} tok, {self.finish}) | "
            f"cache {c.tokens}/{c.capacity} tok, {fmt_bytes(c.bytes_held)}/{fmt_bytes(c.bytes_allocated)} "
            f"(full {c.full_tokens}, quant {c.quant_tokens}, evicted {c.evicted}) | "
            f"MLX {fmt_bytes(self.memory.active)} active, {fmt_bytes(self.memory.cache)} cache, "
            f"{fmt_bytes(self.memory.peak)} peak"
        )


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
