"""A minimal GGUF (v3) writer: just what llama.cpp needs to run the benchmark's random Llama.

The bench compares chatapp with llama.cpp (through `llama_cpp`, when it is importable) on the
same model. flagship.py's weights are w = s * (q - 8) with one fp16 scale s per group of 64, so
each group is two Q4_0 blocks of 32 with d = s: llama.cpp gets the very same numbers. Q4_0 packs
block element j in the low nibble of byte j and element j + 16 in its high nibble (MLX: elements
2j and 2j + 1), so the nibbles are re-laid here. Meta's layout (traditional RoPE) is what
llama.cpp's "llama" architecture expects: no permutation of wq/wk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from chatapp.model.gguf_writer import F16, F32, Q4_0, T_INT32, Typed, q4_0_from_mlx, sentencepiece_vocab, write_gguf

from .flagship import LAYER_TENSORS, Geometry, tensors

GGUF_NAMES = {
    "attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v", "attention.wo": "attn_output",
    "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up",
    "attention_norm": "attn_norm", "ffn_norm": "ffn_norm",
}


def write_gguf_q4_0(path: Path, g: Geometry, tokenizer_model: Path, context: int = 4096) -> Path:
    """Write flagship.py's model (same seed, same numbers) as a Q4_0 GGUF for llama.cpp."""
    if g.bits != 4 or g.group_size % 32:
        raise ValueError("Q4_0 needs 4-bit weights in groups that are a multiple of 32")
    tokens, scores, types = sentencepiece_vocab(tokenizer_model)
    meta = [
        ("general.architecture", "llama"),
        ("general.name", "chatapp-bench-random-llama2-7b"),
        ("general.file_type", 2),  # mostly Q4_0
        ("llama.context_length", context),
        ("llama.embedding_length", g.dim),
        ("llama.block_count", g.n_layers),
        ("llama.feed_forward_length", g.hidden_dim),
        ("llama.rope.dimension_count", g.head_dim),
        ("llama.attention.head_count", g.n_heads),
        ("llama.attention.head_count_kv", g.n_kv_heads),
        ("llama.attention.layer_norm_rms_epsilon", float(g.norm_eps)),
        ("llama.rope.freq_base", 10000.0),
        ("tokenizer.ggml.model", "llama"),
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.scores", [float(x) for x in scores]),
        ("tokenizer.ggml.token_type", Typed(9, types, T_INT32)),
        ("tokenizer.ggml.bos_token_id", 1),
        ("tokenizer.ggml.eos_token_id", 2),
        ("tokenizer.ggml.unknown_token_id", 0),
    ]
    # the generator is re-run for the data, with the same seed: no tensor is held twice
    return write_gguf(path, meta, list(_layout(g)), _data(g))


def _layout(g: Geometry):
    """(gguf name, dims innermost first, type) in file order."""
    yield "token_embd.weight", (g.dim, g.vocab_size), F16
    for layer in range(g.n_layers):
        for name, (o, i) in LAYER_TENSORS.items():
            yield f"blk.{layer}.{GGUF_NAMES[name]}.weight", (g.size(i), g.size(o)), Q4_0
        for norm in ("attention_norm", "ffn_norm"):
            yield f"blk.{layer}.{GGUF_NAMES[norm]}.weight", (g.dim,), F32
    yield "output_norm.weight", (g.dim,), F32
    yield "output.weight", (g.dim, g.vocab_size), Q4_0


def _data(g: Geometry):
    """The tensors' bytes in ``_layout`` order, from flagship.tensors (same seed, same numbers)."""
    pending: dict[str, np.ndarray] = {}
    for name, arr in tensors(g):
        module, _, suffix = name.rpartition(".")
        if module == "tok_embeddings":
            yield arr.astype(np.float16).tobytes()
        elif module.endswith("_norm") or module == "norm":
            yield arr.astype(np.float32).tobytes()
        else:
            pending[suffix] = arr
            if suffix == "biases":  # weight, scales, biases arrive in that order
                yield q4_0_from_mlx(pending["weight"], pending["scales"]).tobytes()
                pending.clear()
