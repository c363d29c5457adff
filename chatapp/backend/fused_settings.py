"""The fused steps' settings and their words: how the K/V buffers are held (cpu.kv_dtype) and how
the 4-bit products are computed (cpu.numerics), each choice resolved for this CPU and described
for the plan and --show-config."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from chatapp.config import KV_DTYPES

# where numerics fast runs down_proj (FusedDecoder.set_fast's decode_down / prefill_down), each
# choice with its words for --show-config; the default, int8 like the other products
DOWN_CHOICES = {"int8": "on int8 too", "wide": "on 16-bit activations", "exact": "exact"}
FAST_DOWN_DEFAULT = "int8"
# the output head under numerics fast (set_fast's ``head``): on int8 activations per
# int8head.HEAD_ACT_BLOCK (kernels/int8head.py), or float32 ones as exact computes it
HEAD_CHOICES = {"int8": "on int8", "exact": "exact"}
FAST_HEAD_DEFAULT = "int8"
# the prefill chunk's attention scores under numerics fast (set_fast's ``prefill_scores``): on
# unsigned key bytes and int8 query lanes (kernels/chunk_scores_int.py, where the CPU has
# vpdpbusd), or on floats as exact computes them
SCORES_CHOICES = {"int8": "on u8 keys and int8 queries", "exact": "on floats"}
FAST_SCORES_DEFAULT = "int8"
# the K/V buffer dtypes the fused kernels read, and how they see them (float16 as its bits)
KV_MX = {"float32": mx.float32, "float16": mx.float16}
KV_HOST = {mx.float32: np.float32, mx.float16: np.uint16}


def resolve_kv_dtype(kv_dtype: str) -> str:
    """``float16`` or ``float32`` for a cpu.kv_dtype choice: ``auto`` is float16 where the CPU
    converts half precision in vector instructions (F16C, detected; kernels/half.py), float32
    elsewhere, where each K/V element would cost a scalar conversion call."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
    if kv_dtype != "auto":
        return kv_dtype
    from chatapp.kernels.half import HAS_F16C

    return "float16" if HAS_F16C else "float32"


def kv_dtype_line(kv_dtype: str) -> str:
    """What the fused routes keep K/V as, for the plan and --show-config."""
    from chatapp.kernels.half import HAS_F16C

    dt = resolve_kv_dtype(kv_dtype)
    how = "F16C" if HAS_F16C else "scalar conversion"
    return f"K/V cache float16 ({how})" if dt == "float16" else "K/V cache float32"


def resolve_numerics(numerics: str) -> str:
    """``exact`` or ``fast`` for a cpu.numerics choice: ``auto`` is fast where the CPU has vector
    int8 products (VNNI or AVX2, detected: int8dot.AUTO_FAST_ISAS) and exact elsewhere, where the
    portable int8 code would not pay for its accuracy cost."""
    if numerics != "auto":
        return numerics
    from chatapp.kernels.int8dot import AUTO_FAST_ISAS, ISA

    return "fast" if ISA in AUTO_FAST_ISAS else "exact"


def numerics_line(numerics: str) -> str:
    """How the fused step's 4-bit products are computed, for the plan and --show-config."""
    if resolve_numerics(numerics) != "fast":
        return "numerics exact (float32 activations)"
    from chatapp.kernels.int8dot import ACT_BLOCK, ISA, ISA_NAMES
    from chatapp.kernels.int8head import HEAD_ACT_BLOCK
    from chatapp.kernels.int8panel import PANEL8, PREFILL_ACT_BLOCK
    from chatapp.kernels.qk_int import INT_SCORES

    scores = (f"a quantised middle's scores on 16-bit queries in decode, the prefill's scores "
              f"{SCORES_CHOICES[FAST_SCORES_DEFAULT]}" if INT_SCORES
              else "the attention's scores on floats (no vpdpbusd)")
    return (f"numerics fast (int8 activations per {ACT_BLOCK} elements, {PREFILL_ACT_BLOCK} in prefill, "
            f"{ISA_NAMES[ISA]}; down_proj {DOWN_CHOICES[FAST_DOWN_DEFAULT]}; the last layer exact; "
            f"the head {HEAD_CHOICES[FAST_HEAD_DEFAULT]} per {HEAD_ACT_BLOCK}; {scores}"
            + ("" if PANEL8 else "; the prefill's 8-bit rows on floats: vpmaddubsw saturates on bytes past 127")
            + ")")
