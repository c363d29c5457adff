"""The CPU backend: BLAS preloading (search, verification, the real global load) and the dense
fast path (dispatch, routing, memory budget, logits and greedy tokens unchanged)."""

from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_map

from chatapp.backend import blas, cpu, qlinear
from chatapp.backend.blas import BlasInfo, preload_blas, verify_blas
from chatapp.backend.cpu import CpuQuantizedEmbedding, CpuQuantizedLinear, accelerate_model
from chatapp.model.synthetic import LlamaShape, build_random_llama
from tests.conftest import REPO, SHARED_MODELS

SHARED_4BIT = str(SHARED_MODELS / "stories260K-4bit")
SITE = Path(mx.__file__).resolve().parent.parent  # .../site-packages (mx.__file__ is mlx/core.*.so)


def _one(pattern: str) -> str | None:
    hits = sorted(glob.glob(str(SITE / pattern)))
    return hits[0] if hits else None


# Real libraries that any Linux install of chatapp has: MLX's bundled reference BLAS (exports the
# standard cblas_sgemm) and numpy's OpenBLAS (exports only prefixed scipy_cblas_* symbols).
MLX_REF_BLAS = _one("mlx_cpu.libs/libblas*.so*")
NUMPY_OPENBLAS = _one("numpy.libs/libscipy_openblas*.so")
needs_ref = pytest.mark.skipif(MLX_REF_BLAS is None, reason="mlx-cpu's bundled libblas not found (not Linux?)")
needs_numpy_blas = pytest.mark.skipif(NUMPY_OPENBLAS is None, reason="this numpy wheel bundles no scipy_openblas")


def _find_openblas() -> str | None:
    for _, path in blas.candidate_paths():
        if (not os.path.isabs(path) or os.path.exists(path)) and verify_blas(path)[0]:
            return path
    return None


