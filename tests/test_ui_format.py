"""The TUI's pure helpers and its widgets on their own (no model needed)."""

from __future__ import annotations

import asyncio
import io

import pytest
from rich.cells import cell_len
from rich.console import Console
from textual.app import App

from chatapp.engine.events import LoadProgress
from chatapp.engine.stats import CacheView, MemoryGauges, StepStat, TurnStats
from chatapp.ui.format import (
    MODES,
    StatusItem,
    context_bucket,
    fmt_rate,
    fmt_seconds_ms,
    fmt_share,
    freeze,
    hbar,
    live_cache,
    memory_items,
    mode_table,
    model_label,
    pack,
    policy_text,
    render_lines,
    spark,
    status_items,
    steps_by_context,
    validate_mode_fields,
)
from chatapp.ui.screens import CompareScreen, LoadingScreen
from chatapp.ui.widgets import AssistantMessage, LayerGauge, StatusBar, UserMessage


def stats(mode="prealloc", prompt=40, generated=20, ttft=0.05, decode=0.2, prefill=40, prefill_s=0.02, **cache):
    return TurnStats(mode=mode, prompt_tokens=prompt, prefill_tokens=prefill, prefill_seconds=prefill_s, ttft=ttft,
                     generated_tokens=generated, decode_seconds=decode, cache=CacheView(mode=mode, **cache),
                     steps=[StepStat(prompt + i, 1.0 + i) for i in range(generated - 1)])


def test_number_formats():
    assert fmt_rate(0) == "—" and fmt_rate(float("nan")) == "—"
    assert fmt_rate(12.345) == "12.3" and fmt_rate(1234.5) == "1,234"
    assert fmt_seconds_ms(0) == "—" and fmt_seconds_ms(0.0042) == "4.2 ms" and fmt_seconds_ms(0.25) == "250 ms"
    assert fmt_seconds_ms(12.5) == "12.5 s"
    assert fmt_share(0) == "0%" and fmt_share(1e-6) == "<0.01%" and fmt_share(0.005) == "0.50%"
    assert fmt_share(0.25) == "25.0%"


def test_model_label(tmp_path):
    assert model_label(str(tmp_path / "stories260K-4bit")) == "stories260K-4bit"
    assert model_label("mlx-community/Llama-2-7b-chat-4-bit") == "mlx-community/Llama-2-7b-chat-4-bit"
    assert model_label("evil\x1b[2Jname") == "evil␛[2Jname"


def test_freeze_is_deterministic_and_keeps_counts():
    a = stats(ttft=0.123, decode=0.9, memory_total=123, tokens=60, capacity=256, bytes_held=1000)
    b = stats(ttft=0.456, decode=0.1, memory_total=999, tokens=60, capacity=256, bytes_held=1000)
    fa, fb = freeze(a), freeze(b)
    assert (fa.ttft, fa.decode_tps, fa.prefill_tps, fa.cache.memory_total) == \
        (fb.ttft, fb.decode_tps, fb.prefill_tps, fb.cache.memory_total)
    assert [s.ms for s in fa.steps] == [s.ms for s in fb.steps]
    a.memory = MemoryGauges(active=123, cache=5, peak=999, total=7, kv_held=1000, tokens=60)
    b.memory = MemoryGauges(active=456, cache=9, peak=777, total=8, kv_held=1000, tokens=60)
    a.memory_trace, b.memory_trace = [a.memory], [b.memory]
    fa, fb = freeze(a), freeze(b)
    assert fa.memory == fb.memory and fa.memory_trace == fb.memory_trace and fa.memory.active > fa.memory.kv_held
    assert fa.generated_tokens == a.generated_tokens and fa.cache.tokens == 60
    assert a.ttft == 0.123  # the original is untouched


def test_live_cache_estimate():
    last = CacheView(mode="prealloc", tokens=100, capacity=256, bytes_held=10_000, bytes_allocated=25_600,
                     conversation_tokens=100)
    s = TurnStats(mode="prealloc", reused_tokens=99, prefill_tokens=11, generated_tokens=5)
    est = live_cache(s, last)
    assert est.tokens == 115 and est.bytes_held == 11_500 and est.capacity == 256
    # A regenerate trims the cache first: the estimate goes down, not up.
    s = TurnStats(mode="prealloc", reused_tokens=60, prefill_tokens=1, generated_tokens=2)
    assert live_cache(s, last).tokens == 63
    # Evicting modes never exceed their budget; the exact view wins when the engine sent one.
    win = CacheView(mode="window", tokens=132, capacity=512, bytes_held=13_200, conversation_tokens=900, evicted=768)
    s = TurnStats(mode="window", reused_tokens=900, prefill_tokens=20, generated_tokens=40)
    assert live_cache(s, win, budget=132).tokens == 132
    exact = TurnStats(cache=CacheView(tokens=7))
    assert live_cache(exact, last).tokens == 7


