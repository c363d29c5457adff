"""Open a GGUF file as an mlx-lm model: config from the metadata, tensors mapped onto mlx-lm's
own classes for its architecture (gguf_arch.py: llama, qwen2, qwen3, gemma3), weights kept packed.

Q4_0/Q4_1/Q8_0 tensors come out of ``mx.load`` already in MLX's affine layout (packed uint32
words plus float16 scales and biases, group 32), so each quantised matrix becomes an
``nn.QuantizedLinear``/``QuantizedEmbedding`` with that group size and its own bit width (a
per-layer quantisation config: SmolLM2's embedding is Q8_0, its matrices Q4_1). No float copy of
a quantised weight is made. F32/F16/BF16 tensors load as they are.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` within each head, pairing
rotary dimensions (2i, 2i+1) for its interleaved RoPE. Here the permutation is undone (weight,
scales and biases together: a reorder of whole rows, which never touches a quantisation group),
so the model is mlx-lm's Llama with its usual rotate-half RoPE: the same layout as the Hugging
Face checkpoint the file came from. tests/test_gguf.py proves it against an unpermuted model.

Q5_0/Q5_1 and the K-quants Q4_K/Q5_K/Q6_K are repacked once at load into the same affine layout
(gguf_kquants.py; Q6_K as 8-bit, not exact). Other tensor types (IQ-quants, Q2_K, Q3_K, ...) are
refused in one line: dequantising them would make float copies several times the file's size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .gguf_arch import ARCHITECTURES, LLAMA_LAYERS, TOP_NAMES, Arch, arch_of, llama3_rope_scaling
from .gguf_file import (
    QUANT_BITS,
    REPACKED_BITS,
    GGUFError,
    GGUFHeader,
    TensorInfo,
    mlx_bits,
    read_header,
    unreadable_types,
)
from .gguf_tokenizer import build_tokenizer, check_vocabulary, vocab_summary

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
GROUP_SIZE = 32  # every block quant MLX reads has blocks of 32
LAYER_NAMES = LLAMA_LAYERS  # (llama's: the names the tests' writer maps back)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SUFFIXES = (".weight", ".scales", ".biases", ".bias")


@dataclass
class GGUFModel:
    """What :func:`load_gguf` gives the engine's loader."""

    model: Any  # nn.Module (mlx-lm's llama Model)
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict
    header: GGUFHeader
    notes: list[str] = field(default_factory=list)


def module_path(gguf_name: str, arch: Arch = ARCHITECTURES["llama"]) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; GGUFError for a name
    that has no place in the architecture's model."""
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in arch.layers:
        return f"model.layers.{m.group(1)}.{arch.layers[m.group(2)]}.{m.group(3)}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in TOP_NAMES and suffix in ("weight", "bias"):
        return f"{TOP_NAMES[base]}.{suffix}"
    raise GGUFError(f"tensor {gguf_name!r} has no place in a {arch.name} model")


