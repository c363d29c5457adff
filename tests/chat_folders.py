"""Model folders for prompt-format tests: the real Llama 2 tokenizer and a scripted model.

The model is an mlx-lm Llama whose attention and MLP outputs are zero, so each position's
logits depend on its own token only; its output rows are set so that greedy decoding follows a
script: after token ``a`` it writes ``script[a]``. A prompt ending in ``[/INST]``'s last token
then gets the same reply every turn, ending with the format's end-of-turn token, as a chat
model's does, whatever the conversation before it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from chatapp.model.synthetic import LlamaShape, build_random_llama
from tests.conftest import SHARED_MODELS

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
             intermediate_size=128, rope_traditional=True, max_position_embeddings=4096)
EOS = 2  # Llama 2's </s>
IM_START, IM_END = 32000, 32001  # the ChatML tokens chatml_folder adds


def llama2_tokenizer_model() -> Path:
    path = SHARED_MODELS / "llama2-tokenizer" / "tokenizer.model"
    if not path.exists():
        pytest.skip(f"needs the shared Llama 2 tokenizer {path} (../shared is absent)")
    return path


def sp_ids(text: str) -> list[int]:
    """SentencePiece's own ids for ``text`` (Llama 2 tokenizer, dummy prefix, no BOS)."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(llama2_tokenizer_model())).encode(text)


def script(ids: list[int]) -> dict[int, int]:
    """A script writing ``ids[i + 1]`` after ``ids[i]`` (a token repeated makes a loop)."""
    out: dict[int, int] = {}
    for a, b in zip(ids, ids[1:]):
        assert out.setdefault(a, b) == b, "a token cannot be followed by two different ones"
    return out


def script_after(last: int, reply: str, end: int) -> dict[int, int]:
    """A script that answers ``reply`` then ``end`` after token ``last``."""
    return script([last] + sp_ids(reply) + [end])


def scripted_llama(vocab_size: int, script: dict[int, int], seed: int = 0):
    """A Llama that, greedily, writes ``script[t]`` after token ``t`` (see the module docstring)."""
    model, config = build_random_llama(LlamaShape(vocab_size=vocab_size, **SHAPE), seed=seed)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    emb = model.model.embed_tokens.weight
    head = mx.zeros((vocab_size, emb.shape[1]))
    for a, b in script.items():
        head[b] = 10 * emb[a] / mx.sqrt(mx.mean(emb[a] * emb[a]))  # RMS-normed, as the model's final norm does
    model.lm_head.weight = head
    mx.eval(model.parameters())
    return model, config


def legacy_chat_folder(dest: Path, script: dict[int, int]) -> Path:
    """The early mlx-community layout (as mlx-community/Llama-2-7b-chat-4-bit): weights.npz,
    a legacy config.json and the real Llama 2 tokenizer.model; ``dest``'s name is the model id."""
    from tests.test_loader import to_legacy_names

    model, _ = scripted_llama(32000, script)
    dest.mkdir(parents=True)
    mx.savez(str(dest / "weights.npz"), **to_legacy_names(dict(tree_flatten(model.parameters()))))
    (dest / "config.json").write_text(json.dumps({
        "dim": SHAPE["hidden_size"], "n_layers": SHAPE["num_hidden_layers"], "n_heads": SHAPE["num_attention_heads"],
        "multiple_of": 32, "norm_eps": 1e-05, "vocab_size": -1}))
    shutil.copyfile(llama2_tokenizer_model(), dest / "tokenizer.model")
    return dest


def chatml_folder(dest: Path, script: dict[int, int]) -> Path:
    """An mlx-lm folder whose tokenizer is Llama 2's plus <|im_start|> and <|im_end|> (ids 32000
    and 32001, as ChatML fine-tunes of Llama and Mistral add them), with no chat template."""
    from transformers import LlamaTokenizer

    from chatapp.model.loader import save_model_dir

    src = dest.parent / f"{dest.name}-tokenizer"
    src.mkdir(parents=True)
    shutil.copyfile(llama2_tokenizer_model(), src / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(str(src))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.save_pretrained(str(src))
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START, IM_END]
    model, config = scripted_llama(32002, script)
    return save_model_dir(dest, model, config, src)