def _run_py(code: str) -> dict:
    """Run code in a fresh interpreter (nothing imported yet) and return the JSON it prints last."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def fresh_blas(monkeypatch):
    """preload_blas as if mlx.core were not imported yet, without touching the process's symbols:
    global loads become private ones and the global lookup reports what was "loaded"."""
    loaded: list[str] = []
    real_dlopen = blas._dlopen

    def dlopen(path, mode):
        if mode == os.RTLD_GLOBAL:
            loaded.append(path)
            mode = os.RTLD_LOCAL
        return real_dlopen(path, mode)

    monkeypatch.setattr(blas, "_current", None)
    monkeypatch.setattr(blas, "_mlx_imported", lambda: False)
    monkeypatch.setattr(blas, "_dlopen", dlopen)
    monkeypatch.setattr(blas, "active_blas", lambda: loaded[-1] if loaded else None)
    return loaded


# ---- BLAS: settings and guards ------------------------------------------------------------------
def test_blas_module_imports_no_mlx():
    got = _run_py("import sys, json, chatapp.backend.blas; print(json.dumps('mlx.core' in sys.modules))")
    assert got is False


def test_off_loads_nothing(monkeypatch):
    monkeypatch.setattr(blas, "_current", None)
    info = preload_blas("off")
    assert (info.loaded, info.path) == (False, None) and "'off'" in info.reason


def test_too_late_after_mlx_import(monkeypatch):
    monkeypatch.setattr(blas, "_current", None)
    assert "mlx.core" in sys.modules
    info = preload_blas("auto")
    assert not info.loaded and info.reason.startswith("too late")


def test_not_linux(monkeypatch):
    monkeypatch.setattr(blas, "_current", None)
    monkeypatch.setattr(sys, "platform", "darwin")
    info = preload_blas("auto")
    assert not info.loaded and "darwin" in info.reason


def test_verify_missing_file(tmp_path):
    ok, why = verify_blas(str(tmp_path / "libnothing.so"))
    assert not ok and "cannot be loaded" in why


@needs_numpy_blas
def test_verify_rejects_prefixed_openblas():
    ok, why = verify_blas(NUMPY_OPENBLAS)
    assert not ok and "scipy_cblas_sgemm" in why and "prefixed" in why


@needs_ref
def test_verify_accepts_unprefixed_cblas():
    assert verify_blas(MLX_REF_BLAS) == (True, "exports cblas_sgemm")


# ---- BLAS: the "auto" search and explicit paths -------------------------------------------------
@needs_ref
@needs_numpy_blas
def test_auto_skips_missing_and_prefixed_then_loads(fresh_blas, monkeypatch, tmp_path):
    monkeypatch.setattr(blas, "candidate_paths", lambda: [
        ("absent", str(tmp_path / "nope" / "libopenblas.so.0")),
        ("prefixed", NUMPY_OPENBLAS),
        ("good", MLX_REF_BLAS),
    ])
    info = preload_blas("auto")
    assert info.loaded and info.path == MLX_REF_BLAS and fresh_blas == [MLX_REF_BLAS]
    assert "good" in info.reason
    assert len(info.tried) == 1 and "scipy_cblas_sgemm" in info.tried[0]
    assert blas.current_blas() is info
    assert preload_blas("auto") is info  # a second call keeps the first result


@needs_numpy_blas
def test_auto_nothing_usable_says_how_to_get_one(fresh_blas, monkeypatch, tmp_path):
    monkeypatch.setattr(blas, "candidate_paths", lambda: [("prefixed", NUMPY_OPENBLAS),
                                                          ("absent", str(tmp_path / "x.so"))])
    info = preload_blas("auto")
    assert not info.loaded and fresh_blas == []
    assert "apt-get install libopenblas0-pthread" in info.reason and "scipy_cblas_sgemm" in info.reason


def test_auto_none_present(fresh_blas, monkeypatch):
    monkeypatch.setattr(blas, "candidate_paths", lambda: [])
    info = preload_blas("auto")
    assert not info.loaded and "none of the usual paths exist" in info.reason and "apt-get" in info.reason


@needs_ref
def test_explicit_path(fresh_blas):
    info = preload_blas(MLX_REF_BLAS)
    assert info.loaded and info.path == MLX_REF_BLAS and "blas setting" in info.reason


@needs_numpy_blas
def test_explicit_path_rejected(fresh_blas, tmp_path):
    assert "does not exist" in preload_blas(str(tmp_path / "libx.so")).reason
    info = preload_blas(NUMPY_OPENBLAS)
    assert not info.loaded and "prefixed" in info.reason and fresh_blas == []


@needs_ref
def test_global_symbol_owned_by_another_library(fresh_blas, monkeypatch):
    monkeypatch.setattr(blas, "active_blas", lambda: "/elsewhere/libpreloaded.so")
    info = preload_blas(MLX_REF_BLAS)
    assert info.path == "/elsewhere/libpreloaded.so" and "was not used" in info.reason


def test_candidates_cover_debian_and_pypi(monkeypatch, tmp_path):
    # a cmeel-openblas layout and an ngsolve-openblas package on sys.path
    (tmp_path / "cmeel.prefix" / "lib").mkdir(parents=True)
    (tmp_path / "cmeel.prefix" / "lib" / "libopenblas.so.0").write_bytes(b"")
    (tmp_path / "ngsolve_openblas").mkdir()
    (tmp_path / "ngsolve_openblas" / "__init__.py").write_text("")
    (tmp_path / "ngsolve_openblas" / "libopenblasp-r0.3.33.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    paths = [p for _, p in blas.candidate_paths()]
    assert any(p.endswith("/openblas-pthread/libopenblas.so.0") for p in paths)
    assert str(tmp_path / "cmeel.prefix" / "lib" / "libopenblas.so.0") in paths
    assert str(tmp_path / "ngsolve_openblas" / "libopenblasp-r0.3.33.so") in paths
    assert len(paths) == len(set(paths))


# ---- BLAS: the real global load, in fresh interpreters ------------------------------------------
MATMUL_CHECK = """
import json, sys
from chatapp.backend.blas import preload_blas, active_blas
info = preload_blas({setting!r})
import mlx.core as mx, numpy as np
a = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((96, 80)).astype(np.float32)
err = float(np.abs(np.array(mx.array(a) @ mx.array(b)) - a.astype(np.float64) @ b).max())
again = preload_blas({setting!r})
print(json.dumps(dict(loaded=info.loaded, name=info.name, path=info.path, active=active_blas(), err=err,
                      threads=info.threads, same=again is info)))