def test_status_items_and_packing():
    s = stats(tokens=1703, capacity=1792, bytes_held=2_200_000, bytes_allocated=2_300_000, memory_total=16 * 2**30,
              full_tokens=1700, quant_tokens=3, evicted=1635)
    items = status_items("../shared/models/stories260K-4bit", "auto→prealloc", s, s.cache, phase="streaming")
    plain = " ".join(f"{i.label} {i.value}" for i in items)
    for part in ("stories260K-4bit", "streaming", "auto→prealloc", "decode", "prefill", "TTFT", "1,703/1,792 tok",
                 "2.1 MiB/2.2 MiB", "mem", "1,700/3/1,635"):
        assert part in plain
    for width in (40, 80, 120, 200):
        lines = pack(items, width, max_lines=10)
        assert sum(len(line) for line in lines) == len(items)  # nothing dropped, nothing split
        for line in lines:
            assert len(line) == 1 or sum(i.width for i in line) + 3 * (len(line) - 1) <= width
        text = render_lines(lines, width)
        assert all(cell_len(row) <= width for row in text.plain.split("\n"))
    assert len(pack(items, 200)) == 1 and len(pack(items, 80)) <= 3
    live = status_items("m", "window", s, s.cache, live=True)
    assert any(i.value.startswith("~") for i in live)


def test_hbar():
    assert hbar(0, 10, 5) == "     " and hbar(10, 10, 5) == "█████" and hbar(20, 10, 4) == "████"
    assert hbar(5, 10, 4) == "██  " and len(hbar(3, 7, 9)) == 9 and hbar(1, 0, 3) == "   "


def test_spark():
    assert spark([], 5) == "" and spark([1, 2], 0) == ""
    assert spark([0, 0, 0], 8) == "▁▁▁"
    assert spark([1, 2, 3, 4, 5, 6, 7, 8], 8) == "▂▃▄▅▅▆▇█"
    line = spark(list(range(100)) + [1000], 10)  # more values than cells: each cell keeps its largest
    assert len(line) == 10 and line[-1] == "█" and line[0] == "▁"


def test_memory_items_and_packing_that_skips_what_does_not_fit():
    assert [i.value for i in memory_items(None, 0)] == ["—", "—"]
    g = MemoryGauges(active=12 << 20, cache=3 << 20, peak=15 << 20, total=16 << 30, kv_held=1 << 20)
    mlx, mem = memory_items(g, 1 << 20)
    assert mlx.value == "12.0 MiB act · 3.0 MiB cache · 15.0 MiB peak"
    assert mem.value == "KV <0.01% · act 0.07% · peak 0.09%"
    s = stats(tokens=60, capacity=256, bytes_held=1 << 20, memory_total=16 << 30)
    s.memory = g
    items = status_items("m", "prealloc", s, s.cache, memory=None)
    assert any(i.label == "MLX" and i.value == mlx.value for i in items)  # the turn's own reading
    # once the lines are full, a long item is left out and a later, shorter one still fits
    lines = pack([StatusItem("", "a" * 30), StatusItem("", "b" * 30), StatusItem("", "c" * 5)], 40, max_lines=1)
    assert [[i.value for i in line] for line in lines] == [["a" * 30, "c" * 5]]


def test_steps_by_context():
    assert steps_by_context([]) == ([], 0, 0)
    steps = [StepStat(c, c / 10) for c in range(100, 200)] + [StepStat(500, 50.0)]
    values, lo, hi = steps_by_context(steps, bins=10)
    assert (lo, hi) == (100, 500) and len(values) == 10
    assert values[0] == pytest.approx(sum(c / 10 for c in range(100, 141)) / 41)
    assert values[-1] == 50.0 and all(v > 0 for v in values)  # gaps carry the previous value


def test_mode_table_groups_by_context():
    history = [stats("prealloc", prompt=50, decode=0.19), stats("prealloc", prompt=60, decode=0.38),
               stats("window", prompt=300, decode=0.095), stats("concat", prompt=70),
               stats("prealloc", prompt=70, generated=0)]
    rows = mode_table(history)
    assert [(r.bucket, r.mode, r.turns) for r in rows] == [("<128", "concat", 1), ("<128", "prealloc", 2),
                                                            ("256–511", "window", 1)]
    assert rows[1].decode_tps == pytest.approx((100 + 50) / 2)
    assert context_bucket(127)[1] == "<128" and context_bucket(1024)[1] == "1024–2047"


