"""Small GGUF files written by the tests, from random-weight mlx-lm Llamas whose numbers are known."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from chatapp.model.gguf import LAYER_NAMES, TOP_NAMES
from chatapp.model.gguf_writer import F32, T_INT32, Typed, write_tensors

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
# rows of 256 values and more, for the K-quants' super-blocks (same heads as SHAPE)
WIDE = dict(SHAPE, hidden_size=256, intermediate_size=512, head_dim=64)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2 style vocabulary: the 256 byte symbols, one merge, and the ChatML control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    tokens = symbols + ["\u0120t", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(symbols) + 1) + [3, 3]
    return tokens, ["\u0120 t"], types


def random_llama(seed: int = 0, tied: bool = True, vocab: int = 259, shape: dict = SHAPE):
    """mlx-lm's Llama with random float32 weights (rotate-half RoPE, Hugging Face layout)."""
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", rms_norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0,
                     tie_word_embeddings=tied, max_position_embeddings=512, **shape)
    model = Model(args)
    mx.random.seed(seed)
    from mlx.utils import tree_flatten, tree_unflatten

    params = {k: mx.random.normal(v.shape) * (0.3 if v.ndim > 1 else 0.1) + (1.0 if v.ndim == 1 else 0.0)
              for k, v in tree_flatten(model.parameters())}
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj/k_proj rows (pairs rotary dims for its RoPE)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(path: str) -> str:
    """'model.layers.1.self_attn.q_proj.weight' -> 'blk.1.attn_q.weight'."""
    inv_layer = {v: k for k, v in LAYER_NAMES.items()}
    inv_top = {v: k for k, v in TOP_NAMES.items()}
    base, _, suffix = path.rpartition(".")
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{inv_layer[rest]}.{suffix}"
    return f"{inv_top[base]}.{suffix}"


def metadata(arch: str = "llama", vocab: tuple | None = None, shape: dict = SHAPE, **extra) -> list[tuple]:
    tokens, merges, types = vocab or byte_level_vocab()
    meta = [
        ("general.architecture", arch), ("general.name", "tiny-test-llama"),
        (f"{arch}.context_length", 512), (f"{arch}.embedding_length", shape["hidden_size"]),
        (f"{arch}.block_count", shape["num_hidden_layers"]),
        (f"{arch}.feed_forward_length", shape["intermediate_size"]),
        (f"{arch}.attention.head_count", shape["num_attention_heads"]),
        (f"{arch}.attention.head_count_kv", shape["num_key_value_heads"]),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), (f"{arch}.rope.freq_base", 10000.0),
        ("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "default"), ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.merges", merges), ("tokenizer.ggml.token_type", Typed(9, types, T_INT32)),
        ("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>")), ("tokenizer.ggml.add_bos_token", False),
        ("tokenizer.chat_template", CHATML),
    ]
    over = dict(extra)
    return [(k, over.pop(k, v)) for k, v in meta] + list(over.items())


