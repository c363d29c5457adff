"""The widgets of the main screen: transcript, input, status bar and side panel.

Model output and user input are always shown as text: it goes through
:func:`chatapp.textsafe.printable` (control characters and escape sequences become visible
symbols) and then into ``rich.text.Text`` objects or a ``Markdown`` widget, never into
anything that parses Rich/Textual markup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Markdown, Sparkline, Static, TextArea

from chatapp.engine.stats import CacheView, MemoryGauges, StepStat, TurnStats, fmt_bytes
from chatapp.textsafe import printable

from .format import (
    MEMORY_SERIES,
    ModeRow,
    StatusItem,
    fmt_rate,
    fmt_seconds_ms,
    fmt_share,
    hbar,
    mode_table,
    pack,
    policy_text,
    render_lines,
    spark,
    steps_by_context,
)

EVICTED_TAG = "outside the model's window"


def safe_text(text: str, style: str = "") -> Text:
    """User or model text as a Rich ``Text`` (never parsed as markup), control characters made visible."""
    return Text(printable(text), style=style)


# ---- transcript -----------------------------------------------------------------------------------
@dataclass
class Entry:
    """One message of the session's conversation, as the UI mirrors it (the app's ``entries``)."""

    role: str
    text: str
    widget: ChatMessage | None = None


class ChatMessage(Vertical):
    """One message of the transcript: a header line (role and state tags) and a body."""

    ROLE = "?"
    DEFAULT_CSS = """
    ChatMessage { height: auto; }
    """

    def __init__(self, text: str = "", conv_index: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.text = text
        self.conv_index = conv_index
        self.tags: list[str] = []

    def compose(self):
        yield Static(self._header(), classes="msg-header", markup=False)
        yield from self.compose_body()

    def compose_body(self):
        yield Static(safe_text(self.text), classes="msg-body", markup=False)

    def _header(self) -> Text:
        head = Text(self.ROLE, style="bold")
        for tag in self.tags:
            head.append("  · ", style="dim")
            head.append(tag, style="italic")
        return head

    def _refresh_header(self) -> None:
        if self.is_mounted:
            self.query_one(".msg-header", Static).update(self._header())

    def set_tag(self, tag: str, on: bool = True) -> None:
        if on and tag not in self.tags:
            self.tags.append(tag)
        elif not on and tag in self.tags:
            self.tags.remove(tag)
        else:
            return
        self._refresh_header()

    def set_evicted(self, evicted: bool) -> None:
        self.set_class(evicted, "evicted")
        self.set_tag(EVICTED_TAG, evicted)

    def set_text(self, text: str) -> None:
        self.text = text
        if self.is_mounted:
            self.query_one(".msg-body", Static).update(safe_text(text))


class UserMessage(ChatMessage):
    ROLE = "you"


class SystemMessage(ChatMessage):
    ROLE = "system prompt"


def _parser():
    """Markdown without raw HTML: ``<b>`` or ``<script>`` in a reply is shown as typed, not dropped."""
    from markdown_it import MarkdownIt

    return MarkdownIt("gfm-like", {"html": False})


class AssistantMessage(ChatMessage):
    """A reply, rendered as Markdown while it streams.

    Markdown does not parse Rich markup (``[bold]`` stays literal); control characters were
    made visible by ``printable`` before the text reached it.
    """

    ROLE = "assistant"

    def __init__(self, text: str = "", conv_index: int | None = None, **kwargs) -> None:
        super().__init__(text, conv_index, **kwargs)
        self.streamed = ""  # the printable text appended so far
        self.appends = 0  # how many batches were drawn while streaming
        self.finished = False
        self.finish_reason = ""

    def compose_body(self):
        yield Markdown(printable(self.text), classes="msg-body", open_links=False, parser_factory=_parser)

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    async def append(self, chunk: str) -> None:
        if not chunk:
            return
        safe = printable(chunk)
        self.streamed += safe
        self.appends += 1
        await self.markdown.append(safe)

    async def finish(self, text: str, finish: str) -> None:
        """The reply is complete: show exactly the text the conversation keeps."""
        self.text = text
        self.finished = True
        self.finish_reason = finish
        self.set_tag("streaming", False)
        for tag in [t for t in self.tags if t.startswith("prefill ")]:
            self.set_tag(tag, False)
        if finish == "cancelled":
            self.set_tag("interrupted" if text else "interrupted before any text")
            self.add_class("interrupted")
        elif finish == "length":
            self.set_tag("stopped at max_tokens")
        safe = printable(text)
        if safe != self.streamed:
            self.streamed = safe
            await self.markdown.update(safe)

    def fail(self, message: str) -> None:
        self.finished = True
        self.set_tag("streaming", False)
        self.set_tag("failed")
        self.add_class("failed")


class ChatView(VerticalScroll):
    """The transcript. Anchored to the bottom; scrolling up releases the anchor until the user
    scrolls back down (Textual's ``anchor``)."""

    DEFAULT_CSS = """
    ChatView { height: 1fr; }
    """

    def on_mount(self) -> None:
        self.anchor()


# ---- input ----------------------------------------------------------------------------------------
class ChatInput(TextArea):
    """Multi-line input: Enter sends; Ctrl+J inserts a new line (it is a plain line feed, so it
    works in every terminal). Shift+Enter and Alt+Enter do too where the terminal reports them
    (kitty keyboard protocol); most terminals send those as a bare Enter. Pasted text keeps its
    new lines."""

    NEWLINE_KEYS = ("ctrl+j", "alt+enter", "shift+enter")
    # TextArea binds F6 to "select line" and F7 to "select all"; here they are the app's
    # configuration and saved-conversations screens (Ctrl+A still selects all).
    BINDINGS = [Binding("f6", "app.show_config", "Config", show=False),
                Binding("f7", "app.sessions", "Sessions", show=False)]

    class Submitted(Message):
        def __init__(self, chat_input: "ChatInput", text: str) -> None:
            super().__init__()
            self.chat_input = chat_input
            self.text = text

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("soft_wrap", True)
        kwargs.setdefault("show_line_numbers", False)
        kwargs.setdefault("tab_behavior", "focus")
        super().__init__(**kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        if event.key in self.NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            if not self.read_only:
                start, end = self.selection
                self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)


# ---- status bar -----------------------------------------------------------------------------------
class StatusBar(Widget):
    """Model, cache mode, speeds and cache gauges on one to three lines (items never split)."""

    DEFAULT_CSS = """
    StatusBar { height: auto; max-height: 3; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.items: list[StatusItem] = []
        self._lines = 1

    def set_items(self, items: list[StatusItem]) -> None:
        self.items = items
        width = self.content_size.width or 80
        lines = len(pack(items, width))
        # Lay out again when the line count changed, or when the height laid out is not this
        # count (a layout measured between two rebuilds, at another width or with other items).
        shown = self.content_size.height
        self.refresh(layout=lines != self._lines or (shown > 0 and shown != min(lines, 3)))
        self._lines = lines

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(pack(self.items, width)) if self.items else 1

    def render(self) -> Text:
        width = self.content_size.width or 80
        if not self.items:
            return Text("")
        return render_lines(pack(self.items, width), width)

    @property
    def plain(self) -> str:
        return " | ".join(f"{i.label} {i.value}".strip() for i in self.items)


# ---- side panel -----------------------------------------------------------------------------------
class StepChartAxis(Static):
    pass


class LayerGauge(Widget):
    """One bar per layer: the KV bytes it holds, relative to the largest layer."""

    DEFAULT_CSS = """
    LayerGauge { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.per_layer: list[int] = []

    def set_layers(self, per_layer: Sequence[int]) -> None:
        changed = len(per_layer) != len(self.per_layer)
        self.per_layer = list(per_layer)
        self.refresh(layout=changed)

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, len(self.per_layer))

    def render(self) -> Text:
        if not self.per_layer:
            return Text("no cache yet", style="dim")
        width = self.content_size.width or 30
        top = max(self.per_layer) or 1
        labels = [f"L{i}" for i in range(len(self.per_layer))]
        values = [fmt_bytes(b) for b in self.per_layer]
        lw = max(len(s) for s in labels)
        vw = max(len(s) for s in values)
        bar_w = max(4, width - lw - vw - 2)
        out = Text(no_wrap=True, overflow="ellipsis")
        for n, (label, b, v) in enumerate(zip(labels, self.per_layer, values)):
            if n:
                out.append("\n")
            out.append(label.ljust(lw) + " ", style="dim")
            out.append(hbar(b, top, bar_w), style="bold")
            out.append(" " + v.rjust(vw))
        return out


class MemoryChart(Widget):
    """MLX's allocator gauges and the KV bytes held: now, as a share of the device's memory, and
    a sparkline of each over the conversation (every reading the engine took: each prefill chunk,
    every few decoded tokens, each turn's end; each line scaled to its own largest value)."""

    DEFAULT_CSS = """
    MemoryChart { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.trace: list[MemoryGauges] = []
        self.now: MemoryGauges | None = None

    def set_trace(self, trace: Sequence[MemoryGauges], now: MemoryGauges | None) -> None:
        self.trace = list(trace)
        self.now = now
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(MEMORY_SERIES) + 1 if self.now is not None else 1

    def render(self) -> Text:
        now = self.now
        if now is None:
            return Text("no memory readings yet", style="dim")
        width = self.content_size.width or 40
        labels = [label for label, _ in MEMORY_SERIES]
        values = [fmt_bytes(getattr(now, attr)) for _, attr in MEMORY_SERIES]
        shares = [fmt_share(now.share(getattr(now, attr))) if now.total else "—" for _, attr in MEMORY_SERIES]
        lw, vw, sw = (max(len(x) for x in col) for col in (labels, values, shares))
        spark_w = max(4, width - lw - vw - sw - 3)
        out = Text(no_wrap=True, overflow="ellipsis")
        for n, (label, attr) in enumerate(MEMORY_SERIES):
            if n:
                out.append("\n")
            out.append(label.ljust(lw) + " ", style="dim")
            out.append(values[n].rjust(vw) + " ", style="bold")
            out.append(shares[n].rjust(sw) + " ", style="dim")
            out.append(spark([getattr(g, attr) for g in self.trace], spark_w))
        tokens = [g.tokens for g in self.trace]
        out.append("\n")
        out.append((f"of {fmt_bytes(now.total)} · " if now.total else "")
                   + f"{len(self.trace)} readings, context {min(tokens, default=0):,}→{max(tokens, default=0):,} tok",
                   style="dim")
        return out


class ModeTable(Widget):
    """Modes grouped by context range (prompt tokens), so each group compares like with like:
    turns, median decode tok/s and median TTFT. Columns fit the panel's width."""

    DEFAULT_CSS = """
    ModeTable { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rows: list[ModeRow] = []

    def set_rows(self, rows: Sequence[ModeRow]) -> None:
        self.rows = list(rows)
        self.refresh(layout=True)

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(self.table_text(self.rows, width).plain.split("\n"))

    def render(self) -> Text:
        return self.table_text(self.rows, self.content_size.width or 40)

    @staticmethod
    def table_text(rows: Sequence[ModeRow], width: int) -> Text:
        if not rows:
            return Text("no finished turns yet", style="dim")
        cells = [(" " + r.mode, str(r.turns), fmt_rate(r.decode_tps), fmt_seconds_ms(r.ttft)) for r in rows]
        head = ("mode", "n", "tok/s", "TTFT")
        widths = [max(len(c[i]) for c in cells + [head]) for i in range(4)]
        gap = 2 if sum(widths) + 6 + 3 <= width else 1
        out = Text(no_wrap=True, overflow="ellipsis")

        def line(values, style="") -> None:
            parts = [values[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(values[1:], widths[1:])]
            out.append((" " * gap).join(parts), style=style)

        line(head, "dim")
        bucket = None
        for row, c in zip(rows, cells):
            if row.bucket != bucket:
                bucket = row.bucket
                out.append(f"\ncontext {bucket} tok", style="italic")
            out.append("\n")
            line(c)
        return out


class SidePanel(VerticalScroll):
    """Decode step time against context, per-layer cache bytes, MLX memory, and the modes used so far."""

    DEFAULT_CSS = """
    SidePanel { height: 1fr; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.mode_rows: list[ModeRow] = []

    def compose(self):
        yield Static("Decode step time vs context", classes="panel-title")
        yield Sparkline([], id="steps-chart", summary_function=lambda xs: sum(xs) / len(xs))
        yield StepChartAxis(Text("no decode steps yet", style="dim"), id="steps-axis", markup=False)
        yield Static("KV cache per layer", classes="panel-title")
        yield LayerGauge(id="layers")
        yield Static("MLX memory over the conversation", classes="panel-title")
        yield MemoryChart(id="memory-chart")
        yield Static("Cache modes in this session", classes="panel-title")
        yield ModeTable(id="modes-table")
        yield Static("Cache policies: tokens evicted / quantised", classes="panel-title")
        yield Static(policy_text(None), id="policies", markup=False)

    def update_panel(self, steps: Iterable[StepStat], cache: CacheView | None,
                     history: Iterable[TurnStats], memory: Sequence[MemoryGauges] = (),
                     memory_now: MemoryGauges | None = None) -> None:
        values, lo, hi = steps_by_context(steps)
        self.query_one("#steps-chart", Sparkline).data = values
        axis = self.query_one("#steps-axis", StepChartAxis)
        if values:
            nonzero = [v for v in values if v]
            axis.update(Text.assemble(
                ("context ", "dim"), (f"{lo:,}", "bold"), (" → ", "dim"), (f"{hi:,}", "bold"), (" tok\n", "dim"),
                ("step ", "dim"), (f"{min(nonzero):.2f}", "bold"), ("–", "dim"), (f"{max(nonzero):.2f}", "bold"),
                (" ms (mean per range)", "dim"),
            ))
        else:
            axis.update(Text("no decode steps yet", style="dim"))
        self.query_one("#layers", LayerGauge).set_layers(cache.per_layer_bytes if cache else [])
        self.query_one("#memory-chart", MemoryChart).set_trace(memory, memory_now)
        self.mode_rows = mode_table(history)
        self.query_one("#modes-table", ModeTable).set_rows(self.mode_rows)
        self.query_one("#policies", Static).update(policy_text(cache))