def test_validate_mode_fields():
    good = {"window": "128", "sinks": "4", "kv_bits": "8", "kv_group_size": "64", "max_kv_tokens": "4096"}
    values, errors = validate_mode_fields("window", good)
    assert errors == {} and values["window"] == 128
    _, errors = validate_mode_fields("window", {**good, "window": "2"})
    assert errors == {"window": "must be >= sinks (4)"}
    _, errors = validate_mode_fields("window-quant", {**good, "max_kv_tokens": "100"})
    assert errors == {"max_kv_tokens": "must be >= sinks + window (132)"}
    _, errors = validate_mode_fields("quantized", {**good, "kv_bits": "3", "kv_group_size": "16", "sinks": "-1"})
    assert set(errors) == {"kv_bits", "kv_group_size", "sinks"}
    _, errors = validate_mode_fields("nope", {**good, "window": "", "sinks": "x"})
    assert errors["mode"].startswith("choose one of") and errors["window"] == "required"
    assert errors["sinks"] == "must be a whole number"
    values, errors = validate_mode_fields("window-quant", {**good, "kv_key_layout": "channel"})
    assert errors == {} and values["kv_key_layout"] == "channel"
    _, errors = validate_mode_fields("window-quant", {**good, "kv_key_layout": "row"})
    assert errors == {"kv_key_layout": "must be token or channel"}


def test_f3_cycles_through_every_mode():
    """F3's action with no mode asks for the mode after the one asked for last, round ``MODES``."""
    from chatapp.config import Config
    from chatapp.ui.app import ChatApp

    app = ChatApp(Config())
    app.engine.loaded = True
    sent = []
    app.engine.submit = sent.append  # the requests F3 makes, not sent to an engine
    for _ in MODES:
        app.action_cache_mode()
    seen = [request.mode for request in sent]
    assert sorted(seen) == sorted(MODES) and seen[-1] == app.config.cache.mode == "auto"
    assert seen[0] == MODES[(MODES.index("auto") + 1) % len(MODES)]


# ---- widgets in a bare app --------------------------------------------------------------------
class Host(App):
    def __init__(self, *widgets):
        super().__init__()
        self._host_widgets = widgets

    def compose(self):
        yield from self._host_widgets


def screen_text(app) -> str:
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text(styles=False)


EVIL = "[bold red]x[/] \x1b[2J \x07 a\rb [link=https://example.com]y[/link] \x9b31m"
SHOWN = "[bold red]x[/] ␛[2J ␇ a␍b [link=https://example.com]y[/link] \\x9b31m"


def test_messages_show_markup_and_control_characters_literally():
    async def main():
        user, reply = UserMessage(EVIL), AssistantMessage()
        app = Host(user, reply)
        async with app.run_test(size=(120, 20)) as pilot:
            await pilot.pause()
            for piece in ("[bold", " red]x[/] \x1b", "[2J \x07 a\r", "b [link=https://example.com]y[/link] \x9b31m"):
                await reply.append(piece)
            await reply.finish(EVIL + " <b>html</b>", "eos")
            await pilot.pause()
            text = screen_text(app)
            assert reply.markdown.source == SHOWN + " <b>html</b>"
        assert text.count(SHOWN) == 2 and "<b>html</b>" in text
        assert not any(ch in text for ch in "\x1b\x07\r\x9b")

    asyncio.run(main())


def test_interrupted_and_evicted_tags():
    async def main():
        reply = AssistantMessage()
        app = Host(reply)
        async with app.run_test() as pilot:
            await pilot.pause()
            await reply.append("Once upon")
            await reply.finish("Once upon", "cancelled")
            reply.set_evicted(True)
            await pilot.pause()
            text = screen_text(app)
            assert "interrupted" in text and "outside the model's window" in text
            assert reply.has_class("evicted") and reply.has_class("interrupted")
            reply.set_evicted(False)
            assert not reply.has_class("evicted") and "outside the model's window" not in reply.tags

    asyncio.run(main())


