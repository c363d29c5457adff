"""The early mlx-community layout (mlx-examples' ``llms/llama``): ``weights.npz`` + SentencePiece.

Repos such as ``mlx-community/Llama-2-7b-chat-4-bit`` hold ``weights.npz`` (or ``weights.NN.npz``
shards) in the layout of mlx-examples' ``llms/llama/llama.py``, a small config with
``dim``/``n_layers``/... keys and a SentencePiece ``tokenizer.model``. mlx-lm refuses those ("No
safetensors found"); here their weights are renamed onto mlx-lm's Llama and the tokenizer is
built from ``tokenizer.model``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from chatapp.model.modelfiles import ModelLoadError, one_line, read_config
from chatapp.model.npz_direct import read_npz
from chatapp.model.spm_rules import SPM_WORDS, score_ordered_merges

__all__ = ["legacy_config_to_mlx", "legacy_weight_name", "load_legacy_model", "load_legacy_tokenizer"]

_LEGACY_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LEGACY_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LEGACY_SUFFIXES = ("weight", "scales", "biases", "bias")
_LEGACY_MODEL_TYPES = (None, "", "llama", "mistral")  # same layout in mlx-examples
_LEGACY_IGNORED = re.compile(r"(^|\.)rope\.freqs$|\.inner_attention\.rope\.freqs$")


def legacy_weight_name(name: str) -> str | None:
    """The mlx-lm Llama name of a legacy mlx-examples weight (None if it has none)."""
    module, _, suffix = name.rpartition(".")
    if suffix not in _LEGACY_SUFFIXES:
        return None
    if module in _LEGACY_TOP_MAP:
        return f"{_LEGACY_TOP_MAP[module]}.{suffix}"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
    if m and m.group(2) in _LEGACY_LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LEGACY_LAYER_MAP[m.group(2)]}.{suffix}"
    return None


def legacy_config_to_mlx(legacy: dict, weights: dict[str, mx.array]) -> dict:
    """An mlx-lm ``llama`` config for a legacy mlx-examples config.

    Defaults follow mlx-examples' llama.py ``sanitize_config``/``ModelArgs``: n_kv_heads =
    n_heads, head_dim = dim // n_heads, hidden_dim from w1's rows, vocab_size (when absent or
    -1, as in Meta's params.json) from the embedding rows, rope_theta 10000 and traditional
    (adjacent-pair) RoPE.
    """
    try:
        dim = int(legacy["dim"])
        n_layers = int(legacy["n_layers"])
        n_heads = int(legacy["n_heads"])
    except KeyError as err:
        raise ModelLoadError(f"legacy config.json lacks {err.args[0]!r}") from err
    hidden_dim = legacy.get("hidden_dim")
    if hidden_dim is None:
        w1 = weights.get("layers.0.feed_forward.w1.weight")
        if w1 is None:
            raise ModelLoadError("legacy config.json lacks 'hidden_dim' and the weights have no feed_forward.w1")
        hidden_dim = w1.shape[0]
    vocab_size = legacy.get("vocab_size", -1)
    if vocab_size is None or int(vocab_size) < 0:
        emb = weights.get("tok_embeddings.weight")
        if emb is None:
            raise ModelLoadError("legacy config.json has no vocab_size and the weights no tok_embeddings")
        vocab_size = emb.shape[0]
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": dim,
        "num_hidden_layers": n_layers,
        "intermediate_size": int(hidden_dim),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(legacy.get("n_kv_heads") or n_heads),
        "head_dim": int(legacy.get("head_dim") or dim // n_heads),
        "rms_norm_eps": float(legacy.get("norm_eps", 1e-5)),
        "vocab_size": int(vocab_size),
        "rope_theta": float(legacy.get("rope_theta", 10000)),
        "rope_traditional": bool(legacy.get("rope_traditional", True)),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for key in ("max_position_embeddings", "max_seq_len", "max_sequence_length"):
        if legacy.get(key):
            config["max_position_embeddings"] = int(legacy[key])
            break
    if legacy.get("rope_scaling"):
        config["rope_scaling"] = legacy["rope_scaling"]
    if legacy.get("quantization"):
        config["quantization"] = dict(legacy["quantization"])
    config["legacy_config"] = dict(legacy)
    return config


def load_legacy_model(path: Path, files: list[Path], where: str) -> tuple[nn.Module, dict]:
    """mlx-lm's Llama with the weights of a legacy folder (quantised layers as stored), and its config."""
    from mlx_lm.models import llama

    legacy = read_config(path, where)
    model_type = legacy.get("model_type")
    if model_type not in _LEGACY_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in legacy-npz folder {where}: only the "
            "Llama/Mistral layout of mlx-examples can be read"
        )
    raw: dict[str, mx.array] = {}
    for file in files:
        # read straight into the arrays when the npz is uncompressed (no transient copy); else mx.load
        direct = read_npz(file)
        raw.update(direct if direct is not None else mx.load(str(file)))
    config = legacy_config_to_mlx(legacy, raw)

    weights: dict[str, mx.array] = {}
    unknown = []
    for name, value in raw.items():
        if _LEGACY_IGNORED.search(name):
            continue
        new = legacy_weight_name(name)
        if new is None:
            unknown.append(name)
        else:
            weights[new] = value
    if unknown:
        raise ModelLoadError(
            f"{where}: weights.npz has tensors the legacy Llama layout does not know: {', '.join(sorted(unknown)[:4])}"
        )

    model = llama.Model(llama.ModelArgs.from_dict(config))
    quantized = {name[: -len(".scales")] for name in weights if name.endswith(".scales")}
    if quantized:
        modules = dict(model.named_modules())

        def params_for(p: str, m: nn.Module):
            if p not in quantized or not hasattr(m, "to_quantized"):
                return False
            in_dims = modules[p].weight.shape[-1]
            group_size = in_dims // weights[f"{p}.scales"].shape[-1]
            bits = weights[f"{p}.weight"].shape[-1] * 32 // in_dims
            return {"group_size": group_size, "bits": bits}

        q = config.get("quantization") or {}
        nn.quantize(model, group_size=q.get("group_size", 64), bits=q.get("bits", 4), class_predicate=params_for)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise ModelLoadError(
            f"{where}: legacy weights do not fit the model its config describes: {one_line(err)}") from err
    return model, config