def write_model_gguf(path: Path, model, *, permute: bool = True, matrices: int = F32, embedding: int = F32,
                     meta: list[tuple] | None = None) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would (q/k rows permuted unless ``permute`` is False); returns
    the float values the file stands for, by mlx-lm parameter name (what quantisation made of them)."""
    from mlx.utils import tree_flatten

    heads = {"q_proj": SHAPE["num_attention_heads"], "k_proj": SHAPE["num_key_value_heads"]}
    tensors, names = [], []
    for name, value in tree_flatten(model.parameters()):
        arr = np.array(value.astype(mx.float32))
        kind = F32 if arr.ndim == 1 else (embedding if "embed_tokens" in name else matrices)
        module = name.rsplit(".", 2)[-2]
        if module in heads and permute:
            arr = llama_cpp_permute(arr, heads[module])
        tensors.append((gguf_name(name), arr, kind))
        names.append(name)
    stored = write_tensors(path, meta or metadata(), tensors)
    out = {}
    for name, (gname, _, _) in zip(names, tensors):
        values = stored[gname].reshape(np.shape(tensors[names.index(name)][1]))
        module = name.rsplit(".", 2)[-2]
        if module in heads and permute:  # back to the model's own row order
            n = heads[module]
            values = values.reshape(n, values.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        out[name] = values
    return out


GEMMA3 = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
              num_key_value_heads=1, head_dim=64)


def random_gemma3(seed: int = 0, vocab: int = 259):
    """mlx-lm's gemma3_text with random float32 weights: layer 0 sliding (window 4), layer 1 global."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models.gemma3_text import Model, ModelArgs

    args = ModelArgs(model_type="gemma3_text", vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1e6,
                     rope_local_base_freq=1e4, query_pre_attn_scalar=GEMMA3["head_dim"], sliding_window=4,
                     sliding_window_pattern=2, max_position_embeddings=512, **GEMMA3)
    model = Model(args)
    model.sanitize({})  # tied output
    mx.random.seed(seed)
    params = {k: mx.random.normal(v.shape) * (0.1 if v.ndim > 1 else 0.3) for k, v in tree_flatten(model.parameters())}
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def gemma3_metadata(**extra) -> list[tuple]:
    meta = metadata(arch="gemma3", shape=GEMMA3, **{"gemma3.attention.layer_norm_rms_epsilon": 1e-6,
                                                     "gemma3.rope.freq_base": 1e6})
    return meta + [("gemma3.attention.key_length", GEMMA3["head_dim"]), ("gemma3.attention.value_length",
                   GEMMA3["head_dim"]), ("gemma3.attention.sliding_window", 4),
                   ("gemma3.attention.sliding_window_pattern", 2)] + list(extra.items())


def write_arch_gguf(path: Path, model, arch: str, meta: list[tuple], *, matrices: int = F32,
                    embedding: int = F32) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp's converter would for ``arch`` (not llama: no row permutation;
    gemma3: every norm weight plus 1); returns the values the file stands for, by mlx-lm parameter
    name (norms as the model holds them)."""
    from mlx.utils import tree_flatten

    from chatapp.model.gguf_arch import ARCHITECTURES

    spec = ARCHITECTURES[arch]
    inv_layer = {v: k for k, v in spec.layers.items()}
    inv_top = {v: k for k, v in TOP_NAMES.items()}
    tensors, names = [], []
    for name, value in tree_flatten(model.parameters()):
        arr = np.array(value.astype(mx.float32))
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            gname = f"blk.{i}.{inv_layer[rest]}.{suffix}"
        else:
            gname = f"{inv_top[base]}.{suffix}"
        if gname.endswith("norm.weight"):
            arr = arr + spec.norm_shift
        kind = F32 if arr.ndim == 1 else (embedding if "embed_tokens" in name else matrices)
        tensors.append((gname, arr, kind))
        names.append(name)
    stored = write_tensors(path, meta, tensors)
    return {n: stored[g] - (spec.norm_shift if g.endswith("norm.weight") else 0)
            for n, (g, _, _) in zip(names, tensors)}


def write_gemma3_gguf(path: Path, model, *, matrices: int = F32, embedding: int = F32) -> dict[str, np.ndarray]:
    return write_arch_gguf(path, model, "gemma3", gemma3_metadata(), matrices=matrices, embedding=embedding)


def random_qwen(kind: str, seed: int = 0, vocab: int = 259):
    """mlx-lm's qwen2 (q/k/v biases) or qwen3 (q/k norms) with random float32 weights, WIDE's shape."""
    import importlib

    from mlx.utils import tree_flatten, tree_unflatten

    mod = importlib.import_module(f"mlx_lm.models.{kind}")
    shape = {k: v for k, v in WIDE.items() if kind == "qwen3" or k != "head_dim"}
    args = mod.ModelArgs(model_type=kind, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1e6,
                         max_position_embeddings=512, tie_word_embeddings=True, **shape)
    model = mod.Model(args)
    mx.random.seed(seed)
    params = {k: mx.random.normal(v.shape) * (0.3 if v.ndim > 1 else 0.1) + (1.0 if k.endswith("norm.weight") else 0)
              for k, v in tree_flatten(model.parameters())}
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def qwen_metadata(kind: str) -> list[tuple]:
    return metadata(arch=kind, shape=WIDE, **{f"{kind}.attention.layer_norm_rms_epsilon": 1e-6,
                                               f"{kind}.rope.freq_base": 1e6, "tokenizer.ggml.pre": "qwen2"}) + \
        [(f"{kind}.attention.key_length", WIDE["head_dim"])]
