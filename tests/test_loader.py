"""Model loading: local folders, the Hugging Face cache and download path (offline, faked),
the legacy npz format, dtype handling and the one-line load errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx2
import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from mlx.utils import tree_flatten

from chatapp.model import device, loader
from chatapp.model.device import BackendInfo, cast_floating, checkpoint_float_dtype, pick_backend
from chatapp.model.hub import DownloadProgress, progress_tqdm_class
from chatapp.model.legacy import legacy_weight_name, load_legacy_tokenizer
from chatapp.model.loader import (
    available_memory_bytes,
    estimate_weight_bytes,
    load_model,
    save_model_dir,
    weights_fingerprint,
)
from chatapp.model.modelfiles import ModelLoadError, find_weight_files
from chatapp.model.synthetic import LlamaShape, build_random_llama
from tests.conftest import SHARED_MODELS

HASH = "0123456789abcdef0123456789abcdef01234567"


# ---------------------------------------------------------------------------------- helpers


def greedy(model, ids, n=12):
    ids = list(ids)
    for _ in range(n):
        logits = model(mx.array([ids]))[0, -1]
        ids.append(int(mx.argmax(logits).item()))
    return ids[-n:]


def logits_of(model, ids):
    out = model(mx.array([ids]))
    mx.eval(out)
    return out


# Legacy mlx-examples llms/llama names, written out here (not taken from the loader) so the
# test checks the mapping rather than mirroring it.
_TO_LEGACY_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def to_legacy_names(weights: dict) -> dict:
    out = {}
    for name, value in weights.items():
        module, _, suffix = name.rpartition(".")
        if module == "model.embed_tokens":
            new = "tok_embeddings"
        elif module == "model.norm":
            new = "norm"
        elif module == "lm_head":
            new = "output"
        else:
            parts = module.split(".")  # model.layers.N.<sub>.<proj>
            assert parts[:2] == ["model", "layers"], name
            new = f"layers.{parts[2]}.{_TO_LEGACY_LAYER['.'.join(parts[3:])]}"
        out[f"{new}.{suffix}"] = value
    return out


def random_model_dir(tmp_path, stories_path, name="rand", quantize_bits=None, seed=0):
    model, config = build_random_llama(LlamaShape(), seed=seed, quantize_bits=quantize_bits)
    path = save_model_dir(tmp_path / name, model, config, stories_path)
    return model, config, path


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return cache


def put_in_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay out ``source`` as the hub cache does: models--org--name/{refs/main,snapshots/<hash>}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / HASH
    shutil.copytree(source, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HASH)
    return snap


def hub_response(status=404, url="https://huggingface.co/api/models/x"):
    return httpx2.Response(status, request=httpx2.Request("GET", url))


# ---------------------------------------------------------------------------- local folders


def test_load_stories_folder_metadata_and_greedy(stories_path):
    m = load_model(str(stories_path))
    assert m.format == "mlx-lm"
    assert m.path == stories_path.resolve()
    assert m.model_id == "stories260K"
    assert m.config["model_type"] == "llama"
    assert (m.max_position_embeddings, m.n_kv_heads, m.head_dim, m.n_layers) == (512, 4, 8, 5)
    assert m.has_chat_template is False
    assert m.dtype == "float32"
    assert len(m.weights_fingerprint) == 64
    assert m.weights_fingerprint == weights_fingerprint([stories_path / "model.safetensors"])
    prompt = m.tokenizer.encode("Once upon a time,")
    text = m.tokenizer.decode(greedy(m.model, prompt, 10))
    assert text.strip().startswith("there was a little girl named Lily")


def test_stories4bit_auto_dtype_is_float32_on_cpu(stories4_path, tmp_path):
    assert pick_backend().name == "cpu"  # these tests run on the CPU backend
    auto = load_model(str(stories4_path), dtype="auto")
    native = load_model(str(stories4_path), dtype="native")
    ids = auto.tokenizer.encode("Once upon a time,")
    assert logits_of(auto.model, ids).dtype == mx.float32
    assert auto.dtype == "float32"
    assert greedy(auto.model, ids) == greedy(native.model, ids)
    # packed weights stay uint32, scales/biases/norms are float32
    q = auto.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and q.weight.dtype == mx.uint32
    assert q.scales.dtype == q.biases.dtype == mx.float32

    # The same checkpoint with float16 scales (how most mlx-community 4-bit models ship):
    # "auto" casts it to float32 on CPU, "native" keeps float16; greedy output agrees.
    half = load_model(str(stories4_path), dtype="float16")
    assert half.dtype == "float16"
    path = save_model_dir(tmp_path / "s4-f16", half.model, half.config, stories4_path)
    auto16 = load_model(str(path))
    native16 = load_model(str(path), dtype="native")
    assert native16.dtype == "float16" and logits_of(native16.model, ids).dtype == mx.float16
    assert auto16.dtype == "float32" and logits_of(auto16.model, ids).dtype == mx.float32
    assert greedy(auto16.model, ids, 6) == greedy(native16.model, ids, 6)
    assert auto16.weights_fingerprint != auto.weights_fingerprint


def test_save_model_dir_roundtrip_quantized_random(stories_path, tmp_path):
    model, config, path = random_model_dir(tmp_path, stories_path, quantize_bits=4)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model"} <= {
        p.name for p in path.iterdir()
    }
    m = load_model(str(path))
    assert m.format == "mlx-lm" and (m.n_kv_heads, m.head_dim, m.n_layers) == (2, 64, 2)
    assert m.max_position_embeddings == 4096
    ids = [1, 5, 77, 300, 12, 9]
    assert mx.allclose(logits_of(m.model, ids), logits_of(model, ids), atol=1e-5).item()
    assert isinstance(m.model.model.layers[1].mlp.down_proj, nn.QuantizedLinear)


def test_fingerprint_is_stable_and_tracks_changes(tmp_path):
    f = tmp_path / "model.safetensors"
    data = bytearray(b"\x01" * (3 << 20))
    f.write_bytes(data)
    fp = weights_fingerprint([f])
    assert fp == weights_fingerprint([f])
    data[-1] = 2  # last MiB is hashed
    f.write_bytes(data)
    fp_tail = weights_fingerprint([f])
    assert fp_tail != fp
    data[0] = 3  # first MiB is hashed
    f.write_bytes(data)
    assert weights_fingerprint([f]) != fp_tail
    f.write_bytes(data + b"\x00")  # size is hashed
    assert weights_fingerprint([f]) != fp_tail
    g = tmp_path / "model-2.safetensors"
    g.write_bytes(b"x")
    assert weights_fingerprint([f, g]) == weights_fingerprint([g, f])


def test_estimate_weight_bytes_reads_headers(stories_path, tmp_path):
    st = [stories_path / "model.safetensors"]
    on_disk = st[0].stat().st_size
    f32 = estimate_weight_bytes(st, mx.float32)
    assert abs(f32 - on_disk) < 20_000  # float32 already: header only differs
    assert estimate_weight_bytes(st, mx.float16) * 2 == pytest.approx(f32, rel=1e-6)
    assert estimate_weight_bytes(st, None) == on_disk
    npz = tmp_path / "weights.npz"
    mx.savez(str(npz), a=mx.zeros((100, 10), dtype=mx.float16), b=mx.zeros((7,), dtype=mx.uint32))
    assert estimate_weight_bytes([npz], mx.float32) == 100 * 10 * 4 + 7 * 4


# ------------------------------------------------------------------------------ device/cast


def test_cast_floating_can_skip_quantised_scales():
    from chatapp.backend.params import is_quant_param

    model, _ = build_random_llama(LlamaShape(num_hidden_layers=1), dtype=mx.float16, quantize_bits=4)
    cast_floating(model, mx.float32, skip=is_quant_param)
    for name, p in tree_flatten(model.parameters()):
        if name.endswith((".scales", ".biases")):
            assert p.dtype == mx.float16, name  # left as stored, for the CPU kernels
        elif p.dtype != mx.uint32:
            assert p.dtype == mx.float32, name


def test_cast_floating_keeps_packed_weights():
    model, _ = build_random_llama(LlamaShape(num_hidden_layers=1), dtype=mx.float16, quantize_bits=4)
    before = dict(tree_flatten(model.parameters()))
    assert checkpoint_float_dtype(model) == mx.float16
    cast_floating(model, mx.float32)
    after = dict(tree_flatten(model.parameters()))
    assert before.keys() == after.keys()
    n_packed = 0
    for name, p in after.items():
        if before[name].dtype == mx.uint32:
            n_packed += 1
            assert p.dtype == mx.uint32 and mx.array_equal(p, before[name]).item()
        else:
            assert p.dtype == mx.float32, name
    assert n_packed >= 7  # q/k/v/o/gate/up/down (+ lm_head)
    assert checkpoint_float_dtype(model) == mx.float32
    assert model(mx.array([[1, 2, 3]])).dtype == mx.float32
    with pytest.raises(ValueError):
        cast_floating(model, mx.int32)


def test_pick_backend(monkeypatch):
    info = pick_backend()
    assert info == BackendInfo("cpu", mx.float32) and not info.is_gpu
    assert info.resolve(mx.float16) == mx.float32

    monkeypatch.setattr(device.mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(device.mx.metal, "is_available", lambda: True)
    metal = pick_backend()
    assert metal.name == "metal" and metal.is_gpu and metal.activation_dtype is None
    assert metal.resolve(mx.bfloat16) == mx.bfloat16

    monkeypatch.setattr(device.mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(device.mx.cuda, "is_available", lambda: True)
    assert pick_backend().name == "cuda"

    monkeypatch.setattr(device.mx.cuda, "is_available", lambda: False)
    assert pick_backend().name == "cpu"


# ------------------------------------------------------------------------------- legacy npz


def test_legacy_weight_names():
    assert legacy_weight_name("tok_embeddings.weight") == "model.embed_tokens.weight"
    assert legacy_weight_name("output.scales") == "lm_head.scales"
    assert legacy_weight_name("norm.weight") == "model.norm.weight"
    assert legacy_weight_name("layers.3.attention.wk.biases") == "model.layers.3.self_attn.k_proj.biases"
    assert legacy_weight_name("layers.0.feed_forward.w2.weight") == "model.layers.0.mlp.down_proj.weight"
    assert legacy_weight_name("layers.10.ffn_norm.weight") == "model.layers.10.post_attention_layernorm.weight"
    assert legacy_weight_name("layers.0.attention.rope.freqs") is None
    assert legacy_weight_name("something.else") is None


def make_legacy_stories(stories_path, dest: Path) -> Path:
    weights = mx.load(str(stories_path / "model.safetensors"))
    weights = to_legacy_names(weights)
    weights["output.weight"] = weights["tok_embeddings.weight"]  # legacy models have an untied output
    dest.mkdir()
    mx.savez(str(dest / "weights.npz"), **weights)
    # As Meta's params.json / mlx-community's legacy configs: vocab_size -1, no hidden_dim,
    # head_dim or rope settings (defaults: from the weights, dim // n_heads, traditional RoPE).
    (dest / "config.json").write_text(json.dumps({
        "dim": 64, "multiple_of": 4, "n_heads": 8, "n_kv_heads": 4, "n_layers": 5,
        "norm_eps": 1e-05, "vocab_size": -1, "model_type": "llama",
    }))
    shutil.copyfile(stories_path / "tokenizer.model", dest / "tokenizer.model")
    return dest


def test_legacy_stories_matches_original(stories_path, tmp_path):
    if not (stories_path / "tokenizer.model").exists():
        pytest.skip("stories260K has no tokenizer.model")
    path = make_legacy_stories(stories_path, tmp_path / "legacy")
    legacy = load_model(str(path))
    ref = load_model(str(stories_path))
    assert legacy.format == "legacy-npz"
    assert legacy.config["rope_traditional"] is True and legacy.config["vocab_size"] == 512
    assert legacy.config["intermediate_size"] == 172 and legacy.config["tie_word_embeddings"] is False
    assert (legacy.n_kv_heads, legacy.head_dim, legacy.n_layers) == (4, 8, 5)
    assert legacy.max_position_embeddings is None
    assert legacy.has_chat_template is False

    ids = ref.tokenizer.encode("Once upon a time, there was a")
    assert legacy.tokenizer.encode("Once upon a time, there was a") == ids
    a, b = logits_of(legacy.model, ids), logits_of(ref.model, ids)
    assert mx.allclose(a, b, atol=1e-5).item()
    assert greedy(legacy.model, ids) == greedy(ref.model, ids)
    assert legacy.tokenizer.eos_token_ids == {2}
    text = legacy.tokenizer.decode(greedy(legacy.model, legacy.tokenizer.encode("Once upon a time,"), 10))
    assert text.strip().startswith("there was a little girl named Lily")

    # streaming detokenizer works on the legacy tokenizer
    detok = legacy.tokenizer.detokenizer
    detok.reset()
    for t in legacy.tokenizer.encode("The cat sat on the mat.", add_special_tokens=False):
        detok.add_token(t)
    detok.finalize()
    assert detok.text.strip() == "The cat sat on the mat."


# Text that exercises SentencePiece's whitespace rules: runs of spaces, spaces at either end,
# next to newlines and tabs, characters the vocabulary lacks (byte fallback).
_SPM_TEXT = st.lists(st.sampled_from(list("ab cd\n\t.,!?xyz 123 ABCé") + [
    "  ", "   ", "你", "🙂", "[INST]", "<<SYS>>", "hello", " world", "the", "ing", "\u00a0", "\r\n"]),
    max_size=30).map("".join)
_SPM_FIXED = ["Once upon a time,", " leading space", "a\nb\n\nc", "Hello  world", "héllo 你好 🙂", "  two",
              "end. ", 'Lily said: "Hi!"', "", " ", "x", "a\n b", "\tTab", "x\n  y", "[INST] hi [/INST] Hello "]


def spm_tokenizer_folder(tmp_path_factory, source: Path) -> Path:
    if not source.exists():
        pytest.skip(f"needs {source} (../shared is absent)")
    path = tmp_path_factory.mktemp("spm")
    shutil.copyfile(source, path / "tokenizer.model")
    return path


@pytest.mark.parametrize("model", ["stories260K", "llama2-tokenizer"])
def test_legacy_tokenizer_matches_sentencepiece(model, tmp_path_factory):
    """Token ids equal SentencePiece's own for any text: stories260K removes extra whitespace,
    Llama 2 keeps it (and scores whitespace-only pieces last)."""
    import sentencepiece as spm

    path = spm_tokenizer_folder(tmp_path_factory, SHARED_MODELS / model / "tokenizer.model")
    tok = load_legacy_tokenizer(path)
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    for s in _SPM_FIXED:
        assert tok.encode(s) == [sp.bos_id()] + sp.encode(s), s
        assert tok.decode(tok.encode(s), skip_special_tokens=True) == sp.decode(sp.encode(s)), s

    @hsettings(max_examples=400, deadline=None)
    @given(_SPM_TEXT)
    def same_ids(s):
        assert tok.encode(s, add_special_tokens=False) == sp.encode(s)

    same_ids()


def test_legacy_quantized_random_model(stories_path, tmp_path):
    model, config = build_random_llama(LlamaShape(), seed=3, quantize_bits=4)
    weights = to_legacy_names(dict(tree_flatten(model.parameters())))
    assert "output.scales" in weights and "layers.1.feed_forward.w2.biases" in weights
    assert weights["layers.0.attention.wq.weight"].dtype == mx.uint32
    dest = tmp_path / "legacy-q"
    dest.mkdir()
    names = sorted(weights)
    half = len(names) // 2  # two shards, as the bigger legacy repos had
    mx.savez(str(dest / "weights.00.npz"), **{k: weights[k] for k in names[:half]})
    mx.savez(str(dest / "weights.01.npz"), **{k: weights[k] for k in names[half:]})
    (dest / "config.json").write_text(json.dumps({
        "dim": 256, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "head_dim": 64, "hidden_dim": 512,
        "norm_eps": 1e-5, "vocab_size": 512, "rope_theta": 10000.0, "rope_traditional": False,
        "quantization": {"group_size": 64, "bits": 4},
    }))
    shutil.copyfile(stories_path / "tokenizer.model", dest / "tokenizer.model")

    m = load_model(str(dest))
    assert m.format == "legacy-npz"
    assert m.config["quantization"] == {"group_size": 64, "bits": 4}
    q = m.model.model.layers[0].mlp.gate_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 64)
    assert isinstance(m.model.lm_head, nn.QuantizedLinear)
    ids = [1, 40, 41, 300, 7]
    assert mx.allclose(logits_of(m.model, ids), logits_of(model, ids), atol=1e-5).item()
    assert greedy(m.model, ids, 6) == greedy(model, ids, 6)
    assert m.weights_fingerprint == weights_fingerprint(find_weight_files(dest)[1])


def test_legacy_errors(stories_path, tmp_path):
    path = make_legacy_stories(stories_path, tmp_path / "legacy")
    weights = dict(mx.load(str(path / "weights.npz")))
    mx.eval(weights)  # read it all before the file is rewritten
    weights["layers.0.attention.mystery.weight"] = mx.zeros((2,))
    mx.savez(str(path / "weights.npz"), **weights)
    with pytest.raises(ModelLoadError, match="mystery"):
        load_model(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mixtral'"):
        load_model(str(path))


# ------------------------------------------------------------------- Hugging Face cache/download


def test_repo_id_loads_from_local_cache_offline(stories_path, tmp_path, hf_cache, monkeypatch):
    _, _, src = random_model_dir(tmp_path, stories_path)
    snap = put_in_cache(hf_cache, "mlx-community/tiny-test", src)

    m = load_model("mlx-community/tiny-test", offline=True)
    assert m.model_id == "mlx-community/tiny-test"
    assert m.path == snap
    assert m.format == "mlx-lm"

    # Without offline: the cache is tried first, so the network is never touched.
    import huggingface_hub

    real = huggingface_hub.snapshot_download

    def no_network(*args, **kwargs):
        assert kwargs.get("local_files_only"), "went to the network although the model is cached"
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert load_model("mlx-community/tiny-test").path == snap

    # HF_HOME/hub is the cache when HF_HUB_CACHE is not set
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "hf-home"
    put_in_cache(home / "hub", "org/other", src)
    monkeypatch.setenv("HF_HOME", str(home))
    assert load_model("org/other", offline=True).model_id == "org/other"


def test_progress_tqdm_reports(monkeypatch):
    """Drive the tqdm class the way snapshot_download does (see its source)."""
    reports: list[DownloadProgress] = []
    cls = progress_tqdm_class(reports.append, plan=[("config.json", 100), ("model.safetensors", 1000)])
    files = cls(total=3, desc="Fetching 3 files")  # 3 files, one of them already cached
    transfer = cls(desc="Downloading bytes", total=0, initial=0, unit="B", unit_scale=True)
    disk = cls(desc="Reconstructing (incomplete total...)", total=0, initial=0, unit="B", unit_scale=True)
    assert files.disable is False

    files.update(1)  # the cached file
    disk.total += 100  # config.json starts
    disk.refresh()
    disk.update(100)
    transfer.update(60)  # network bytes don't count: disk bytes do
    files.update(1)
    disk.total += 1000  # model.safetensors starts
    disk.refresh()
    disk.update(400)
    last = reports[-1]
    assert last == DownloadProgress("model.safetensors", 500, 1100, pytest.approx(100 * 500 / 1100), 2, 3)
    disk.update(600)
    files.update(1)
    for bar in (files, transfer, disk):
        bar.close()
    cls._tracker.finish()

    assert reports[-1] == DownloadProgress("model.safetensors", 1100, 1100, 100.0, 3, 3)
    assert any(r.filename == "config.json" and r.bytes_done == 100 for r in reports)
    done = [r.bytes_done for r in reports]
    assert done == sorted(done)
    assert all(r.bytes_total == 1100 for r in reports)

    # No plan: the total grows as files start; no callback: silent
    reports.clear()
    cls = progress_tqdm_class(reports.append)
    disk = cls(total=0, unit="B", desc="x")
    disk.total = 50
    disk.refresh()
    disk.update(25)
    assert reports[-1].bytes_total == 50 and reports[-1].percent == 50.0 and reports[-1].filename == ""
    silent = progress_tqdm_class(None)(total=2)
    silent.update(2)
    silent.close()


def test_download_path_with_fake_hub(stories_path, tmp_path, hf_cache, monkeypatch):
    """snapshot_download's real download loop, with the Hub API and file transfer faked."""
    import huggingface_hub._snapshot_download as sd
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.file_download import DryRunFileInfo
    from huggingface_hub.hf_api import RepoFile

    _, _, src = random_model_dir(tmp_path, stories_path)
    files = sorted(p.name for p in src.iterdir())
    sizes = {name: (src / name).stat().st_size for name in files}
    calls = []

    class FakeApi:
        def __init__(self, **kwargs):
            pass

        def repo_info(self, repo_id, **kwargs):
            calls.append(("repo_info", repo_id))
            if repo_id not in ("org/fake", "org/partial"):
                raise RepositoryNotFoundError("404 Repository Not Found", response=hub_response())
            return SimpleNamespace(sha=HASH)

        def list_repo_tree(self, repo_id, **kwargs):
            return [RepoFile(path=n, size=sizes.get(n, 10), oid="b" * 40)
                    for n in files + ["README.md", ".gitattributes"]]

    def fake_hf_hub_download(repo_id, filename, *, revision, cache_dir, tqdm_class=None, dry_run=False, **kw):
        target = Path(cache_dir) / ("models--" + repo_id.replace("/", "--")) / "snapshots" / revision / filename
        if dry_run:
            return DryRunFileInfo(commit_hash=revision, file_size=sizes[filename], filename=filename,
                                  local_path=str(target), is_cached=target.exists(),
                                  will_download=not target.exists())
        if target.exists():  # cached files come back at once, without progress
            return str(target)
        data = (src / filename).read_bytes()
        bar = tqdm_class(total=len(data), initial=0, desc=filename)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            for i in range(0, len(data), 4096):
                f.write(data[i:i + 4096])
                bar.update(len(data[i:i + 4096]))
        bar.close()
        return str(target)

    monkeypatch.setattr(sd, "HfApi", FakeApi)
    monkeypatch.setattr(sd, "hf_hub_download", fake_hf_hub_download)

    reports: list[DownloadProgress] = []
    m = load_model("org/fake", progress=reports.append)
    assert m.model_id == "org/fake" and m.path.parent.name == "snapshots"
    assert not (m.path / "README.md").exists()  # outside the allow patterns
    assert reports, "no progress reported"
    total = sum(sizes.values())
    assert reports[-1] == DownloadProgress(files[-1], total, total, 100.0, len(files), len(files))
    assert [r.filename for r in reports if r.filename] == sorted(
        [r.filename for r in reports if r.filename], key=files.index)
    assert set(r.filename for r in reports) >= {"model.safetensors", "tokenizer.json"}
    assert all(r.bytes_total == total for r in reports)
    assert all(0 <= r.percent <= 100 for r in reports)

    # Loaded again: straight from the cache, nothing downloaded, no progress.
    reports.clear()
    calls.clear()
    assert load_model("org/fake", progress=reports.append).path == m.path
    assert reports == [] and calls == []

    # A partly cached snapshot: offline, the folder check names what is missing; online, the
    # rest is downloaded (only the missing files count in the progress).
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    shutil.copyfile(src / "config.json", only_config / "config.json")
    put_in_cache(hf_cache, "org/partial", only_config)
    msg = one_line_error("org/partial", offline=True)
    assert "missing weights" in msg and "tokenizer" in msg and "config.json" not in msg
    reports.clear()
    m = load_model("org/partial", progress=reports.append)
    assert m.path.name == HASH and m.format == "mlx-lm"
    assert "config.json" not in {r.filename for r in reports}
    rest = total - sizes["config.json"]
    assert reports[-1].bytes_done == reports[-1].bytes_total == rest
    assert reports[-1].files_done == reports[-1].files_total == len(files)

    # An unknown repo through the same machinery (the close-name search fails at once, as with
    # no network, instead of retrying the real hub for ~20 s)
    fake_search(monkeypatch, httpx2.ConnectError("no network in tests: no suggestions"))
    with pytest.raises(ModelLoadError) as err:
        load_model("org/missing")
    assert "unknown model 'org/missing'" in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------- errors