_SPM_NORMAL = 1  # ModelProto.SentencePiece.Type.NORMAL


def _score_ordered_merges(proto) -> list[tuple[str, str]]:
    """BPE merges ranked as SentencePiece applies them (chatapp.model.spm_rules)."""
    return score_ordered_merges({p.piece: (i, p.score) for i, p in enumerate(proto.pieces) if p.type == _SPM_NORMAL})


def _exact_sentencepiece(backend, model_file: Path) -> None:
    """Make a converted fast tokenizer encode exactly as SentencePiece does.

    SentencePiece normalises (remove_extra_whitespaces strips and collapses spaces; the "▁" dummy
    prefix goes before every string, even one starting with a space; spaces become "▁"), splits
    the text into whitespace-led words and runs BPE on each by piece score. The conversion
    prepends the dummy prefix only where the text does not already start with a space, runs BPE
    over the whole text, and ranks merges by piece id; each of those changes ids (Llama 2:
    " Hello", "a  b"). Unigram models keep the conversion's model.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import Regex, models, normalizers, pre_tokenizers

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    steps = [backend.normalizer] if backend.normalizer is not None else []  # a precompiled charsmap
    if spec.remove_extra_whitespaces:
        # Only the space character counts here (a newline or tab at either end is kept).
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    if trainer.split_by_whitespace and not trainer.treat_whitespace_as_suffix:
        words = Regex(SPM_WORDS[bool(trainer.allow_whitespace_only_pieces)])
        backend.pre_tokenizer = pre_tokenizers.Split(words, behavior="isolated")
    else:
        backend.pre_tokenizer = None
    if trainer.model_type == sentencepiece_model_pb2.TrainerSpec.BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        backend.model = models.BPE(vocab, _score_ordered_merges(proto), unk_token=trainer.unk_piece,
                                   fuse_unk=True, byte_fallback=trainer.byte_fallback)


def load_legacy_tokenizer(path: Path, eos_token_ids=None):
    """A TokenizerWrapper built from a bare SentencePiece ``tokenizer.model``.

    transformers converts it into a fast Llama tokenizer (BOS added, as mlx-examples did by
    hand, special tokens, decoder); its normaliser, pre-tokeniser and merges are then rebuilt
    from the SentencePiece model so that token ids are identical to SentencePiece's (see
    :func:`_exact_sentencepiece`).
    """
    from mlx_lm import tokenizer_utils as tu
    from transformers import LlamaTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = LlamaTokenizer.from_pretrained(str(path), add_bos_token=True, add_eos_token=False)
    finally:
        hf_logging.set_verbosity(verbosity)
    backend = tokenizer.backend_tokenizer
    _exact_sentencepiece(backend, path / "tokenizer.model")

    detokenizer_class = tu.NaiveStreamingDetokenizer
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
        if tu._is_spm_decoder(decoder):
            detokenizer_class = tu.SPMStreamingDetokenizer
        elif tu._is_spm_decoder_no_space(decoder):
            from functools import partial

            detokenizer_class = partial(tu.SPMStreamingDetokenizer, trim_space=False)
    except AttributeError:  # mlx-lm renamed its decoder checks: the naive detokenizer is always right
        pass
    return tu.TokenizerWrapper(tokenizer, detokenizer_class, eos_token_ids=eos_token_ids)
