"""`chatapp bench cpu --model FILE.gguf` on a tiny GGUF written by the tests (peers in processes of their own)."""

from __future__ import annotations

import importlib.util
import json

from chatapp.model.gguf_writer import Q4_0
from tests.gguf_models import random_llama, write_model_gguf


def test_bench_cpu_model_runs_both_peers_on_one_file(tmp_path, capsys):
    from chatapp.bench import main

    path = tmp_path / "tiny.gguf"
    write_model_gguf(path, random_llama(seed=3), matrices=Q4_0)
    peers = "chatapp,llama.cpp" if importlib.util.find_spec("llama_cpp") else "chatapp"
    out = tmp_path / "gguf.json"
    rc = main(["cpu", "--model", str(path), "--cached", "0,40", "--prompt", "8", "--decode-tokens", "3",
               "--ttft-runs", "1", "--repeats", "1", "--threads", "1", "--peers", f"{peers},mlx-lm",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "skipped: mlx-lm" in text and "rendered the first turn differently" not in text
    data = json.loads(out.read_text())
    rows = {(r[0], r[1]): r[2] for r in data["rows"]}
    for peer in peers.split(","):
        assert rows[(peer, "prefill tok/s (8 after 40)")] > 0 and rows[(peer, "decode tok/s (after 48)")] > 0
        assert rows[(peer, "load s")] > 0 and rows[(peer, "peak RSS MiB")] > 1
        assert any(k[0] == peer and k[1].startswith("TTFT ms") for k in rows)
    run = data["meta"]["runs"]["chatapp"][0]
    assert "fused decode" in run["plan"] or "kernel" in run["plan"]
    assert [p["cached"] for p in run["points"]] == [0, 40]


def test_bench_cpu_model_refuses_a_missing_file(tmp_path):
    import pytest

    from chatapp.bench import main

    with pytest.raises(SystemExit, match="no file at"):
        main(["cpu", "--model", str(tmp_path / "absent.gguf")])
