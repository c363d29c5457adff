"""Random-weight Llama models with realistic shapes, for tests and benchmarks.

They run through mlx-lm's own Llama code, so everything that works on them works on a
downloaded model of the same architecture.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama


@dataclass
class LlamaShape:
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_traditional: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def config(self) -> dict:
        return {"model_type": "llama", **asdict(self)}


def build_random_llama(
    shape: LlamaShape | None = None,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    quantize_bits: int | None = None,
    group_size: int = 64,
    silent_tokens: tuple[int, ...] = (),
) -> tuple[llama.Model, dict]:
    """Build an mlx-lm Llama with random weights; optionally quantise its linear layers.

    Weights are scaled so activations stay in a sane range over several layers, which keeps
    logits comparisons meaningful (pure N(0,1) weights saturate the softmax).
    ``silent_tokens`` get all-zero output rows (logit 0 whatever the input), so greedy decoding
    practically never picks them: with the byte tokenizer, silencing bytes 128-255 makes the
    model write ASCII, which decodes to text that encodes back to the same ids.
    """
    shape = shape or LlamaShape()
    config = shape.config()
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    return randomize(model, config, None, dtype, quantize_bits, group_size, silent_tokens), config


def randomize(model, config: dict, seed: int | None = 0, dtype: mx.Dtype = mx.float32,
              quantize_bits: int | None = None, group_size: int = 64, silent_tokens: tuple[int, ...] = ()):
    """``model`` (any mlx-lm architecture) with random weights as build_random_llama makes them:
    norms one, embeddings N(0, 1), other weights and biases N(0, 1/fan_in); its linear layers
    quantised when ``quantize_bits`` (recorded in ``config``). ``seed`` None: MLX's generator as
    it stands (build_random_llama seeds it before building the model)."""
    if seed is not None:
        mx.random.seed(seed)
    params = []
    for name, p in _flat(model.parameters()):
        if name.endswith("norm.weight"):
            params.append((name, mx.ones_like(p)))
        else:
            fan_in = p.shape[-1]
            std = 1.0 if "embed_tokens" in name else fan_in**-0.5
            params.append((name, (mx.random.normal(p.shape) * std).astype(dtype)))
    if silent_tokens:
        rows = mx.array(sorted(set(silent_tokens)))
        params = [(n, _zero_rows(p, rows)) if n == "lm_head.weight" else (n, p) for n, p in params]
    model.load_weights(params)
    if quantize_bits:
        nn.quantize(
            model,
            group_size=group_size,
            bits=quantize_bits,
            class_predicate=lambda _, m: isinstance(m, nn.Linear)
            and m.weight.shape[-1] % group_size == 0,
        )
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    mx.eval(model.parameters())
    model.eval()
    return model


def _zero_rows(w: mx.array, rows: mx.array) -> mx.array:
    keep = mx.ones((w.shape[0], 1), dtype=w.dtype)
    keep[rows] = 0
    return w * keep


def _flat(tree, prefix=""):
    from mlx.utils import tree_flatten

    return tree_flatten(tree, prefix=prefix)


def byte_tokenizer(vocab_size: int | None = None):
    """A byte-level tokenizer (256 byte tokens + <s>, </s>) wrapped as mlx-lm's TokenizerWrapper.

    Built in memory with the ``tokenizers`` library, so random-weight models get a real
    tokenizer (streaming detokeniser included) without any files from outside. With
    ``vocab_size`` it is padded with ``<tN>`` tokens up to that many ids, so a random-weight
    model with a large vocabulary (which emits any id) can have every token decoded.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    for i in range(len(vocab), vocab_size or 0):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    return TokenizerWrapper(fast)
