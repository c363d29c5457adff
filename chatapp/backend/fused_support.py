"""What the fused native steps serve (backend/fused_decode.py): the models whose decoder layers
are exactly Llama's math, and the caches whose buffers the kernels read in place; each says why
not in one phrase, for the plan, --verbose and the route line."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .fused_settings import KV_HOST

# model types whose code around the layers' modules is known (mlx-lm's granite and minicpm hold
# Llama's modules but scale the embedding, the residuals and the logits in their code, which no
# module shows): Llama's block, and gemma3_text's (its embedding times sqrt(hidden) rounded to
# bfloat16: embed_scale). What the layers compute inside their modules (biases, q/k norms, the
# norms' +1 offset, sandwich norms, the MLP's activation, each layer's RoPE) is read from the
# modules themselves, by what they compute (norm_weights, mlp_activation)
FUSED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
BIASED = ("q_proj", "k_proj", "v_proj")  # the projections whose biases the kernels add
QK_NORMS = ("q_norm", "k_norm")  # per-head RMSNorms of the queries and keys before RoPE (Qwen3)
# Gemma's sandwich norms: the MLP's input norm and its output's (both or neither); with them
# post_attention_layernorm norms the attention's output before it is added
SANDWICH = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# a decoder layer's modules, its attention's and its MLP's, exactly (the q/k norms both or
# neither, the sandwich norms both or neither): any other computes something the kernels do not
LAYER_MODULES = {"": {"input_layernorm", "post_attention_layernorm", "self_attn", "mlp", *SANDWICH},
                 "self_attn": {"q_proj", "k_proj", "v_proj", "o_proj", "rope", *QK_NORMS},
                 "mlp": {"gate_proj", "up_proj", "down_proj"}}


def embed_scale(model: nn.Module) -> np.float32 | None:
    """What the model's code multiplies the token embeddings by (None: nothing): Gemma 3's
    sqrt(hidden), which mlx-lm rounds to bfloat16 before the product."""
    args = getattr(model, "args", None)
    if getattr(args, "model_type", None) != "gemma3_text":
        return None
    return np.float32(mx.array(args.hidden_size ** 0.5, mx.bfloat16).astype(mx.float32).item())


def norm_weights(m) -> np.ndarray | str:
    """The per-element weights w of an RMS norm as the kernels apply it (x / rms(x) * w, float32),
    read from what the module computes on a probe: nn.RMSNorm's weight, or Gemma's 1 + weight
    (computed as MLX computes it, in the weight's dtype); else why not."""
    w, eps = getattr(m, "weight", None), getattr(m, "eps", None)
    if not isinstance(w, mx.array) or w.ndim != 1 or eps is None:
        return f"{type(m).__name__} is not an RMS norm"
    n = w.shape[0]
    x = np.sin(np.arange(1, n + 1, dtype=np.float32) * np.float32(0.37)).astype(np.float32)[None]
    try:
        y = np.array(m(mx.array(x)).astype(mx.float32))
    except Exception as e:  # noqa: BLE001 - a module that does not take a row: not a norm
        return f"{type(m).__name__} is not an RMS norm ({type(e).__name__})"
    r = x / np.sqrt(np.mean(x * x) + np.float32(eps))
    best, best_err = None, np.inf
    for cand in (w, 1.0 + w):
        c = np.array(cand.astype(mx.float32))
        want = r * c
        if y.shape != want.shape:
            continue
        # each element's relative error (half-precision weights round ~4e-3): a norm whose
        # weights are large (Gemma 3's final norm: tens) differs from the other candidate by
        # only 1/w, so the nearer one wins, and it must be near
        err = float(np.max(np.abs(y - want) / (np.abs(want) + 1e-3 * float(np.abs(want).max()) + 1e-12)))
        if err < best_err:
            best, best_err = c, err
    if best is None or best_err > 1e-2:
        return f"{type(m).__name__} computes something other than an RMS norm"
    return best.astype(np.float32)


class _Fixed(nn.Module):
    def __init__(self, out: mx.array):
        super().__init__()
        self.out = out

    def __call__(self, x):
        return self.out


class _Identity(nn.Module):
    def __call__(self, x):
        return x


def mlp_activation(mlp) -> str:
    """"silu" or "gelu" (its tanh approximation, MLX's nn.gelu_approx): what the MLP computes
    of gate and up, found by running its own code with gate giving a ramp, up ones and down
    passing its input on; else why neither."""
    import copy

    g = mx.array(np.linspace(-6, 6, 64, dtype=np.float32))[None]
    probe = copy.copy(mlp)  # a shallow copy: its children swapped, the model's left as they are
    probe.gate_proj, probe.up_proj, probe.down_proj = _Fixed(g), _Fixed(mx.ones_like(g)), _Identity()
    try:
        y = np.array(probe(mx.zeros((1, 64))).astype(mx.float32))
    except Exception as e:  # noqa: BLE001
        return f"an MLP whose code the probe cannot run ({type(e).__name__})"
    for name, fn in (("silu", nn.silu), ("gelu", nn.gelu_approx)):
        if np.allclose(y, np.array(fn(g)), rtol=1e-4, atol=1e-5):
            return name
    return "an MLP activation other than SiLU or GELU's tanh approximation"


# model types whose code hands the tokens and the cache straight to their ``language_model`` (mlx-lm's
# gemma3 and mistral3: the multimodal checkpoints of Gemma 3 4B+ and Mistral Small 3.x, whose
# images never reach chatapp): the fused steps serve the text model inside
TEXT_WRAPPERS = ("gemma3", "mistral3")


def text_model(model: nn.Module) -> nn.Module:
    """The model whose layers the fused steps read: ``model`` itself, or the text model a
    TEXT_WRAPPERS type hands its calls to."""
    mtype = getattr(getattr(model, "args", None), "model_type", None)
    inner = model.get("language_model") if isinstance(model, nn.Module) and mtype in TEXT_WRAPPERS else None
    return inner if isinstance(inner, nn.Module) else model


def inner_model(model: nn.Module):
    return model.get("model") if isinstance(model, nn.Module) else None


# bit widths the fused steps read widened to one byte a value (fused_layers.packed_weights): GGUF's
# Q5_0/Q5_1/Q5_K (a Q4_K_M file's fallback for rows not a multiple of 256) and MLX's 3/5/6-bit
WIDENED_BITS = (3, 5, 6)


def kernel_bits(bits: int) -> int:
    """The bit width the fused kernels read a ``bits``-bit weight as."""
    return 8 if bits in WIDENED_BITS else bits


def _quantised(m) -> str | None:
    """None when ``m`` is a quantised linear/embedding the packed kernels can read."""
    from chatapp.kernels.qmatmul import unsupported

    if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return f"{type(m).__name__} is not quantised"
    if m.get("biases") is None:
        return "no quantisation biases (kernels: affine)"
    return unsupported(kernel_bits(m.bits), m.group_size, m["weight"].shape[1] * 32 // m.bits, m.mode)


def rope_frequencies(rope, head_dim: int | None) -> np.ndarray | str:
    """inv_freq [head_dim / 2] float32 (pair i turns by position x inv_freq[i], as MLX's RoPE
    computes it) for the RoPE modules the kernels rotate as MLX does, or why not: nn.RoPE over
    the whole head (base and scale: linear scaling included) and mlx-lm's Llama3RoPE (Llama 3.1 /
    3.2's per-frequency scaling, GGUF's ``rope_freqs``), whose ``mx.fast.rope(freqs=...)`` turns
    pair i by position / freqs[i]."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    name = type(rope).__name__
    dims = getattr(rope, "dims", None)
    if type(rope) not in (nn.RoPE, Llama3RoPE):
        return f"RoPE {name} (fused decode: nn.RoPE or Llama 3's scaled RoPE)"
    if dims != head_dim:
        return f"RoPE over {dims} of the head's {head_dim} dims (fused decode: the whole head)"
    if isinstance(rope, Llama3RoPE):
        return (np.float32(1.0) / np.asarray(rope._freqs.astype(mx.float32))).astype(np.float32)
    return (np.float32(rope.scale) * np.power(
        np.float32(rope.base), -np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))).astype(np.float32)


def attention_head_dim(attn) -> int | None:
    """The width of one attention head: the module's ``head_dim`` where it keeps one (Llama),
    else q_proj's output rows over its heads (mlx-lm's Qwen2 keeps neither)."""
    d = getattr(attn, "head_dim", None)
    if d:
        return int(d)
    q, heads = attn.get("q_proj") if isinstance(attn, nn.Module) else None, getattr(attn, "n_heads", 0)
    return int(q.weight.shape[0]) // heads if q is not None and heads else None


def _qk_norms(attn, layer_norm) -> str | None:
    """None when the attention has no q/k norms, or both as the kernels apply them: RMSNorm over
    one head, with the layer norms' eps."""
    norms = [attn.get(name) for name in QK_NORMS]
    if all(n is None for n in norms):
        return None
    if any(n is None or isinstance(norm_weights(n), str) for n in norms):
        return "q/k norms that are not both RMS norms"
    if any(n.weight.shape[0] != attention_head_dim(attn) for n in norms):
        return "q/k norms wider than a head"
    if any(float(n.eps) != float(getattr(layer_norm, "eps", -1)) for n in norms):
        return "q/k norms with an eps of their own"
    return None


def fused_unsupported(model: nn.Module) -> str | None:
    """None when the decode step of ``model`` can be fused, else why not (one phrase)."""
    model = text_model(model)
    args = getattr(model, "args", None)
    inner = inner_model(model)
    layers = getattr(inner, "layers", None)
    if not layers:
        return "no decoder layers found"
    groups, activations = set(), set()
    for layer in layers:
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
        for part, names in LAYER_MODULES.items():
            module = layer.get(part) if part else layer
            extra = sorted(set(module.children()) - names) if isinstance(module, nn.Module) else ["?"]
            if extra:
                return f"{'layer' if not part else part} modules {', '.join(extra)} (fused: Llama's block)"
        attn = layer.get("self_attn")
        freqs = rope_frequencies(getattr(attn, "rope", None), attention_head_dim(attn))
        if isinstance(freqs, str):
            return freqs
        sandwich = [layer.get(n) is not None for n in SANDWICH]
        if any(sandwich) and not all(sandwich):
            return "only one of the sandwich norms (pre/post_feedforward_layernorm)"
        for norm in ("input_layernorm", "post_attention_layernorm", *(SANDWICH if all(sandwich) else ())):
            why = norm_weights(layer.get(norm))
            if isinstance(why, str):
                return f"{norm}: {why}"
            eps = getattr(layer.get(norm), "eps", None)
            if eps != getattr(layer.get("input_layernorm"), "eps", None):
                return f"{norm} with an eps of its own"
        act = mlp_activation(layer.get("mlp"))
        if act not in ("silu", "gelu"):
            return act
        activations.add(act)
        why = _qk_norms(attn, layer.get("input_layernorm"))
        if why:
            return why
        for parent, name in PROJECTIONS:
            proj = layer[parent].get(name)
            if proj is None or ("bias" in proj and name not in BIASED):
                return f"{name} missing or with a bias"
            why = _quantised(proj)
            if why:
                return f"{name}: {why}"
            groups.add(proj.group_size)
    if len(groups) != 1:
        return "projections with different group sizes"
    if len(activations) != 1:
        return "layers with different MLP activations"
    mtype = getattr(args, "model_type", None)
    if mtype not in FUSED_MODEL_TYPES:  # Llama's modules, but maybe not its code around them
        return f"model type {mtype!r} (fused decode: {', '.join(FUSED_MODEL_TYPES)})"
    if isinstance(norm_weights(inner.get("norm")), str):
        return "final norm is not an RMS norm"
    embed = inner.get("embed_tokens")
    if not isinstance(embed, (nn.QuantizedEmbedding, nn.Embedding)):
        return "no token embedding"
    head = embed if getattr(args, "tie_word_embeddings", True) and "lm_head" not in model else model.get("lm_head")
    if head is None:
        return "no output head"
    if isinstance(head, nn.QuantizedEmbedding) or isinstance(head, nn.QuantizedLinear):
        why = _quantised(head)
        if why:
            return f"output head: {why}"
    return None


def cache_refusal(cache, n_layers: int) -> str | None:
    """None when the fused routes serve ``cache`` (one segmented cache per layer: prealloc and every
    policy over it, sinks, windows, budgets, a quantised middle read as stored), else why not."""
    from cache.kv import SegmentedKVCache

    if not isinstance(cache, (list, tuple)) or len(cache) != n_layers:
        return "not one cache per layer"
    for c in cache:
        if not isinstance(c, SegmentedKVCache):
            return f"{type(c).__name__} caches (fused: the segmented caches)"
        if c.quant is not None:
            if c.quant.kind != "quant":
                # the kernels read MLX's per-token groups; per-channel keys (KIVI) are transposed
                # [head_dim, tokens] groups, which the step's per-token splits do not walk
                return "keys quantised per channel (kv_key_layout channel: MLX's route)"
            if c.quant.bits not in (4, 8) or c.quant.group_size not in (32, 64, 128):
                return f"{c.quant.bits}-bit KV in groups of {c.quant.group_size}"
        if c.full.keys is not None and (c.full.keys.dtype not in KV_HOST or c.full.values.dtype != c.full.keys.dtype):
            return f"K/V held as {c.full.keys.dtype}"
    return None
