"""`chatapp bench cpu --geometry llama2-7b` on a small geometry: the legacy-layout writer, the
Q4_0 GGUF writer, and the orchestrator with its peers in their own processes."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from chatapp.bench.flagship import Geometry, tensors, weight_file_bytes, write_llama2_7b
from chatapp.bench.gguf import q4_0_from_mlx
from tests.conftest import SHARED_MODELS

SMALL = Geometry(dim=256, n_layers=2, n_heads=2, n_kv_heads=2, head_dim=128, hidden_dim=512, vocab_size=32000)


@pytest.fixture(scope="module")
def llama2_tokenizer():
    path = SHARED_MODELS / "llama2-tokenizer" / "tokenizer.model"
    if not path.is_file():
        pytest.skip(f"needs Llama 2's tokenizer.model in {path.parent} (../shared is absent)")
    return path


def test_q4_0_bytes_hold_the_same_weights():
    t = dict(tensors(SMALL))
    packed, scales, biases = (t[f"layers.0.attention.wq.{s}"] for s in ("weight", "scales", "biases"))
    w = np.asarray(mx.dequantize(mx.array(packed), mx.array(scales).astype(mx.float32),
                                 mx.array(biases).astype(mx.float32), group_size=SMALL.group_size, bits=4))
    q = q4_0_from_mlx(packed, scales).reshape(packed.shape[0], -1, 18)  # Q4_0 blocks: fp16 d, 16 bytes
    d = q[:, :, :2].copy().view(np.float16).astype(np.float32)
    lo, hi = (q[:, :, 2:] & 15).astype(np.float32), (q[:, :, 2:] >> 4).astype(np.float32)
    back = (np.concatenate([lo, hi], axis=2) - 8) * d  # element j low nibble, j + 16 high
    np.testing.assert_allclose(back.reshape(w.shape), w, rtol=0, atol=1e-6)
    assert np.abs(w.mean()) < 0.05 * np.abs(w).mean()  # centred: q in 1..15, biases -8 s


def test_legacy_folder_loads_through_chatapp(tmp_path, llama2_tokenizer):
    from chatapp.model.loader import load_model

    folder = write_llama2_7b(tmp_path / "m", llama2_tokenizer, SMALL)
    lm = load_model(str(folder), cast_scales=False)
    assert lm.format == "legacy-npz" and lm.n_layers == 2 and weight_file_bytes(folder) > 0
    assert lm.model.model.layers[0].self_attn.q_proj["scales"].dtype == mx.float16
    mtime = (folder / "weights.npz").stat().st_mtime_ns
    write_llama2_7b(folder, llama2_tokenizer, SMALL)  # same geometry and seed: reused
    assert (folder / "weights.npz").stat().st_mtime_ns == mtime


def test_flagship_bench_runs_small(tmp_path, monkeypatch, capsys, llama2_tokenizer):
    from chatapp.bench import cpu_flagship, main

    monkeypatch.setattr(cpu_flagship, "GEOMETRY", SMALL)
    monkeypatch.setattr(cpu_flagship, "TOKENIZER", llama2_tokenizer)
    out = tmp_path / "flagship.json"
    rc = main(["cpu", "--geometry", "llama2-7b", "--model-dir", str(tmp_path / "m"), "--prompt", "24",
               "--short", "6", "--greedy", "4", "--decode-tokens", "3", "--contexts", "300",
               "--long-tokens", "2", "--peers", "chatapp,chatapp-unfused,mlx-lm,chatapp-gguf", "--load-rounds", "1",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "greedy tokens equal to mlx-lm's on the first 4" in text
    # each chatapp peer against its own bytes, over the bandwidth read before and after every run
    assert "physical limit, chatapp:" in text and "physical limit, chatapp-gguf:" in text
    assert "physical limit, mlx-lm" not in text
    data = json.loads(out.read_text())
    runs = sum(len(v) for v in data["meta"]["runs"].values())
    assert len(data["meta"]["bandwidth_readings"]) == 1 + runs
    rows = {r[0]: r for r in data["rows"]}
    same_mlx, same_unfused = data["columns"].index("greedy = mlx-lm"), data["columns"].index("greedy = chatapp-unfused")
    assert set(rows) == {"chatapp", "chatapp-unfused", "mlx-lm", "chatapp-gguf"}
    assert rows["chatapp"][same_mlx] == "yes" and rows["chatapp"][same_unfused] == "yes"
    assert rows["chatapp-unfused"][same_mlx] == "yes"
    long = {(r[0], r[1]) for r in data["meta"]["long"]["rows"]}
    assert long == {(f"{p} {m}", 300) for p in ("chatapp", "chatapp-unfused", "chatapp-gguf")
                    for m in ("prealloc", "window-quant")} | {("mlx-lm", 300)}
    # chatapp on the Q4_0 GGUF (group 32) runs the same numbers as the folder (group 64)
    assert rows["chatapp-gguf"][data["columns"].index("greedy = chatapp")] == "yes"
    assert all(r[3] > 0 for r in data["meta"]["long"]["rows"])
    # the fused peers' synthetic fills are held as a session holds its K/V, not as the fill's float32
    from chatapp.backend.fused_settings import resolve_kv_dtype

    for peer in ("chatapp", "chatapp-gguf"):
        assert {r["kv_dtype"] for run in data["meta"]["runs"][peer] for r in run["long"]} == {resolve_kv_dtype("auto")}