def _meta(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.get(f"{header.architecture}.{key}", default)


def check_header(header: GGUFHeader, where: str) -> None:
    """Everything that makes a file unusable, said in one line before any tensor is read."""
    spec = arch_of(header, where)
    arch = header.architecture
    other = unreadable_types(header)
    if other:
        kinds = ", ".join(f"{name} ({n} tensors)" for name, n in sorted(other.items()))
        raise GGUFError(f"{where} holds {kinds}, which chatapp does not read: use a GGUF of the model in "
                        f"{', '.join(READS)}, or its MLX conversion")
    names = {t.name for t in header.tensors}
    for key in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length"):
        if _meta(header, key) is None:
            raise GGUFError(f"{where} is missing {arch}.{key} in its metadata")
    if "token_embd.weight" not in names:
        raise GGUFError(f"{where} has no token_embd.weight tensor")
    for t in header.tensors:
        if t.name in spec.extra_tensors:
            continue
        try:
            module_path(t.name, spec)
        except GGUFError as err:
            raise GGUFError(f"{where}: {err}") from None
    check_vocabulary(header, where)


READS = (*QUANT_BITS, *REPACKED_BITS, "F16", "BF16", "F32")  # the block types read, for the refusals


def _quant(t: TensorInfo) -> dict | None:
    bits = mlx_bits(t.type_name)
    return {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine"} if bits else None


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(f"{float(x):.7g}")


def _extra_tensor(header: GGUFHeader, name: str) -> list[float] | None:
    """A small F32 tensor (rope_freqs) read straight from the file, for the config."""
    import numpy as np

    t = next((t for t in header.tensors if t.name == name), None)
    if t is None:
        return None
    if t.type_name != "F32":
        raise GGUFError(f"{header.path.name}: {name} is {t.type_name}, not F32")
    return np.fromfile(header.path, np.float32, t.n_elements, offset=header.data_offset + t.offset).tolist()


def config_from_header(header: GGUFHeader) -> dict:
    """An mlx-lm/Hugging Face style config.json from the file's metadata, for the architecture's
    mlx-lm model."""
    spec = arch_of(header, header.path.name)
    heads = int(_meta(header, "attention.head_count"))
    hidden = int(_meta(header, "embedding_length"))
    tokens = header.get("tokenizer.ggml.tokens") or []
    infos = {t.name: t for t in header.tensors}
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(header, "block_count")),
        "intermediate_size": int(_meta(header, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(header, "attention.head_count_kv", heads)),
        "head_dim": int(_meta(header, "attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(_meta(header, "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(_meta(header, "rope.freq_base", 10000.0)),
        "rope_traditional": False,  # attn_q/attn_k rows are un-permuted on load
        "max_position_embeddings": int(_meta(header, "context_length", 2048)),
        "vocab_size": int(_meta(header, "vocab_size", len(tokens) or infos["token_embd.weight"].shape[-1])),
        "tie_word_embeddings": "output.weight" not in infos,
        "attention_bias": "blk.0.attn_q.bias" in infos,
        "mlp_bias": "blk.0.ffn_up.bias" in infos,
    }
    if _meta(header, "rope.scaling.type") == "linear" and _meta(header, "rope.scaling.factor"):
        config["rope_scaling"] = {"type": "linear", "factor": float(_meta(header, "rope.scaling.factor"))}
    freqs = _extra_tensor(header, "rope_freqs.weight") if "rope_freqs.weight" in spec.extra_tensors else None
    if freqs is not None:
        scaling = llama3_rope_scaling(freqs, config["rope_theta"], config["head_dim"], header, header.path.name)
        if scaling:
            config["rope_scaling"] = scaling
    config.update(spec.extra(header, config))
    for key in ("bos", "eos"):
        if header.get(f"tokenizer.ggml.{key}_token_id") is not None:
            config[f"{key}_token_id"] = int(header.get(f"tokenizer.ggml.{key}_token_id"))
    quant: dict[str, Any] = {}
    for t in header.tensors:
        q = _quant(t)
        if q is not None and t.name.endswith(".weight"):
            quant[module_path(t.name, spec)[: -len(".weight")]] = q
    if quant:
        bits = sorted((q["bits"] for q in quant.values()), key=[q["bits"] for q in quant.values()].count)[-1]
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": bits, "mode": "affine", **quant}
    return config


def _unpermute(w, n_heads: int):
    """Undo llama.cpp's row order (per head: rotary pairs interleaved) for rotate-half RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(config: dict) -> dict[str, int]:
    """The tensors whose rows llama.cpp permuted, and the head count each permutation ran over
    (none but in a llama file: the others' RoPE is rotate-half in llama.cpp too)."""
    if config["model_type"] != "llama":
        return {}
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}


def row_orders(header: GGUFHeader, config: dict) -> dict:
    """For each permuted tensor (attn_q/attn_k weights and biases): the row each of its rows goes
    to (int64 numpy arrays), so that reading row i into row ``order[i]`` does what
    :func:`_unpermute` does."""
    import numpy as np

    heads = _heads(config)
    out = {}
    for t in header.tensors:
        base = next((t.name[: -len(s)] for s in _SUFFIXES if t.name.endswith(s)), t.name)
        n_heads = heads.get(base.rsplit(".", 1)[-1])
        if n_heads:
            rows = int(t.shape[-1])  # ggml order: the outermost axis last
            src_of_dst = np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).swapaxes(1, 2).reshape(-1)
            order = np.empty(rows, np.int64)
            order[src_of_dst] = np.arange(rows)
            out[t.name] = order
    return out


def map_weights(raw: dict, config: dict, unpermuted: bool = False, arch: Arch = ARCHITECTURES["llama"]) -> dict:
    """``mx.load``'s GGUF tensors -> mlx-lm parameter names, q/k rows un-permuted (unless
    ``unpermuted``: read in their order already, gguf_tensors.py), norms shifted back."""
    heads = {} if unpermuted else _heads(config)
    out = {}
    for name, arr in raw.items():
        if name in arch.extra_tensors:
            continue
        base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
        suffix = name[len(base):]
        if suffix in (".weight", ".bias"):
            target = module_path(name, arch)
        else:  # .scales/.biases of a quantised tensor belong to its module
            target = module_path(base + ".weight", arch)[: -len(".weight")] + suffix
        kind = base.rsplit(".", 1)[-1]
        if kind in heads:
            arr = _unpermute(arr, heads[kind])
        if arch.norm_shift and name.endswith("norm.weight"):
            arr = arr - arch.norm_shift  # (1 + w) - 1 is exact for float32 weights near 1
        out[target] = arr
    return out


def layouts_line(header: GGUFHeader) -> str:
    """'Q4_K -> 4-bit g32 fp32 scales, exact; Q6_K -> 8-bit g32 ... (requantised, not exact)': what
    each block type of the file became in MLX."""
    from .gguf_kquants import LAYOUTS

    parts = []
    for name in sorted(header.type_counts, key=lambda n: (-header.type_counts[n], n)):
        if name in QUANT_BITS:  # mx.load's own mapping: fp16 scales, the block's own values
            parts.append(f"{name} -> {QUANT_BITS[name]}-bit g{GROUP_SIZE} fp16 scales, exact")
        elif name in LAYOUTS:
            lay = LAYOUTS[name]
            parts.append(f"{name} -> {lay.describe()}" + (", exact" if lay.exact else ""))
    return "; ".join(parts)


def describe(header: GGUFHeader) -> list[str]:
    """What the file is and what loading it did, for --verbose, the TUI's notes and --show-config."""
    quantised = sum(n for name, n in header.type_counts.items() if mlx_bits(name))
    return [
        f"GGUF file: {header.path} ({header.get('general.name', '?')}, {header.architecture}, GGUF v{header.version})",
        f"GGUF tensors: {header.types_line()}" + (f" (as MLX: {layouts_line(header)})" if quantised else ""),
        f"GGUF conversion: {quantised} block-quantised tensors kept packed as MLX affine group-{GROUP_SIZE} "
        "weights (no float copy); "
        + ("attn_q/attn_k rows un-permuted for rotate-half RoPE; " if arch_of(header, "").permuted else "")
        + (f"norm weights less {arch_of(header, '').norm_shift:g} (Gemma's 1 + w); "
           if arch_of(header, "").norm_shift else "")
        + (f"RoPE scaling {config_from_header(header)['rope_scaling'].get('rope_type', 'linear')}; "
           if "rope_scaling" in config_from_header(header) else "")
        + ("output tied to the embedding; " if "output.weight" not in {t.name for t in header.tensors} else "")
        + f"tokenizer built from the metadata ({vocab_summary(header)})"
        + ("; chat template from the file" if header.get("tokenizer.chat_template") else "; no chat template"),
    ]


def open_gguf(path: str | Path) -> GGUFHeader:
    """The file's header, checked (architecture, tensor types, names, vocabulary): GGUFError else."""
    header = read_header(path)
    check_header(header, Path(path).name)
    return header


def load_gguf(path: str | Path) -> GGUFModel:
    """mlx-lm's llama model, its tokenizer and config from a GGUF file (parameters lazy, unevaluated)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    from .gguf_tensors import can_read, read_tensors

    where = Path(path).name
    header = open_gguf(path)
    spec = arch_of(header, where)
    config = config_from_header(header)
    tokenizer = build_tokenizer(header, where)
    direct = can_read()
    repacked = sorted(set(header.type_counts) & set(REPACKED_BITS))
    if not direct and repacked:
        raise GGUFError(f"{where} holds {', '.join(repacked)} blocks, which chatapp repacks with its CPU kernels' "
                        "numba, not installed here: use a Q4_0, Q4_1, Q8_0 or F16 GGUF, or the MLX conversion")
    if direct:  # one tensor at a time, rows un-permuted as they are read: no mapped file, no copies
        raw = read_tensors(header, row_orders(header, config))
    else:
        try:
            raw = mx.load(str(path))
        except Exception as err:  # noqa: BLE001 - the header was fine but the data is not
            raise GGUFError(f"cannot read the tensors of {where}: {type(err).__name__}: {err}") from err
    weights = map_weights(raw, config, unpermuted=direct, arch=spec)
    del raw
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if hasattr(model, "sanitize"):  # mlx-lm's own: ties the output (gemma3_text drops its lm_head)
        weights = model.sanitize(weights)
    quant = config.get("quantization", {})
    if quant:
        nn.quantize(model,
                    class_predicate=lambda p, m: quant.get(p, False) if isinstance(quant.get(p), dict) else False)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise GGUFError(f"{where}: its tensors do not fit the model its metadata describes: "
                        f"{str(err).splitlines()[0]}") from err
    return GGUFModel(model, tokenizer, config, header, describe(header))
