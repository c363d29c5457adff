"""Smoke tests of the engine benchmarks (turns, decode, quality): tiny options, structure only.

No timing is asserted here: performance claims live in the benchmarks and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math

import pytest

TINY_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=64, intermediate_size=256, vocab_size=258, max_position_embeddings=4096)


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    mod = importlib.import_module(f"chatapp.bench.{name}_bench")
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--plot")
    mod.add_arguments(p)
    return p.parse_args(argv)


def outputs(tmp_path, name):
    return tmp_path / f"{name}.json", tmp_path / f"{name}.png"


def check_files(js, png) -> dict:
    data = json.loads(js.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["rows"] and all(len(r) == len(data["columns"]) for r in data["rows"])
    return data


def test_turns_bench_smoke(tmp_path, monkeypatch, capsys):
    from chatapp.bench import turns_bench

    monkeypatch.setattr(turns_bench, "RANDOM_SHAPE", TINY_SHAPE)
    js, png = outputs(tmp_path, "turns")
    args = parse("turns", ["--random", "--turns", "3", "--max-tokens", "3", "--repeats", "2", "--pause", "0.01",
                           "--json", str(js), "--plot", str(png)])
    assert turns_bench.run(args) == 0
    data = check_files(js, png)
    assert data["columns"] == ["turn", "prompt tokens", "reused", "TTFT reuse (ms)", "TTFT stateless (ms)", "ratio"]
    assert [r[0] for r in data["rows"]] == [1, 2, 3]
    prompts = [r[1] for r in data["rows"]]
    assert prompts == sorted(prompts) and prompts[0] > 0
    assert data["rows"][0][2] == 0  # nothing to reuse on the first turn
    assert all(r[2] > 0 for r in data["rows"][1:])  # later turns reuse the cache
    assert all(r[3] > 0 and r[4] > 0 for r in data["rows"])
    assert data["meta"]["same_prompt_tokens"] is True and data["meta"]["pause_s"] == 0.01
    # every turn reuses the previous reply as well, not just the previous prompt (the random model
    # writes ASCII, whose text encodes back to the generated ids)
    runs = data["meta"]["runs"][0]
    assert all(b["reused"] > a["prompt_tokens"] for a, b in zip(runs, runs[1:]))
    assert len(data["meta"]["runs"]) == 2
    assert isinstance(data["meta"]["target"]["passed"], bool)
    out = capsys.readouterr().out
    assert "PASS" in out or "FAIL" in out


def test_decode_bench_smoke(tmp_path, capsys):
    from chatapp.bench import decode_bench

    js, png = outputs(tmp_path, "decode")
    args = parse("decode", ["--models", "tiny", "--contexts", "32,64", "--tokens", "8", "--repeats", "1",
                            "--window", "32", "--max-kv-tokens", "48", "--evict-chunk", "16",
                            "--quant-start", "16", "--json", str(js), "--plot", str(png)])
    assert decode_bench.run(args) == 0
    data = check_files(js, png)
    assert data["columns"] == ["model", "context", "mode", "held", "tok/s", "mlx-lm tok/s", "ratio", "peak MiB",
                               "active B/tok", "cache B/tok"]
    assert len(data["rows"]) == 2 * (len(decode_bench.MODES) + 1)  # every mode, and mlx-lm, per context
    churn = {}
    for model, ctx, mode, held, tps, base, ratio, peak, active, cache in data["rows"]:
        assert model == "tiny" and ctx in (32, 64) and mode in (*decode_bench.MODES, decode_bench.MLX_LM)
        assert tps > 0 and base > 0 and ratio == pytest.approx(tps / base, rel=0.01)
        assert peak > 0
        churn[(ctx, mode)] = active + cache
        if mode in ("prealloc", "concat", "quantized"):
            assert held == ctx
    # concat allocates a new, larger K/V every token; prealloc writes in place
    assert churn[(64, "concat")] > 4 * max(churn[(64, "prealloc")], 1)
    # window keeps sinks + window = 36 tokens once the fill passed its budget plus a chunk
    held = {(r[1], r[2]): r[3] for r in data["rows"]}
    assert held[(64, "window")] == 36
    assert held[(64, "window-quant")] == 48
    targets = data["meta"]["targets"]
    assert any(t["target"].startswith("prealloc") for t in targets)
    [gauges] = [t for t in targets if t["target"].startswith("memory gauges")]  # the gauges' A/B ran
    assert set(gauges["ab"]) == {"32", "64"} and all(x > 0 for x in gauges["ab"].values()) and gauges["value"] > 0
    assert all(isinstance(t["passed"], bool) for t in targets)
    assert data["meta"]["gauge_read_us"] > 0


def test_decode_bench_skips_what_the_model_cannot_run(tmp_path):
    from cache import CacheConfigError, check_settings, model_geometry
    from chatapp.bench import decode_bench

    m = decode_bench.load_peer_model("tiny")
    args = parse("decode", ["--kv-group-size", "128"])
    with pytest.raises(CacheConfigError):
        check_settings(decode_bench.settings_for(args, "quantized"), model_geometry(m["model"]))


def test_quality_bench_smoke(tmp_path, monkeypatch):
    from chatapp.bench import quality_bench

    monkeypatch.setattr(quality_bench, "RANDOM_SHAPE", TINY_SHAPE)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. " * 4)
    js, png = outputs(tmp_path, "quality")
    args = parse("quality", ["--random", "--text", str(text), "--max-tokens", "120", "--split", "64",
                             "--prefill", "8", "--window", "32", "--evict-chunk", "16", "--max-kv-tokens", "64",
                             "--quant-start", "32", "--cache-mode", "window,prealloc,quantized",
                             "--budgets", "40", "--json", str(js), "--plot", str(png)])
    assert quality_bench.run(args) == 0
    data = check_files(js, png)
    assert data["columns"][:6] == ["mode", "tokens", "held at end", "KV bytes held", "ppl all", "ppl after 64"]
    rows = {r[0]: r for r in data["rows"]}
    assert list(rows) == ["prealloc", "window", "quantized", "window@40", "scored@40"]  # prealloc first
    assert rows["prealloc"][1] == 120 and rows["prealloc"][2] == 119
    assert rows["window"][2] < 119  # evicted
    assert rows["scored@40"][2] < 119 and rows["scored@40"][3] < rows["prealloc"][3]
    # equal budgets hold equal bytes (both full precision; held counts may differ by < one chunk)
    per_tok = rows["prealloc"][3] / rows["prealloc"][2]
    assert rows["scored@40"][3] == rows["scored@40"][2] * per_tok
    assert float(rows["prealloc"][6]) == 1.0 and float(rows["prealloc"][7]) == 0
    assert float(rows["window"][7]) >= 0
    for r in data["rows"]:
        assert r[4] > 1 and r[5] > 1 and not math.isnan(r[4])


def test_quality_bench_skips_quantised_kv_on_head_dim_8(tmp_path, stories4_path):
    from chatapp.bench import quality_bench

    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little girl named Lily. She loved to play.")
    js, png = outputs(tmp_path, "q8")
    args = parse("quality", ["--model", str(stories4_path), "--text", str(text), "--cache-mode", "prealloc,quantized",
                             "--json", str(js), "--plot", str(png)])
    assert quality_bench.run(args) == 0
    data = check_files(js, png)
    assert [r[0] for r in data["rows"]] == ["prealloc"]
    assert "head_dim (8)" in data["meta"]["skipped quantized"]


def test_prefix_bench_smoke(tmp_path, monkeypatch):
    from chatapp.bench import prefix_bench

    monkeypatch.setattr(prefix_bench, "RANDOM_SHAPE", TINY_SHAPE)
    js, png = outputs(tmp_path, "prefix")
    args = parse("prefix", ["--models", "random", "--random-tokenizer", "bytes", "--system-tokens", "300",
                            "--repeats", "2", "--max-tokens", "4",
                            "--json", str(js), "--plot", str(png)])
    assert prefix_bench.run(args) == 0
    data = check_files(js, png)
    assert data["columns"][:4] == ["model", "system tokens", "prompt tokens", "from store"]
    [row] = data["rows"]
    assert row[0] == "random" and row[1] == 300 and row[2] > 300
    # the warm run took the system prompt, and the first message's shared tokens, from the store
    assert 300 <= row[3] < row[2] and row[4] > 0
    assert row[5] > 0 and row[6] > 0 and row[-1] == "yes"
    run = data["meta"]["runs"][0]
    assert all(w["prefilled"] == w["prompt"] - w["prefix"] for w in run["warm"])
    assert all(c["prefix"] == 0 and c["prefilled"] == c["prompt"] for c in run["cold"])
    assert data["meta"]["targets"] == []  # no length reached the 2,000-token target here

def test_recall_bench_smoke(tmp_path, monkeypatch):
    """Plumbing only (a random model's answers mean nothing): rows, equal KV bytes per budget."""
    from chatapp.bench import quality_bench, recall_bench

    monkeypatch.setattr(quality_bench, "RANDOM_SHAPE", TINY_SHAPE)
    js = tmp_path / "recall.json"
    args = parse("recall", ["--random", "--conversations", "2", "--filler-turns", "2", "--filler-words", "30",
                            "--budgets", "64", "--evict-chunk", "16", "--max-new", "2", "--json", str(js)])
    assert recall_bench.run(args) == 0
    data = json.loads(js.read_text())
    rows = {r[0]: r for r in data["rows"]}
    assert list(rows) == ["prealloc", "window@64", "scored@64"]
    assert all(r[1] == 2 and 0 <= r[3] <= 1 for r in rows.values())
    assert rows["window@64"][5] < rows["prealloc"][5]  # the budget really bounded the cache


def test_quality_and_recall_benches_compare_quantised_rows_at_equal_bytes(tmp_path, monkeypatch):
    """--budget-quant: window-quant@B and scored-quant@B hold more tokens than window@B in no more
    bytes (at their most, between steps) than window@B holds at its most."""
    from chatapp.bench import quality_bench, recall_bench

    monkeypatch.setattr(quality_bench, "RANDOM_SHAPE", TINY_SHAPE)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat who liked the sun. " * 6)
    js = tmp_path / "quality.json"
    args = parse("quality", ["--random", "--text", str(text), "--max-tokens", "200", "--split", "64", "--chunked",
                             "--window", "32", "--evict-chunk", "16", "--cache-mode", "prealloc",
                             "--budgets", "48", "--budget-quant", "--json", str(js)])
    assert quality_bench.run(args) == 0
    data = json.loads(js.read_text())
    cols = data["columns"]
    rows = {r[0]: dict(zip(cols, r)) for r in data["rows"]}
    assert list(rows) == ["prealloc", "window@48", "scored@48", "window-quant@48", "scored-quant@48"]
    for q in ("window-quant@48", "scored-quant@48"):
        assert rows[q]["held at end"] > rows["window@48"]["held at end"]
        assert rows[q]["most KV bytes held"] <= rows["window@48"]["most KV bytes held"]
    js2 = tmp_path / "recall.json"
    args = parse("recall", ["--random", "--conversations", "1", "--filler-turns", "2", "--filler-words", "30",
                            "--budgets", "48", "--evict-chunk", "16", "--max-new", "1", "--budget-quant",
                            "--cache-mode", "window@48,scored-quant@48", "--json", str(js2)])
    assert recall_bench.run(args) == 0
    assert [r[0] for r in json.loads(js2.read_text())["rows"]] == ["window@48", "scored-quant@48"]


@pytest.mark.shared
def test_start_bench_smoke(tmp_path, stories4_path):
    """chatapp bench start on stories260K-4bit (no fused route, so nothing long to compile): every
    variant runs the app in a process of its own and lands in the table; a missing model is one line."""
    from chatapp.bench import start_bench

    js = tmp_path / "start.json"
    args = parse("start", ["--model", str(stories4_path), "--repeats", "1", "--no-llama-cpp", "--json", str(js)])
    assert start_bench.run(args) == 0
    data = json.loads(js.read_text())
    assert [r[0] for r in data["rows"]] == list(start_bench.VARIANTS)
    assert all(r[1] > 0 for r in data["rows"]) and all(len(t) == 1 for t in data["meta"]["times"].values())
    with pytest.raises(SystemExit, match="no model at"):
        start_bench.run(parse("start", ["--model", str(tmp_path / "missing.gguf")]))


def test_quality_bench_scores_each_row_through_both_routes(tmp_path, monkeypatch):
    """--routes mlx,fused: every row twice, MLX's own route first, then a fresh model on the app's
    fast path; the fused rows carry their perplexity over the MLX row's, which must be ~1."""
    from chatapp.bench import quality_bench
    from tests.fused_llama import clear_kernels

    monkeypatch.setattr(quality_bench, "RANDOM_SHAPE", TINY_SHAPE)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. " * 4)
    js = tmp_path / "routes.json"
    args = parse("quality", ["--random", "--text", str(text), "--max-tokens", "100", "--split", "64",
                             "--window", "32", "--evict-chunk", "16", "--max-kv-tokens", "64", "--quant-start", "32",
                             "--cache-mode", "prealloc,window-quant", "--routes", "fused,mlx", "--json", str(js)])
    assert args.routes == ["mlx", "fused"]
    try:
        assert quality_bench.run(args) == 0
    finally:
        clear_kernels()  # the fast path installs attention kernels process-wide
    data = json.loads(js.read_text())
    assert data["columns"][-1] == "fused / MLX route"
    rows = {r[0]: r for r in data["rows"]}
    assert list(rows) == ["prealloc", "window-quant", "prealloc fused", "window-quant fused"]
    assert rows["prealloc"][-1] == "n/a"
    for mode in ("prealloc", "window-quant"):
        assert abs(float(rows[f"{mode} fused"][-1]) - 1) < 0.01
    with pytest.raises(SystemExit):
        parse("quality", ["--routes", "gpu"])


def test_quality_bench_chunked_fused_route_scores_through_the_fused_prefill(tmp_path, monkeypatch):
    """--chunked on the fused route: every chunk through FusedDecoder.prefill with each position's
    logits (the evicting mode's chunks read a quantised middle), within 1% of MLX's route."""
    from chatapp.backend.fused_decode import FusedDecoder
    from chatapp.bench import quality_bench
    from tests.fused_llama import clear_kernels

    monkeypatch.setattr(quality_bench, "RANDOM_SHAPE", TINY_SHAPE)
    calls = []
    real = FusedDecoder.prefill

    def counted(self, tokens, caches, every_position=False):
        calls.append((int(tokens.shape[0]), every_position))
        return real(self, tokens, caches, every_position)

    monkeypatch.setattr(FusedDecoder, "prefill", counted)
    text = tmp_path / "text.txt"
    text.write_text("Once upon a time there was a little cat. " * 4)
    js = tmp_path / "chunked.json"
    args = parse("quality", ["--random", "--text", str(text), "--max-tokens", "160", "--split", "64", "--chunked",
                             "--window", "32", "--evict-chunk", "16", "--max-kv-tokens", "80", "--quant-start", "32",
                             "--cache-mode", "prealloc,window-quant", "--routes", "mlx,fused", "--json", str(js)])
    try:
        assert quality_bench.run(args) == 0
    finally:
        clear_kernels()
    data = json.loads(js.read_text())
    rows = {r[0]: r for r in data["rows"]}
    for mode in ("prealloc", "window-quant"):
        assert abs(float(rows[f"{mode} fused"][-1]) - 1) < 0.01
    # prealloc: one chunk of the 159 scored tokens; window-quant: 16-token chunks, 10 of them (the
    # install's warm-up prefills its own chunks, last positions only)
    assert [c for c in calls if c[1]] == [(159, True)] + [(16, True)] * 9 + [(15, True)]
    assert "through the fused prefill 10" in data["meta"]["settings window-quant fused"]
    assert "through the fused prefill 0" in data["meta"]["settings window-quant"]
