"""What the fused steps read of each decoder layer (backend/fused_decode.py): the seven
projections as packed host views, the norms, each layer's RoPE frequencies, and the extras some
architectures add (Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k norms, Gemma 3's
sandwich norms and the +1 its norms add to their weights), as the kernels take them."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .fused_support import (
    BIASED,
    PROJECTIONS,
    QK_NORMS,
    SANDWICH,
    WIDENED_BITS,
    attention_head_dim,
    norm_weights,
    rope_frequencies,
)


@dataclass
class FusedLayer:
    # 7 x (packed, scales, biases) numpy views; biases [N, 0] where symmetric (kernels/affine.py:
    # GGUF Q4_0's -8 x scale in every group, which a decoded token then does not read)
    weights: tuple
    bits: np.ndarray
    attn_norm: np.ndarray
    mlp_norm: np.ndarray
    eps: np.float32
    # the q, k and v projections' biases concatenated (Qwen2), float32 [nq + nk + nv]; [0]: none
    qkv_bias: np.ndarray
    # the per-head RMSNorm weights of the queries then the keys (Qwen3), float32 [2 * D]; [0]: none
    qk_norm: np.ndarray
    # the sandwich norms' weights (Gemma 3): the attention output's then the MLP output's, float32
    # [2 * dim]; [0]: none (mlp_norm is then the pre-feed-forward norm)
    post_norm: np.ndarray
    # RoPE frequencies of this layer's attention [D / 2] (Gemma 3: local and global bases differ)
    inv_freq: np.ndarray


def _qkv_bias(attn) -> np.ndarray:
    parts = [attn[name].get("bias") for name in BIASED]
    if all(b is None for b in parts):
        return np.empty(0, np.float32)
    rows = [attn[name].weight.shape[0] for name in BIASED]
    out = [np.zeros(n, np.float32) if b is None else np.asarray(b.astype(mx.float32)) for b, n in zip(parts, rows)]
    return np.concatenate(out).astype(np.float32)


def _qk_norm(attn, eps: float) -> np.ndarray:
    norms = [attn.get(name) for name in QK_NORMS]
    if all(n is None for n in norms):
        return np.empty(0, np.float32)
    if any(n is None or float(n.eps) != float(eps) for n in norms):
        raise ValueError("fused decode: q/k norms of their own eps, or only one of them")
    return np.concatenate([read_norm(n) for n in norms]).astype(np.float32)


def packed_weights(m) -> tuple:
    """The packed host views the kernels read of a quantised module; a 3-, 5- or 6-bit weight
    (WIDENED_BITS) widened to one byte a value, scales and biases as they are (exact)."""
    from .qlinear import packed_view

    if m.bits in WIDENED_BITS:
        return packed_view(widened(m), m["scales"], m["biases"], 8, m.group_size)
    route = getattr(m, "routing", None)
    pw = route.packed if route is not None and route.packed is not None else \
        packed_view(m["weight"], m["scales"], m["biases"], m.bits, m.group_size)
    return pw


def widened(m) -> np.ndarray:
    """A 3/5/6-bit weight's quants (0 .. 2^bits - 1) as bytes [out, in], made once at load: the
    8-bit kernels then read it as they read Q8_0, with the module's own scales and biases. MLX
    packs these widths as a bit stream across words, which no kernel here reads in place; a byte
    a value costs 8 / bits of the packed bytes (1.6x for 5 bits) and is still no float copy.
    Unpacked natively (kernels/bitstream.py): mx.dequantize with unit scales took 1.36 s of
    SmolLM2 Q4_K_M's 3.3 s load."""
    from chatapp.kernels.bitstream import unpack_bits

    w = m["weight"]
    mx.eval(w)
    return unpack_bits(np.asarray(w).view(np.uint8), m.bits)


def read_norm(m: nn.Module) -> np.ndarray:
    """The norm's weights as the kernels apply them (fused_support.norm_weights: Gemma's +1 in)."""
    w = norm_weights(m)
    if isinstance(w, str):
        raise ValueError(f"fused decode: {w}")
    return w


def read_layer(layer) -> FusedLayer:
    """One decoder layer as the kernels read it (fused_support.fused_unsupported accepted it)."""
    from chatapp.kernels.affine import drop_symmetric_biases

    pws = [packed_weights(layer[p][n]) for p, n in PROJECTIONS]
    eps = layer["input_layernorm"].eps
    if layer["post_attention_layernorm"].eps != eps:
        raise ValueError("fused decode: the two norms of a layer use different eps")
    attn = layer["self_attn"]
    if layer.get(SANDWICH[0]) is not None:  # Gemma: norms before and after the attention and the MLP
        mlp_norm = read_norm(layer[SANDWICH[0]])
        post = np.concatenate([read_norm(layer["post_attention_layernorm"]), read_norm(layer[SANDWICH[1]])])
    else:
        mlp_norm, post = read_norm(layer["post_attention_layernorm"]), np.empty(0, np.float32)
    inv_freq = rope_frequencies(attn.rope, attention_head_dim(attn))
    if isinstance(inv_freq, str):
        raise ValueError(f"fused decode: {inv_freq}")
    return FusedLayer(
        tuple(drop_symmetric_biases(pw.packed, pw.scales, pw.biases, pw.bits) for pw in pws),
        np.array([pw.bits for pw in pws], np.int64),
        read_norm(layer["input_layernorm"]), mlp_norm,
        np.float32(eps), _qkv_bias(attn), _qk_norm(attn, eps), post.astype(np.float32), inv_freq)
