"""The GGUF architectures chatapp reads, each mapped onto one of mlx-lm's own model classes:
tensor names, the config.json keys its metadata becomes, and what llama.cpp's converter did to
the tensors that has to be undone.

* ``llama`` -> mlx-lm ``llama``: attn_q/attn_k rows were permuted for llama.cpp's interleaved
  RoPE (undone in gguf.py). ``rope_freqs`` (Llama 3.1/3.2's per-frequency divisors) is matched
  against the ``llama3`` RoPE scaling rule and becomes mlx-lm's ``rope_scaling`` config.
* ``qwen2`` -> mlx-lm ``qwen2`` (q/k/v biases), ``qwen3`` -> mlx-lm ``qwen3`` (q/k RMSNorms): their
  RoPE is rotate-half in llama.cpp too, so no rows were permuted; the vocabulary is gpt2 BPE with
  the ``qwen2`` pre-tokenizer (gguf_tokenizer.py).
* ``gemma3`` -> mlx-lm ``gemma3_text``: the converter added 1 to every RMSNorm weight (ggml's
  norm multiplies by the weight; Gemma's by 1 + weight), so 1 is subtracted again; ``ffn_norm``
  is Gemma's pre-feed-forward norm; llama.cpp fixes the sliding layers' RoPE base at 10,000 and
  the pattern at 5 sliding layers to 1 global (unless the file says otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .gguf_file import GGUFError, GGUFHeader

LLAMA_LAYERS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
GEMMA3_LAYERS = {
    **LLAMA_LAYERS, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
QWEN3_LAYERS = {**LLAMA_LAYERS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def meta(header: GGUFHeader, key: str, default: Any = None) -> Any:
    return header.get(f"{header.architecture}.{key}", default)


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture and the mlx-lm model it becomes."""

    name: str  # general.architecture
    model_type: str  # mlx-lm's
    what: str  # for the refusal that lists what is read
    layers: dict[str, str]
    permuted: bool = False  # attn_q/attn_k rows in llama.cpp's interleaved order
    norm_shift: float = 0.0  # subtracted from every *norm.weight
    extra: Callable[[GGUFHeader, dict], dict] = field(default=lambda header, config: {})
    extra_tensors: tuple[str, ...] = ()  # tensors read into the config, not the model


def _gemma3(header: GGUFHeader, config: dict) -> dict:
    layers = config["num_hidden_layers"]
    out = {
        "rope_local_base_freq": float(meta(header, "rope.local.freq_base", 10000.0)),
        "sliding_window": int(meta(header, "attention.sliding_window", 4096)),
        "sliding_window_pattern": int(meta(header, "attention.sliding_window_pattern", 6)),
        # llama.cpp: 1/sqrt(head_dim), but 1/sqrt(hidden/heads) for the 27B (62 layers)
        "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"] if layers == 62
                                  else config["head_dim"]),
    }
    if meta(header, "rope.scaling.type") == "linear" and meta(header, "rope.scaling.factor"):
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(meta(header, "rope.scaling.factor"))}
    return out


ARCHITECTURES = {
    "llama": Arch("llama", "llama", "Llama 2/3, SmolLM, Mistral-style", LLAMA_LAYERS, permuted=True,
                  extra_tensors=("rope_freqs.weight",)),
    "qwen2": Arch("qwen2", "qwen2", "Qwen 2/2.5", LLAMA_LAYERS),  # q/k/v biases: attn_*.bias
    "qwen3": Arch("qwen3", "qwen3", "Qwen 3", QWEN3_LAYERS),
    "gemma3": Arch("gemma3", "gemma3_text", "Gemma 3 text", GEMMA3_LAYERS, norm_shift=1.0, extra=_gemma3),
}


def arch_of(header: GGUFHeader, where: str) -> Arch:
    arch = ARCHITECTURES.get(header.architecture)
    if arch is None:
        known = ", ".join(f"{a.name} ({a.what})" for a in ARCHITECTURES.values())
        raise GGUFError(f"unsupported GGUF architecture {header.architecture or 'none'!r} in {where}: chatapp "
                        f"reads {known} files")
    return arch


def llama3_rope_scaling(factors: list[float], base: float, dims: int, header: GGUFHeader, where: str) -> dict | None:
    """``rope_freqs`` (one divisor per rotary frequency) as mlx-lm's ``llama3`` rope_scaling config:
    the factor is the largest divisor; low/high frequency factors and the original context are
    the metadata's or Llama 3's (1, 4, 8192). GGUFError where the divisors follow another rule."""
    import math

    factor = max(factors)
    if factor == 1.0 and min(factors) == 1.0:
        return None
    low = float(meta(header, "rope.scaling.low_freq_factor", 1.0))
    high = float(meta(header, "rope.scaling.high_freq_factor", 4.0))
    old = int(meta(header, "rope.scaling.original_context_length", 8192))
    want = []
    for i in range(0, dims, 2):  # what llama.cpp's converter computes from the llama3 config
        wavelen = 2 * math.pi * base ** (i / dims)
        if wavelen < old / high:
            want.append(1.0)
        elif wavelen > old / low:
            want.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            want.append(1 / ((1 - smooth) / factor + smooth))
    if len(want) != len(factors) or any(abs(a - b) > 1e-4 * b for a, b in zip(factors, want)):
        raise GGUFError(f"{where}: its rope_freqs do not follow Llama 3's RoPE scaling rule, which is the "
                        "one chatapp maps; use the model's MLX conversion")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old}