def fake_snapshot(monkeypatch, network_error: BaseException):
    """snapshot_download that finds nothing cached and fails on the network with ``network_error``."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def fake(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot folder")
        raise network_error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)


def one_line_error(spec, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as err:
        load_model(spec, **kwargs)
    message = str(err.value)
    assert "\n" not in message and message
    return message


def fake_search(monkeypatch, found: dict[str, list[str]] | Exception) -> list[str]:
    """HfApi.list_models answering ``found[search]`` (ids under mlx-community), or failing; returns
    the searches made."""
    import huggingface_hub

    searches = []

    def list_models(self, *, author=None, search=None, limit=None, **kwargs):
        searches.append(search)
        assert author == "mlx-community" and limit
        if isinstance(found, Exception):
            raise found
        return iter([SimpleNamespace(id=i) for i in found.get(search, [])][:limit])

    monkeypatch.setattr(huggingface_hub.HfApi, "list_models", list_models)
    return searches


def test_error_unknown_repo(monkeypatch, hf_cache):
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    fake_search(monkeypatch, httpx2.ConnectError("the search fails: no suggestions"))
    fake_snapshot(monkeypatch, RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found",
                                                       response=hub_response()))
    msg = one_line_error("mlx-community/no-such-model")
    assert msg == ("unknown model 'mlx-community/no-such-model': no such repository on Hugging Face "
                   "(check the name; private repositories need `hf auth login`)")

    fake_snapshot(monkeypatch, GatedRepoError("403 gated", response=hub_response(403)))
    assert "gated" in one_line_error("meta-llama/Llama-2-7b")


def test_unknown_repo_lists_close_mlx_community_names(monkeypatch, hf_cache):
    from huggingface_hub.errors import RepositoryNotFoundError

    hits = ["mlx-community/CodeLlama-7b-Python-4bit-MLX", "mlx-community/Llama-2-7b-chat-4-bit",
            "mlx-community/Llama-2-7b-mlx", "mlx-community/Llama-2-7b-chat-mlx", "mlx-community/Llama-2-7b-4bit-ft",
            "mlx-community/Meta-Llama-3-8B-Instruct-4bit", "mlx-community/Llama-2-7b-hf-4bit"]
    searches = fake_search(monkeypatch, {"Llama-2-7b": hits})
    fake_snapshot(monkeypatch, RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found",
                                                       response=hub_response()))
    msg = one_line_error("mlx-community/Llama-2-7b-4bit")
    # The exact name finds nothing, so the search is shortened at a separator until it does.
    assert searches == ["Llama-2-7b-4bit", "Llama-2-7b"]
    head, _, names = msg.partition("; close mlx-community names: ")
    assert head == "unknown model 'mlx-community/Llama-2-7b-4bit': no such repository on Hugging Face"
    listed = names.split(", ")
    assert len(listed) == 5 and set(listed) <= set(hits)
    assert listed[0] == "mlx-community/Llama-2-7b-4bit-ft"  # the closest name first
    assert "mlx-community/Meta-Llama-3-8B-Instruct-4bit" not in listed


@pytest.mark.parametrize("make_error", [
    lambda: __import__("huggingface_hub").errors.LocalEntryNotFoundError(
        "Got: ConnectError\nAn error happened while trying to locate the files on the Hub"),
    lambda: httpx2.ConnectError("[Errno -3] Temporary failure in name resolution"),
    lambda: __import__("huggingface_hub").errors.OfflineModeIsEnabled("offline"),
], ids=["local-entry", "connect", "offline-mode"])
def test_error_no_network_nothing_cached(monkeypatch, hf_cache, make_error):
    fake_snapshot(monkeypatch, make_error())
    msg = one_line_error("mlx-community/Llama-3.2-1B-Instruct-4bit")
    assert msg == ("cannot reach Hugging Face and mlx-community/Llama-3.2-1B-Instruct-4bit is not in "
                   f"the local cache ({hf_cache})")


def test_error_no_network_partly_cached(monkeypatch, hf_cache, tmp_path, stories_path):
    src = tmp_path / "only-config"
    src.mkdir()
    shutil.copyfile(stories_path / "config.json", src / "config.json")
    snap = put_in_cache(hf_cache, "mlx-community/half", src)
    fake_snapshot(monkeypatch, httpx2.ConnectError("no route"))
    import huggingface_hub

    fake = huggingface_hub.snapshot_download

    def found_partial(repo_id, **kwargs):
        return str(snap) if kwargs.get("local_files_only") else fake(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", found_partial)
    msg = one_line_error("mlx-community/half")
    assert msg == f"cannot reach Hugging Face and the cached copy of mlx-community/half is incomplete ({snap})"


def test_error_offline_not_cached(hf_cache, monkeypatch):
    msg = one_line_error("mlx-community/whatever", offline=True)
    assert "offline" in msg and "mlx-community/whatever" in msg and str(hf_cache) in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "offline" in one_line_error("mlx-community/whatever")


def test_error_bad_specs(tmp_path):
    assert "no model folder" in one_line_error(str(tmp_path / "nope"))
    assert "no model folder" in one_line_error("./relative/nope")
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    assert "not a model folder" in one_line_error(str(f))
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(str(tmp_path), dtype="float8")


def test_error_folder_missing_files(stories_path, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    msg = one_line_error(str(empty))
    assert "config.json" in msg and "weights" in msg and "tokenizer" in msg

    _, _, path = random_model_dir(tmp_path, stories_path)
    (path / "config.json").rename(tmp_path / "config.json")
    msg = one_line_error(str(path))
    assert "missing config.json" in msg and "weights" not in msg and "tokenizer" not in msg
    (tmp_path / "config.json").rename(path / "config.json")

    (path / "model.safetensors").rename(path / "consolidated.safetensors")
    msg = one_line_error(str(path))
    assert "missing weights" in msg and "consolidated.safetensors" in msg
    (path / "consolidated.safetensors").rename(path / "model.safetensors")

    for name in ("tokenizer.json", "tokenizer.model"):
        (path / name).unlink()
    msg = one_line_error(str(path))
    assert "missing a tokenizer" in msg and "config.json" not in msg


def test_error_unsupported_architecture(stories_path, tmp_path):
    _, _, path = random_model_dir(tmp_path, stories_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (path / "config.json").write_text(json.dumps(cfg))
    msg = one_line_error(str(path))
    assert "unsupported architecture 'frobnicator'" in msg
    del cfg["model_type"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert "no model_type" in one_line_error(str(path))


def test_error_weights_do_not_fit_config(stories_path, tmp_path):
    _, _, path = random_model_dir(tmp_path, stories_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the file holds 2 layers
    (path / "config.json").write_text(json.dumps(cfg))
    assert one_line_error(str(path)).startswith("could not load")


def test_error_not_enough_memory(stories_path, monkeypatch):
    need = estimate_weight_bytes([stories_path / "model.safetensors"], mx.float32)
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: need // 2)
    msg = one_line_error(str(stories_path))
    assert msg.startswith("not enough memory for")
    assert loader.format_bytes(need) in msg and loader.format_bytes(need // 2) in msg
    monkeypatch.setattr(loader, "available_memory_bytes", lambda: need + 1)
    assert load_model(str(stories_path)).format == "mlx-lm"


def test_available_memory_is_plausible():
    have = available_memory_bytes()
    assert have is not None and (64 << 20) < have < (1 << 50)
    assert loader.format_bytes(3 << 30) == "3.00 GiB" and loader.format_bytes(1536) == "1.5 KiB"