"""


@needs_ref
def test_real_preload_of_a_path_binds_mlx():
    got = _run_py(MATMUL_CHECK.format(setting=MLX_REF_BLAS))
    assert got["loaded"] and os.path.realpath(got["active"]) == os.path.realpath(MLX_REF_BLAS)
    assert got["err"] < 1e-3 and got["same"]


def test_real_openblas_auto():
    path = _find_openblas()
    if path is None:
        pytest.skip("no optimised BLAS installed (apt-get install libopenblas0-pthread): auto search not exercised")
    got = _run_py(MATMUL_CHECK.format(setting="auto"))
    assert got["loaded"] and got["name"].startswith("OpenBLAS") and got["threads"] >= 1
    assert got["active"] and os.path.realpath(got["active"]) == os.path.realpath(got["path"])
    assert got["err"] < 1e-3


def test_blasinfo_summary():
    assert "OpenBLAS" in BlasInfo("OpenBLAS 0.3.21", "/x.so", True, "ok", threads=2).summary()
    assert "reference" in BlasInfo("none", None, False, "why").summary()


# ---- the dense fast path --------------------------------------------------------------------------
SHAPE = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=512, vocab_size=512)


def random_model(tied: bool = False, seed: int = 0, dtype=mx.float32):
    shape = LlamaShape(**{**SHAPE.__dict__, "tie_word_embeddings": tied})
    model, _ = build_random_llama(shape, seed=seed, quantize_bits=4)
    if tied:  # mlx-lm then calls embed_tokens.as_linear for the output head
        nn.quantize(model, group_size=64, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Embedding))
    if dtype != mx.float32:
        model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                              model.parameters()))
    mx.eval(model.parameters())
    return model


def ids(n: int, seed: int = 3) -> mx.array:
    return mx.random.randint(0, SHAPE.vocab_size, (1, n), key=mx.random.key(seed))


def close(a: mx.array, b: mx.array) -> bool:
    scale = float(mx.abs(b).max())
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) <= 1e-3 * scale + 1e-5


def greedy(model, prompt: mx.array, n: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    out = []
    for _ in range(n):
        y = mx.argmax(logits[:, -1, :], axis=-1)
        out.append(int(y.item()))
        logits = model(y[None], cache=cache)
    return out


@pytest.mark.parametrize("backend", ["metal", "cuda", "METAL", ""])
def test_other_backends_untouched(backend):
    model = random_model()
    before = dict(model.named_modules())
    params = dict(tree_flatten(model.parameters()))
    plan = accelerate_model(model, backend=backend, dense_weights="on")
    assert not plan.applied and plan.layers == [] and plan.dense_bytes == 0 and "cpu" in plan.reason
    after = dict(model.named_modules())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert not any(isinstance(m, (CpuQuantizedLinear, CpuQuantizedEmbedding)) for m in after.values())
    assert all(params[k] is v for k, v in tree_flatten(model.parameters()))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dense_weights", ["off", "on"])
def test_logits_and_greedy_unchanged(tied, dense_weights):
    ref_model, model = random_model(tied), random_model(tied)
    plan = accelerate_model(model, backend="cpu", dense_weights=dense_weights)
    assert plan.applied and len(plan.layers) == 2 * 7 + (0 if tied else 1)
    assert plan.embeddings == (["model.embed_tokens"] if tied else [])
    if tied:
        assert isinstance(model.model.embed_tokens, CpuQuantizedEmbedding)
    for n in (1, 40):
        x = ids(n)
        assert close(model(x), ref_model(x)), n
    assert greedy(model, ids(40), 16) == greedy(ref_model, ids(40), 16)


def test_parameters_unchanged_and_frozen():
    model = random_model(tied=True)
    before = dict(tree_flatten(model.parameters()))
    accelerate_model(model, backend="cpu", dense_weights="on")
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert not any("weight" in k or "scales" in k for k, _ in tree_flatten(model.trainable_parameters())
                   if "proj" in k)


def test_threshold_routes_and_kept_weights(monkeypatch):
    calls = []
    real = qlinear._dense_matmul
    monkeypatch.setattr(qlinear, "_dense_matmul", lambda x, w, d: calls.append(x.shape) or real(x, w, d))
    layer = nn.QuantizedLinear(128, 96, bias=True)
    layer.bias = mx.random.normal((96,))
    fast = CpuQuantizedLinear(layer, threshold=16)
    for shape, dense in [((1, 16, 128), False), ((1, 17, 128), True), ((4, 5, 128), True), ((2, 8, 128), False)]:
        x = mx.random.normal(shape)
        calls.clear()
        assert close(fast(x), layer(x)) and bool(calls) == dense, shape
        assert fast(x).shape == shape[:-1] + (96,)
    fast.keep_dense()
    assert fast.has_dense and fast.dense_nbytes == 96 * 128 * 4
    # kept copy: one token goes through numpy's sgemv, reading the same memory; 2+ tokens dense in MLX
    monkeypatch.setattr(qlinear, "NUMPY_MIN_ELEMENTS", 96 * 128)
    fast.keep_dense()
    matvecs = []
    real_mv = qlinear._numpy_matvec
    monkeypatch.setattr(qlinear, "_numpy_matvec", lambda x, w, d: matvecs.append(x.shape) or real_mv(x, w, d))
    assert fast.routing.dense_np is not None and not fast.routing.dense_np.flags.owndata
    calls.clear()
    x = mx.random.normal((1, 1, 128))
    assert close(fast(x), layer(x)) and not calls and matvecs == [(1, 1, 128)]
    x = mx.random.normal((1, 2, 128))
    assert close(fast(x), layer(x)) and calls == [(1, 2, 128)] and len(matvecs) == 1
    off = CpuQuantizedLinear(layer, threshold=16, numpy_matvec=False)
    off.keep_dense()
    calls.clear()
    x = mx.random.normal((1, 1, 128))
    assert close(off(x), layer(x)) and calls and off.routing.dense_np is None
    monkeypatch.setattr(qlinear, "NUMPY_MIN_ELEMENTS", 96 * 128 + 1)  # too small to repay the sync
    small = CpuQuantizedLinear(layer, threshold=16)
    small.keep_dense()
    assert small.has_dense and small.routing.dense_np is None
    fast.drop_dense()
    assert not fast.has_dense


def test_layers_inside_dicts_and_lists():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = {"a": nn.QuantizedLinear(64, 64), "b": [nn.QuantizedLinear(64, 64, bias=False)]}
            self.head = nn.QuantizedLinear(64, 8)

        def __call__(self, x):
            return self.head(self.blocks["b"][0](self.blocks["a"](x)))

    net = Net()
    x = mx.random.normal((2, 20, 64))
    ref = net(x)
    plan = accelerate_model(net, backend="cpu", dense_weights="off")
    assert plan.layers == ["blocks.a", "blocks.b.0", "head"]
    assert isinstance(net.blocks["b"][0], CpuQuantizedLinear) and isinstance(net.head, CpuQuantizedLinear)
    assert close(net(x), ref)


def test_half_precision_activations_keep_their_dtype():
    ref_model, model = random_model(tied=True, dtype=mx.bfloat16), random_model(tied=True, dtype=mx.bfloat16)
    plan = accelerate_model(model, backend="cpu", dense_weights="on")
    assert any("bfloat16" in w for w in plan.warnings)
    for n in (1, 40):
        got, ref = model(ids(n)), ref_model(ids(n))
        assert got.dtype == ref.dtype and float(mx.abs(got - ref).max()) <= 0.05 * float(mx.abs(ref).max())
    # the embedding lookup keeps its dtype too
    emb = model.model.embed_tokens
    assert emb(mx.array([1, 2])).dtype == ref_model.model.embed_tokens(mx.array([1, 2])).dtype


def test_dense_weights_budget(monkeypatch):
    monkeypatch.setattr(blas, "current_blas", lambda: BlasInfo("OpenBLAS", "/x.so", True, "test"))
    model = random_model()
    per_q = 256 * 256 * 4
    plan = accelerate_model(model, backend="cpu", dense_weights="auto", dense_budget_bytes=3 * per_q,
                            fused_decode=False)  # fused, every layer would take the kernel instead
    assert plan.budget_bytes == 3 * per_q and 0 < plan.dense_bytes <= 3 * per_q
    assert 0 < len(plan.dense_layers) < len(plan.layers)
    over = [r for r in plan.routes if r.route == "mlx"]
    assert over and all("over budget" in r.why for r in over)  # the rest stay on MLX, and say why
    assert plan.dense_bytes_wanted > plan.budget_bytes
    kept = {n for n, m in model.named_modules() if isinstance(m, CpuQuantizedLinear) and m.has_dense}
    assert kept == set(plan.dense_layers)

    model = random_model()
    plan = accelerate_model(model, backend="cpu", dense_weights="auto", fused_decode=False)  # a quarter of RAM
    assert plan.budget_bytes == cpu.physical_memory_bytes() // 4
    assert plan.dense_bytes == plan.dense_bytes_wanted and len(plan.dense_layers) == len(plan.layers)
    assert plan.blas_loaded and not plan.warnings

    plan = accelerate_model(random_model(), backend="cpu", dense_weights="on", dense_budget_bytes=0)
    assert plan.dense_bytes == plan.dense_bytes_wanted  # "on" ignores the budget
    plan = accelerate_model(random_model(), backend="cpu", dense_weights="off")
    assert plan.dense_bytes == 0 and plan.dense_layers == []


def test_auto_keeps_no_copies_without_blas(monkeypatch):
    monkeypatch.setattr(blas, "current_blas", lambda: BlasInfo("none", None, False, "not loaded"))
    model = random_model()
    plan = accelerate_model(model, backend="cpu", dense_weights="auto")
    assert plan.applied and plan.dense_bytes == 0
    assert not plan.warnings  # small layers on MLX: nothing worth a warning
    assert "MLX's BLAS: bundled reference" in plan.summary()
    monkeypatch.setattr(cpu, "NUMPY_MIN_ELEMENTS", 1)  # now every MLX-routed layer counts as large
    plan = accelerate_model(random_model(), backend="cpu", dense_weights="auto", kernels="off")
    assert any("15 large quantised layers run on MLX" in w and "cpu.kernels = off" in w for w in plan.warnings)


def test_twice_and_bad_arguments():
    ref_model, model = random_model(), random_model()
    accelerate_model(model, backend="cpu", dense_weights="on")
    plan = accelerate_model(model, backend="cpu", dense_weights="off")
    assert len(plan.layers) == 15 and plan.dense_bytes == 0
    assert not model.model.layers[0].mlp.up_proj.has_dense
    assert close(model(ids(20)), ref_model(ids(20)))
    with pytest.raises(ValueError):
        accelerate_model(model, backend="cpu", dense_weights="maybe")
    with pytest.raises(ValueError):
        accelerate_model(model, backend="cpu", dense_prefill_threshold=-1)
    plain = nn.Sequential(nn.Linear(8, 8))
    assert not accelerate_model(plain, backend="cpu").applied


def test_stories260k_greedy_unchanged(stories4_path):
    from mlx_lm import load

    ref_model, tok = load(str(stories4_path))
    model, _ = load(str(stories4_path))
    plan = accelerate_model(model, backend="cpu", dense_prefill_threshold=4, dense_weights="off")
    assert plan.embeddings == ["model.embed_tokens"]  # the tied head: embed_tokens.as_linear
    assert all("down_proj" not in n for n in plan.layers)  # stays float32 in this checkpoint
    prompt = mx.array(tok.encode("Once upon a time,"))[None]
    assert prompt.shape[1] > 4  # the prompt takes the dense route, decode takes qmm
    ref = greedy(ref_model, prompt, 40)
    assert greedy(model, prompt, 40) == ref
    accelerate_model(model, backend="cpu", dense_weights="on")
    assert greedy(model, prompt, 40) == ref
    assert tok.decode(ref).strip().startswith("there was a little girl")


UNDER_OPENBLAS = """
import json
from chatapp.backend.blas import preload_blas
info = preload_blas("auto")
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from chatapp.backend.cpu import accelerate_model
from chatapp.model.synthetic import LlamaShape, build_random_llama

