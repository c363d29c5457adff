"""Tiny random-weight models of every architecture the installed mlx-lm ships (its registry:
the modules of ``mlx_lm.models`` with a ``Model`` and a ``ModelArgs``).

Each config is one superset of small values (``TINY``) that ``ModelArgs.from_dict`` filters to
the fields its architecture has, plus a few per-architecture changes (``OVERRIDES``) where a
field's meaning depends on the architecture (layer patterns). An architecture whose config this
cannot build, or whose model cannot run, is reported with the reason, never dropped: a new mlx-lm
architecture shows up as a skipped row until it gets a tiny config here.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

LAYERS = 4
SLIDING = 8  # every sliding window / attention chunk in the tiny configs; the sequences run past it

# Small values for the fields mlx-lm's ModelArgs use; head_dim 32 so the quantised modes apply.
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, d_model=64, n_embd=64, dim=64, model_dim=64, hidden_dim=64, block_dim=64,
    num_hidden_layers=LAYERS, num_layers=LAYERS, n_layer=LAYERS, n_layers=LAYERS, num_transformer_layers=LAYERS,
    intermediate_size=128, ffn_hidden_size=128, ff_intermediate_size=128, n_inner=128, block_ff_dim=128,
    intermediate_size_mlp=128, shared_intermediate_size=32, moe_intermediate_size=32, expert_ffn_hidden_size=32,
    shared_expert_intermediate_size=32, mlp_hidden_size=128,
    num_attention_heads=2, n_head=2, n_heads=2, num_heads=2, num_query_heads=2,
    num_key_value_heads=1, n_kv_heads=1, num_kv_heads=1, num_attention_groups=1,
    head_dim=32, rms_norm_eps=1e-5, norm_eps=1e-5, layer_norm_eps=1e-5, layer_norm_epsilon=1e-5,
    layernorm_epsilon=1e-5, max_position_embeddings=512, n_positions=512, n_ctx=512, model_max_length=512,
    rope_theta=10000.0, rotary_emb_base=10000.0, swa_rope_theta=10000.0, rope_scaling=None, rotary_pct=1.0,
    partial_rotary_factor=1.0, rotary_dim=32,
    num_experts_per_tok=2, moe_topk=2, num_experts=4, n_routed_experts=4, num_local_experts=4, moe_num_experts=4,
    n_shared_experts=1, num_shared_experts=1, num_shared_expert=1, norm_topk_prob=True, routed_scaling_factor=1.0,
    first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
    moe_layer_freq=1, decoder_sparse_step=1, mlp_only_layers=[], use_expert_bias=False, num_dense_layers=1,
    zero_expert_num=0, zero_expert_type="identity", is_moe_layer=[False, True, False, True],
    kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
    mla_scale_q_lora=False, mla_scale_kv_lora=False,
    index_head_dim=32, index_n_heads=2, index_topk=4,
    attention_bias=False, use_bias=False, mlp_bias=False, use_qkv_bias=False, use_qk_norm=True, qk_norm=True,
    post_norm=False, tie_word_embeddings=True,
    logits_scaling=1.0, attention_multiplier=1.0, embedding_multiplier=1.0, residual_multiplier=1.0,
    dim_model_base=64, scale_depth=1.0, scale_emb=1.0, logits_soft_cap=None,
    sliding_window=SLIDING, sliding_window_size=SLIDING, attention_window_size=SLIDING, attention_chunk_size=SLIDING,
    loop_window_size=SLIDING, conv_window=4, sliding_window_pattern=2,
    conv_kernel=4, use_conv_bias=True, conv_bias=True, conv_L_cache=3, conv1d_width=4,
    state_size=16, ssm_state_size=16, time_step_rank=8, n_groups=1, mamba_d_conv=4, mamba_d_state=16,
    mamba_expand=2, mamba_num_heads=4, mamba_head_dim=32, mamba_proj_bias=False, time_step_limit=(0.0, float("inf")),
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, linear_allow_neg_eigval=False,
    a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8, decay_low_rank_dim=8,
    block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
    ffn_dim_divisor=32, ffn_multipliers=[1.0] * LAYERS, gegelu_limit=20.0,
    hidden_act="silu", attention_method="full", use_cla=False, cla_share_factor=1, num_kv_reuse_layers=1,
    attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
    dense_attention_every_n_layers=2, group_norm_size=1, layer_group_size=2, block_size=8,
    add_swa_attention_sink_bias=False, add_full_attention_sink_bias=False,
    swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=32, swa_v_head_dim=32,
    use_mixed_mlp_moe=False,
)

# Layer patterns: the architecture's own words for its layer kinds, LAYERS long.
_SLIDE_FULL = ["sliding_attention", "full_attention"] * (LAYERS // 2)
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": dict(layer_types=_SLIDE_FULL),
    "gemma3n": dict(layer_types=_SLIDE_FULL),
    "gemma4_text": dict(layer_types=_SLIDE_FULL, num_kv_shared_layers=0),
    "gemma4": dict(layer_types=_SLIDE_FULL, num_kv_shared_layers=0),
    "qwen3_next": dict(full_attention_interval=2),
    "qwen3_5": dict(full_attention_interval=2),
    "lfm2": dict(full_attn_idxs=[1, 3]),
    "lfm2_moe": dict(full_attn_idxs=[1, 3]),
    "exaone4": dict(sliding_window_pattern="LLLG"),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * (LAYERS // 2), mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True),
    "nemotron_h": dict(hybrid_override_pattern=["M", "*", "-", "E"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64),
    "llama4": dict(interleave_moe_layer_step=2, no_rope_layers=[], num_experts_per_tok=1),
    "llama4_text": dict(interleave_moe_layer_step=2, no_rope_layers=[1, 1, 1, 0]),
    "afmoe": dict(layer_types=_SLIDE_FULL),
    "mellum": dict(layer_types=_SLIDE_FULL, rope_parameters={t: {"rope_theta": 10000.0} for t in _SLIDE_FULL}),
    "gear": dict(layer_types=_SLIDE_FULL),
    "exaone_moe": dict(layer_types=_SLIDE_FULL),
}


# Second configs of an architecture, for layouts its first config does not reach (KV shared
# between layers: fewer caches than layers): "module:variant" -> changes to the tiny config.
VARIANTS: dict[str, dict[str, Any]] = {
    "gemma4_text:kv_shared": dict(num_kv_shared_layers=2),
}

# Architectures whose tiny model takes the whole process down inside mlx-lm / MLX itself (a
# segfault in the forward pass, before any chatapp cache is involved): skipped with the reason.
CRASHES_PROCESS = {"phi3small": "mlx-lm's own forward segfaults on the tiny config (blocksparse attention)"}


@dataclass
class Arch:
    name: str
    model: Any = None
    skipped: str = ""  # why no tiny model of this architecture could be built or run


def registry() -> list[str]:
    """The architecture modules of the installed mlx-lm (those with a Model and ModelArgs)."""
    import mlx_lm.models as models

    names = []
    for m in pkgutil.iter_modules(models.__path__):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{m.name}")
        except BaseException:  # noqa: BLE001 - an architecture needing an absent package (olmo exits)
            names.append(m.name)
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            names.append(m.name)
    return sorted(names + [v for v in VARIANTS if v.split(":")[0] in names])


def _config(name: str, **changes) -> dict[str, Any]:
    cfg = dict(TINY, model_type=name)
    cfg.update(OVERRIDES.get(name, {}))
    cfg.update(changes)
    text = dict(cfg)
    cfg["text_config"] = text  # the multimodal wrappers take the text model's fields here
    return cfg


def build(name: str, seed: int = 0, **changes) -> Arch:
    """A tiny random float32 model of architecture ``name`` (``changes`` to the tiny config), or
    why there is none."""
    if name in CRASHES_PROCESS:
        return Arch(name, skipped=CRASHES_PROCESS[name])
    if ":" in name:
        changes = {**VARIANTS[name], **changes}
        arch = build(name.split(":")[0], seed, **changes)
        arch.name = name
        return arch
    try:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
    except BaseException as e:  # noqa: BLE001
        return Arch(name, skipped=f"import: {type(e).__name__}: {str(e)[:80]}")
    try:
        args = mod.ModelArgs.from_dict(_config(name, **changes))
    except Exception as e:  # noqa: BLE001
        return Arch(name, skipped=f"config: {type(e).__name__}: {str(e)[:100]}")
    mx.random.seed(seed)
    try:
        model = mod.Model(args)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        out = model(mx.array([[1, 2, 3]]))
        if not isinstance(out, mx.array):
            return Arch(name, skipped=f"forward returns {type(out).__name__}, not logits")
        mx.eval(out)
    except Exception as e:  # noqa: BLE001
        return Arch(name, skipped=f"build: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
    return Arch(name, model)
