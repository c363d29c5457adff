"""Pure helpers for the TUI: number formatting, gauges, charts, the mode table, validation.

Nothing here imports Textual or MLX, so all of it is unit-testable on its own. The UI reads
only the engine's plain statistics dataclasses (:mod:`chatapp.engine.stats`).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

from rich.cells import cell_len
from rich.text import Text

from cache.settings import AUTO_STARTS_AS, CROSS_RULES, DIALOG_KNOBS, EVICTING, MODE_CHOICES, Knob, one_of
from chatapp.engine.stats import CacheView, MemoryGauges, StepStat, TurnStats, fmt_bytes
from chatapp.textsafe import printable

MODES = list(MODE_CHOICES)  # the modes the UI offers, in the order F3 cycles them
MODE_HELP = {
    "auto": f"{AUTO_STARTS_AS} while short, window-quant (or window) once the conversation is long",
    "concat": "full precision; grows by concatenation (the simple reference)",
    "prealloc": "full precision; grows in chunks of chunk_size tokens",
    "quantized": "full precision up to quant_start tokens, then kv_bits-bit keys/values",
    "window": "attention sinks + the last `window` tokens; older ones are evicted",
    "window-quant": "sinks + recent window at full precision, older tokens quantised, max_kv_tokens in all",
    "scored": "sinks + recent window kept; past max_kv_tokens the least-attended older tokens are evicted",
    "scored-quant": "scored, with the older tokens quantised: more of them kept in the same memory",
}
#: The settings the mode dialog edits, with the modes they matter for (the knobs' declarations).
MODE_FIELDS = {knob.name: knob.modes for knob in DIALOG_KNOBS}

SEP = " │ "


# ---- numbers ------------------------------------------------------------------------------------
def fmt_rate(x: float) -> str:
    """Tokens per second, or an em dash when there is nothing to show yet."""
    if not x or x <= 0 or not math.isfinite(x):
        return "—"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}"


def fmt_seconds_ms(seconds: float) -> str:
    if not seconds or seconds <= 0 or not math.isfinite(seconds):
        return "—"
    ms = seconds * 1000
    if ms < 10:
        return f"{ms:.1f} ms"
    if ms < 10_000:
        return f"{ms:.0f} ms"
    return f"{seconds:.1f} s"


def fmt_share(share: float) -> str:
    if share <= 0:
        return "0%"
    pct = share * 100
    if pct < 0.01:
        return "<0.01%"
    if pct < 1:
        return f"{pct:.2f}%"
    return f"{pct:.1f}%"


def model_label(model_id: str) -> str:
    """A short, printable name: a local folder's name, or the hub repo id."""
    if not model_id:
        return "?"
    p = Path(model_id).expanduser()
    if model_id.startswith((".", "/", "~")) or p.exists():
        model_id = p.name or model_id
    return printable(model_id).replace("\n", " ")


# ---- deterministic statistics for tests and snapshots ----------------------------------------------
FROZEN_MEMORY_TOTAL = 16 * 1024**3
FROZEN_MODEL_BYTES = 1 << 20  # stands for the weights and buffers MLX holds besides the KV cache


def freeze_cache(view: CacheView) -> CacheView:
    return replace(view, memory_total=FROZEN_MEMORY_TOTAL, per_layer_bytes=list(view.per_layer_bytes))


def freeze_memory(g: MemoryGauges) -> MemoryGauges:
    """Allocator gauges as fixed functions of the KV bytes and token counts (they depend on the
    allocator's history, which differs from run to run)."""
    active = FROZEN_MODEL_BYTES + g.kv_held
    return replace(g, active=active, cache=256 * g.tokens, peak=active + 512 * g.tokens, total=FROZEN_MEMORY_TOTAL)


def freeze(stats: TurnStats) -> TurnStats:
    """A copy of ``stats`` whose timings depend only on token counts, so screens are reproducible.

    Token counts and byte counts are deterministic already (greedy decoding); wall-clock times
    and the machine's memory size are not, so they are replaced by fixed functions of the counts.
    """
    s = copy.copy(stats)
    s.prefill_seconds = s.prefill_tokens / 2000 if s.prefill_tokens else 0.0
    s.ttft = 0.010 + s.prefill_seconds if (s.generated_tokens or s.ttft) else 0.0
    s.decode_seconds = max(s.generated_tokens - 1, 0) / 250
    s.peak_memory = 0
    s.steps = [StepStat(st.context, 2.0 + st.context / 1000) for st in stats.steps]
    s.notices = list(stats.notices)
    s.cache = freeze_cache(stats.cache)
    s.memory = freeze_memory(stats.memory)
    s.memory_trace = [freeze_memory(g) for g in stats.memory_trace]
    return s