def greedy(model, prompt, n):
    cache = make_prompt_cache(model)
    logits, out = model(prompt, cache=cache), []
    for _ in range(n):
        y = mx.argmax(logits[:, -1, :], axis=-1)
        out.append(int(y.item()))
        logits = model(y[None], cache=cache)
    return out

shape = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=512, vocab_size=512)
ref, _ = build_random_llama(shape, quantize_bits=4)
fast, _ = build_random_llama(shape, quantize_bits=4)
plan = accelerate_model(fast, backend="cpu")
errs = dict()
for n in (1, 40):
    x = mx.random.randint(0, 512, (1, n), key=mx.random.key(n))
    a, b = fast(x), ref(x)
    errs[n] = float(mx.abs(a - b).max()) / float(mx.abs(b).max())
x = mx.random.randint(0, 512, (1, 40), key=mx.random.key(7))
same = greedy(fast, x, 16) == greedy(ref, x, 16)
stories = None
if {stories!r}:
    ref, tok = load({stories!r})
    fast, _ = load({stories!r})
    accelerate_model(fast, backend="cpu", dense_prefill_threshold=4, dense_weights="off")
    p = mx.array(tok.encode("Once upon a time,"))[None]
    r = greedy(ref, p, 40)
    stories = greedy(fast, p, 40) == r
    accelerate_model(fast, backend="cpu", dense_weights="on")
    stories = stories and greedy(fast, p, 40) == r
