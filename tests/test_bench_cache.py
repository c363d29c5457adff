"""Smoke test of `chatapp bench cache` at toy sizes: it runs, and writes its JSON and PNG.

Timings are not checked here (performance claims live in the bench, see BENCHMARKS.md).
"""

from __future__ import annotations

import json

from cache import MODES
from chatapp.bench import main


def test_bench_cache_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "cache.json", tmp_path / "cache.png"
    rc = main([
        "cache", "--sizes", "64,128", "--layers", "2", "--steps", "2", "--warmup", "1", "--repeats", "1",
        "--head-dim", "64", "--sinks", "4", "--window", "32", "--budget", "64", "--evict-chunk", "16",
        "--quant-start", "16", "--attn-sizes", "64,96", "--attn-window", "16",
        "--json", str(out_json), "--plot", str(out_png),
    ])
    assert rc == 0
    assert out_png.exists() and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out_json.read_text())
    assert data["columns"] == ["mode", "N=64", "N=128"]
    rows = {r[0]: r[1:] for r in data["rows"]}
    assert set(MODES) <= set(rows) and {"floor", "floor+views"} <= set(rows)
    assert all(isinstance(x, float) and x > 0 for r in rows.values() for x in r)

    attn = data["meta"]["attention"]
    assert [r[0] for r in attn["rows"]] == [64, 96]
    # the mixed cache really is mostly quantised, and both attention routes agree
    for T, quant, full, a, b, c, ratio, err in attn["rows"]:
        assert quant + full == T and quant > full
        assert a > 0 and b > 0 and c > 0 and err < 0.1

    targets = data["meta"]["targets"]
    assert {t["passed"] for t in targets} <= {True, False, None} and len(targets) == 6
    printed = capsys.readouterr().out
    assert "## targets" in printed and ("PASS" in printed or "FAIL" in printed)