# ---- live cache estimate -------------------------------------------------------------------------
def live_cache(stats: TurnStats, last: CacheView | None, budget: int | None = None) -> CacheView:
    """An estimate of the cache while a reply streams.

    The engine measures the cache exactly when a turn ends (``TurnStats.cache``); during the
    turn it reports token counts only. The estimate starts from the last measurement and adds
    the tokens this turn brought in beyond what the cache already covered (``reused +
    prefilled + generated - last.conversation_tokens``; negative when the turn trimmed the
    cache, e.g. regenerate), capped at ``budget`` for the evicting modes, and prices them at
    the last measured bytes per token.
    """
    if stats.cache.tokens:  # the engine measured it: use that
        return stats.cache
    last = last or CacheView()
    covered = stats.reused_tokens + stats.prefill_tokens + stats.generated_tokens
    tokens = max(last.tokens + covered - last.conversation_tokens, stats.generated_tokens, 0)
    evicting = stats.mode in EVICTING
    if evicting and budget:
        tokens = min(tokens, budget)
    per_token = last.bytes_held / last.tokens if last.tokens else 0.0
    capacity = last.capacity if evicting or not last.capacity else max(last.capacity, tokens)
    held = int(tokens * per_token)
    quant = min(last.quant_tokens, tokens)
    return CacheView(
        mode=stats.mode or last.mode, tokens=tokens, capacity=capacity,
        full_tokens=max(tokens - quant, 0), quant_tokens=quant, evicted=last.evicted,
        bytes_held=held, bytes_allocated=max(last.bytes_allocated, held),
        full_bytes=last.full_bytes, quant_bytes=last.quant_bytes, memory_total=last.memory_total,
        conversation_tokens=max(last.conversation_tokens, covered),
        first_visible_message=last.first_visible_message, per_layer_bytes=list(last.per_layer_bytes),
    )


# ---- the status bar ------------------------------------------------------------------------------
@dataclass
class StatusItem:
    label: str
    value: str
    style: str = "bold"

    @property
    def width(self) -> int:
        return cell_len(self.label) + 1 + cell_len(self.value) if self.label else cell_len(self.value)

    def text(self) -> Text:
        if not self.label:
            return Text(self.value, style=self.style)
        return Text.assemble((self.label + " ", "dim"), (self.value, self.style))


def memory_items(g: MemoryGauges | None, kv_held: int) -> list[StatusItem]:
    """MLX's allocator gauges and their shares of the device's memory, next to the KV bytes held."""
    if g is None or not (g.active or g.peak):
        return [StatusItem("MLX", "—"), StatusItem("mem", "—")]
    shares = f"KV {fmt_share(g.share(kv_held))} · act {fmt_share(g.share(g.active))} · " \
             f"peak {fmt_share(g.share(g.peak))}" if g.total else "—"
    return [
        StatusItem("MLX", f"{fmt_bytes(g.active)} act · {fmt_bytes(g.cache)} cache · {fmt_bytes(g.peak)} peak"),
        StatusItem("mem", shares),
    ]


def status_items(model: str, mode: str, stats: TurnStats | None, cache: CacheView | None,
                 live: bool = False, phase: str = "", memory: MemoryGauges | None = None) -> list[StatusItem]:
    """Everything the status bar shows, most important first.

    ``live`` marks cache figures estimated while a reply streams (shown with a ``~``); ``memory``
    is the latest reading of MLX's gauges (the turn's own when ``stats`` has one).
    """
    s = stats or TurnStats()
    c = cache or CacheView()
    if s.memory.active or s.memory.peak:
        memory = s.memory
    est = "~" if live else ""
    items = [
        StatusItem("", model_label(model), "bold"),
        StatusItem("mode", mode or c.mode or "?", "bold"),
        StatusItem("decode", f"{fmt_rate(s.decode_tps)} tok/s"),
        StatusItem("prefill", f"{fmt_rate(s.prefill_tps)} tok/s"),
        StatusItem("TTFT", fmt_seconds_ms(s.ttft)),
        StatusItem("cache", f"{est}{c.tokens:,}/{c.capacity:,} tok" if c.capacity or not live
                   else f"~{c.tokens:,}/? tok"),
        StatusItem("KV", f"{est}{fmt_bytes(c.bytes_held)}/{fmt_bytes(c.bytes_allocated)}"
                   if c.bytes_held or not live or not c.tokens else "~?"),
        *memory_items(memory, c.bytes_held),
        StatusItem("full/quant/evicted", f"{c.full_tokens:,}/{c.quant_tokens:,}/{c.evicted:,}"),
    ]
    if c.attention_sparsity is not None:
        items.append(StatusItem("attn on evictable", f"{c.attention_sparsity:.0%}"))
    if phase:
        items.insert(1, StatusItem("", phase, "italic"))
    return items