def test_status_bar_and_layer_gauge_fit_their_width():
    async def main():
        bar, gauge = StatusBar(), LayerGauge()
        app = Host(bar, gauge)
        async with app.run_test(size=(80, 24)) as pilot:
            s = stats(tokens=1703, capacity=1792, bytes_held=2_200_000, bytes_allocated=2_300_000)
            bar.set_items(status_items("stories260K-4bit", "prealloc", s, s.cache))
            gauge.set_layers([1000, 2000, 500])
            await pilot.pause()
            assert bar.size.height == len(pack(bar.items, 80))
            text = screen_text(app)
            assert "cache 1,703/1,792 tok" in text and "L1 " in text and "2.0 KiB" in text
            assert gauge.size.height == 3

    asyncio.run(main())


def test_loading_screen_progress_and_failure():
    async def main():
        app = Host()
        async with app.run_test() as pilot:
            screen = LoadingScreen("org/[bold]model")
            await app.push_screen(screen)
            p = LoadProgress("download", "downloading model.safetensors: file 1 of 2", 42.0)
            screen.progress(p.phase, p.detail, p.percent)
            await pilot.pause()
            assert screen.query_one("ProgressBar").percentage == pytest.approx(0.42)
            assert "file 1 of 2" in screen_text(app) and "org/[bold]model" in screen_text(app)
            screen.fail("no such model [red]x[/] \x1b[31m")
            await pilot.pause()
            text = screen_text(app)
            assert screen.failed and "no such model [red]x[/] ␛[31m" in text and "press q to quit" in text

    asyncio.run(main())


def test_compare_chart():
    from chatapp.engine.events import CompareRow

    rows = [CompareRow("prealloc", 100, 120, 0.02, 1000.0, 200.0, 24, "x"),
            CompareRow("window", 100, 120, 0.01, 2000.0, 400.0, 24, "x"),
            CompareRow("quantized", 0, 0, 0.0, 0.0, 0.0, 0, "", error="head_dim too small")]
    chart = CompareScreen.chart(rows, 80).plain
    lines = chart.splitlines()
    assert "decode tok/s (longer is faster)" in lines[0]
    window_decode = next(line for line in lines[1:3] if line.startswith("window"))
    prealloc_decode = next(line for line in lines[1:3] if line.startswith("prealloc"))
    assert window_decode.count("█") == 2 * prealloc_decode.count("█")
    assert "quantized" not in chart


# ---- the app without a model: startup options, load failure, run_tui --------------------------
def test_unknown_theme_and_show_panel(tmp_path):
    from chatapp.config import load_config
    from chatapp.ui.app import ChatApp
    from chatapp.ui.widgets import SidePanel

    async def main():
        config = load_config(overrides={"model.id": str(tmp_path), "ui.theme": "no-such-theme",
                                        "ui.show_panel": True})
        app = ChatApp(config)
        async with app.run_test() as pilot:
            await pilot.pause()
            assert app.query_one(SidePanel).display
            assert any("no-such-theme" in n.message for n in app._notifications)
            assert app.theme != "no-such-theme"

    asyncio.run(main())


def test_run_tui_reports_a_load_failure_on_stderr(tmp_path, monkeypatch, capsys):
    from textual.app import App

    from chatapp.config import load_config
    from chatapp.ui import app as app_module

    async def auto_pilot(pilot):
        for _ in range(1500):
            if pilot.app.engine.load_error:
                break
            await pilot.pause(0.02)
        await pilot.press("q")

    def headless_run(self, **kwargs):
        return App.run(self, headless=True, auto_pilot=auto_pilot)

    monkeypatch.setattr(app_module.ChatApp, "run", headless_run)
    code = app_module.run_tui(load_config(overrides={"model.id": str(tmp_path)}), blas=None, verbose=True)
    err = capsys.readouterr().err
    assert code == 2
    assert f"chatapp: error: {tmp_path} is missing config.json" in err
    assert "Traceback" in err  # --verbose prints the details after the screen is gone


def test_policy_text_lists_each_policy_s_tallies_and_the_attention_share():
    empty = policy_text(CacheView(mode="prealloc")).plain
    assert "nothing evicted or quantised yet" in empty and "attn on evictable —" in empty
    view = CacheView(mode="scored-quant", evicted_by_policy={"scored-quant": 1536, "window": 64},
                     quantised_by_policy={"window-quant": 2048, "scored-quant": 960}, attention_sparsity=0.373)
    lines = policy_text(view).plain.splitlines()
    assert lines[0].split() == ["policy", "evicted", "quantised"]
    # in the modes' order, each with both tallies (0 where it did not act)
    assert [ln.split() for ln in lines[1:4]] == [["window", "64", "0"], ["window-quant", "0", "2,048"],
                                                 ["scored-quant", "1,536", "960"]]
    assert lines[4] == "attn on evictable 37% of the last turn's"