print(json.dumps(dict(loaded=info.loaded, kept=len(plan.dense_layers), errs=errs, same=same, stories=stories)))
"""


def test_outputs_unchanged_under_openblas():
    """The tests above run on the reference BLAS (this process imported mlx first); this one runs
    the same checks in a fresh interpreter with OpenBLAS bound, where float sums differ slightly."""
    if _find_openblas() is None:
        pytest.skip("no optimised BLAS installed (apt-get install libopenblas0-pthread): OpenBLAS numerics not checked")
    stories = SHARED_4BIT if (Path(SHARED_4BIT) / "config.json").exists() else ""
    got = _run_py(UNDER_OPENBLAS.format(stories=stories))
    assert got["loaded"] and got["kept"] == 15  # auto keeps float32 copies when BLAS is loaded
    assert all(e < 1e-3 for e in got["errs"].values()), got["errs"]
    assert got["same"]
    if stories:
        assert got["stories"] is True


# ---- the bench --------------------------------------------------------------------------------------
def test_cpu_bench_runs_small(monkeypatch, tmp_path, capsys):
    from chatapp.bench import cpu_bench, main

    monkeypatch.setattr(cpu_bench, "SHAPE", dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2,
                                                  num_key_value_heads=2, head_dim=64, intermediate_size=256,
                                                  vocab_size=512))
    out_json, out_png = tmp_path / "cpu.json", tmp_path / "cpu.png"
    rc = main(["cpu", "--prompts", "5,24", "--decode-tokens", "4", "--layer-dim", "128",
               "--json", str(out_json), "--plot", str(out_png)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "# BLAS:" in text and "greedy equal" in text and "dequantize + dense matmul" in text
    data = json.loads(out_json.read_text())
    assert [r[0] for r in data["rows"]] == [5, 24] and all(r[-1] == "yes" for r in data["rows"])
    assert all(r[1] > 0 and r[2] > 0 and r[4] > 0 and r[5] > 0 for r in data["rows"])
    assert len(data["meta"]["layers"]["rows"]) == 11 and out_png.stat().st_size > 0
    assert "4-bit packed kernel (chatapp: decode)" in text


def test_bench_generators_agree():
    from chatapp.bench.cpu_bench import chatapp_generate, mlx_lm_generate

    model = random_model()
    prompt = ids(30).tolist()[0]
    ref, pf, dc = mlx_lm_generate(model, prompt, 6)
    got, pf2, dc2 = chatapp_generate(model, prompt, 6, prefill_step=8)
    assert got == ref and len(got) == 6 and min(pf, dc, pf2, dc2) > 0