def pack(items: Sequence[StatusItem], width: int, max_lines: int = 3) -> list[list[StatusItem]]:
    """Greedily put items on lines of ``width`` cells, separated by ``SEP``; never splits one.

    Once ``max_lines`` are full, an item that does not fit is left out and later, shorter ones
    may still take the room left."""
    lines: list[list[StatusItem]] = [[]]
    used = 0
    for item in items:
        need = item.width + (len(SEP) if lines[-1] else 0)
        if lines[-1] and used + need > width:
            if len(lines) == max_lines:
                continue
            lines.append([])
            used = 0
            need = item.width
        lines[-1].append(item)
        used += need
    return lines


def render_lines(lines: list[list[StatusItem]], width: int) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis")
    for n, line in enumerate(lines):
        if n:
            out.append("\n")
        for k, item in enumerate(line):
            if k:
                out.append(SEP, style="dim")
            out.append_text(item.text())
    out.truncate(width * len(lines) + len(lines), overflow="ellipsis")
    return out


# ---- charts ------------------------------------------------------------------------------------
BLOCKS = " ▏▎▍▌▋▊▉█"


def hbar(value: float, maximum: float, width: int) -> str:
    """A horizontal bar of ``width`` cells filled to ``value / maximum`` (eighth-cell steps)."""
    if width <= 0:
        return ""
    if maximum <= 0 or value <= 0:
        return " " * width
    eighths = round(min(value / maximum, 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (BLOCKS[part] if part else "")
    return bar.ljust(width)


SPARKS = "▁▂▃▄▅▆▇█"


def spark(values: Sequence[float], width: int) -> str:
    """``values`` as a one-line sparkline of at most ``width`` cells, scaled to their largest value;
    when there are more values than cells, each cell shows the largest value of its share."""
    if width <= 0 or not values:
        return ""
    n = min(width, len(values))
    cells = [max(values[i * len(values) // n : max((i + 1) * len(values) // n, i * len(values) // n + 1)])
             for i in range(n)]
    top = max(cells)
    if top <= 0:
        return SPARKS[0] * n
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))] for v in cells)


#: The gauges the side panel plots over the conversation: (label, MemoryGauges attribute).
MEMORY_SERIES = (("KV held", "kv_held"), ("MLX active", "active"), ("buffer cache", "cache"), ("peak", "peak"))


def steps_by_context(steps: Iterable[StepStat], bins: int = 64) -> tuple[list[float], int, int]:
    """Decode step times resampled onto ``bins`` equal context ranges (mean ms per range).

    Returns (values, lowest context, highest context). Empty ranges take the previous value
    so the line stays continuous.
    """
    steps = list(steps)
    if not steps:
        return [], 0, 0
    lo = min(s.context for s in steps)
    hi = max(s.context for s in steps)
    n = max(1, min(bins, hi - lo + 1))
    sums = [0.0] * n
    counts = [0] * n
    for s in steps:
        i = 0 if hi == lo else min(n - 1, (s.context - lo) * n // (hi - lo + 1))
        sums[i] += s.ms
        counts[i] += 1
    values: list[float] = []
    prev = None
    for total, count in zip(sums, counts):
        if count:
            prev = total / count
        values.append(prev if prev is not None else 0.0)
    first = next((v for v in values if v), 0.0)
    values = [v if v else first for v in values]
    return values, lo, hi


def context_bucket(tokens: int) -> tuple[int, str]:
    """Power-of-two context ranges, so turns are compared at similar context sizes."""
    if tokens < 128:
        return 0, "<128"
    lo = 1 << (int(tokens).bit_length() - 1)
    return lo, f"{lo}–{2 * lo - 1}"


@dataclass
class ModeRow:
    mode: str
    bucket: str
    turns: int
    decode_tps: float
    ttft: float
    prefill_tps: float


def mode_table(history: Iterable[TurnStats]) -> list[ModeRow]:
    """Median decode rate, TTFT and prefill rate per (context range, mode), for the side panel."""
    groups: dict[tuple[int, str, str], list[TurnStats]] = {}
    for s in history:
        if not s.generated_tokens:
            continue
        key_lo, label = context_bucket(s.prompt_tokens)
        groups.setdefault((key_lo, label, s.mode), []).append(s)
    rows = []
    for (lo, label, mode), turns in sorted(groups.items(), key=lambda kv: (kv[0][0], MODES.index(kv[0][2])
                                                                        if kv[0][2] in MODES else 99)):
        decode = [t.decode_tps for t in turns if t.decode_tps > 0]
        prefill = [t.prefill_tps for t in turns if t.prefill_tps > 0]
        rows.append(ModeRow(
            mode, label, len(turns),
            statistics.median(decode) if decode else 0.0,
            statistics.median([t.ttft for t in turns]),
            statistics.median(prefill) if prefill else 0.0,
        ))
    return rows


def policy_text(cache: CacheView | None) -> Text:
    """The side panel's cache policies: the tokens each policy (cache mode) evicted and quantised
    in this conversation, across mode switches, and the share of the last turn's attention that
    fell on the tokens the current policy could evict (None outside the evicting modes)."""
    c = cache or CacheView()
    tallies = {**c.evicted_by_policy, **c.quantised_by_policy}
    order = [m for m in MODES if m in tallies] + sorted(m for m in tallies if m not in MODES)
    out = Text(no_wrap=True, overflow="ellipsis")
    if not order:
        out.append("nothing evicted or quantised yet", style="dim")
    else:
        width = max(len("policy"), *(len(m) for m in order))
        out.append(f"{'policy'.ljust(width)}  {'evicted':>9}  {'quantised':>9}", style="dim")
        for m in order:
            evicted, quantised = c.evicted_by_policy.get(m, 0), c.quantised_by_policy.get(m, 0)
            out.append(f"\n{m.ljust(width)}  {evicted:>9,}  {quantised:>9,}")
    out.append("\nattn on evictable ", style="dim")
    if c.attention_sparsity is None:
        out.append("—", style="dim")
    else:
        out.append(f"{c.attention_sparsity:.0%}", style="bold")
        out.append(" of the last turn's", style="dim")
    return out


# ---- the mode dialog -------------------------------------------------------------------------------
def validate_mode_fields(mode: str, raw: dict[str, str]) -> tuple[dict[str, int | str], dict[str, str]]:
    """Parse and check the dialog's fields (the same rules as ``CacheSettings.validate``).

    Returns (values, errors): ``errors`` maps a field to a one-line reason; ``values`` holds
    every field that parsed.
    """
    errors: dict[str, str] = {}
    values: dict[str, int | str] = {}
    if mode not in MODES:
        errors["mode"] = f"choose one of {', '.join(MODES)}"
    for knob in DIALOG_KNOBS:
        value, error = _field_value(knob, raw.get(knob.name))
        if value is not None:
            values[knob.name] = value
        if error:
            errors[knob.name] = error
    for rule in CROSS_RULES:  # each read once its fields are whole numbers in range
        broken = None if errors.keys() & set(rule.fields) else rule.violation(values)
        if broken is not None:
            errors[broken.field] = broken.words()
    return values, errors


def _field_value(knob: Knob, raw: object) -> tuple[int | str | None, str]:
    """A dialog field's value (None when it does not parse) and why it cannot be used ("" when it can).

    A text knob is a Select (its default when absent); a typed number is kept once it parses, even
    out of range (the dialog's ``values`` hold every field that parsed).
    """
    if knob.type is str:
        text = str(knob.default if raw is None else raw)
        return (text, "") if text in knob.choices else (None, f"must be {one_of(knob.choices)}")
    text = str("" if raw is None else raw).strip()
    try:
        number = int(text)
    except ValueError:
        return None, "must be a whole number" if text else "required"
    if knob.choices and number not in knob.choices:
        return number, f"must be {one_of(knob.choices)}"
    if knob.multiple is not None and (number <= 0 or number % knob.multiple):
        return number, f"must be a positive multiple of {knob.multiple}"
    if knob.minimum is not None and number < knob.minimum:
        return number, f"must be >= {knob.minimum}"
    return number, ""


def fmt_when(ts: float, now: float | None = None) -> str:
    """When a conversation was last updated: the time today, else the date and time."""
    now = time.time() if now is None else now
    lt = time.localtime(ts)
    if time.localtime(now)[:3] == lt[:3]:
        return time.strftime("today %H:%M", lt)
    return time.strftime("%Y-%m-%d %H:%M", lt)
