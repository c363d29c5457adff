"""A minimal GGUF (v3) writer: just what llama.cpp needs to run the benchmark's random Llama.

The bench compares chatapp with llama.cpp (through `llama_cpp`, when it is importable) on the
same model. flagship.py's weights are w = s * (q - 8) with one fp16 scale s per group of 64, so
each group is two Q4_0 blocks of 32 with d = s: llama.cpp gets the very same numbers. Q4_0 packs
block element j in the low nibble of byte j and element j + 16 in its high nibble (MLX: elements
2j and 2j + 1), so the nibbles are re-laid here. Meta's layout (traditional RoPE) is what
llama.cpp's "llama" architecture expects: no permutation of wq/wk.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from .flagship import LAYER_TENSORS, Geometry, tensors

GGUF_MAGIC = b"GGUF"
ALIGN = 32
F32, F16, Q4_0 = 0, 1, 2
T_UINT32, T_INT32, T_FLOAT32, T_STRING, T_ARRAY = 4, 5, 6, 8, 9
GGUF_NAMES = {
    "attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v", "attention.wo": "attn_output",
    "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up",
    "attention_norm": "attn_norm", "ffn_norm": "ffn_norm",
}


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, value) -> bytes:
    out = _str(key) + struct.pack("<I", vtype)
    if vtype == T_STRING:
        return out + _str(value)
    if vtype == T_ARRAY:
        etype, items = value
        out += struct.pack("<IQ", etype, len(items))
        if etype == T_STRING:
            return out + b"".join(_str(s) for s in items)
        fmt = {T_INT32: "<i", T_FLOAT32: "<f", T_UINT32: "<I"}[etype]
        return out + b"".join(struct.pack(fmt, x) for x in items)
    return out + struct.pack({T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f"}[vtype], value)


def q4_0_from_mlx(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MLX 4-bit rows (uint32 [N, K/8], fp16 scales [N, K/64], biases -8 s) -> Q4_0 bytes [N, K/32*18]."""
    n = packed.shape[0]
    b = packed.view(np.uint8).reshape(n, -1)
    q = np.empty((n, b.shape[1] * 2), np.uint8)
    q[:, 0::2], q[:, 1::2] = b & 15, b >> 4  # MLX: element 2j low nibble, 2j+1 high
    blocks = q.reshape(n, -1, 32)
    qs = blocks[:, :, :16] | (blocks[:, :, 16:] << 4)  # Q4_0: j low, j+16 high
    d = np.repeat(scales.astype(np.float16), 2, axis=1)  # group of 64 = two blocks of 32
    out = np.empty((n, blocks.shape[1], 18), np.uint8)
    out[:, :, :2] = d.view(np.uint8).reshape(n, -1, 2)
    out[:, :, 2:] = qs
    return out.reshape(n, -1)


def _vocab(tokenizer_model: Path) -> tuple[list[str], list[float], list[int]]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        kind = 1  # normal
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        types.append(kind)
    return tokens, scores, types


def write_gguf_q4_0(path: Path, g: Geometry, tokenizer_model: Path, context: int = 4096) -> Path:
    """Write flagship.py's model (same seed, same numbers) as a Q4_0 GGUF for llama.cpp."""
    if g.bits != 4 or g.group_size % 32:
        raise ValueError("Q4_0 needs 4-bit weights in groups that are a multiple of 32")
    tokens, scores, types = _vocab(tokenizer_model)
    meta = [
        _kv("general.architecture", T_STRING, "llama"),
        _kv("general.name", T_STRING, "chatapp-bench-random-llama2-7b"),
        _kv("general.file_type", T_UINT32, 2),  # mostly Q4_0
        _kv("llama.context_length", T_UINT32, context),
        _kv("llama.embedding_length", T_UINT32, g.dim),
        _kv("llama.block_count", T_UINT32, g.n_layers),
        _kv("llama.feed_forward_length", T_UINT32, g.hidden_dim),
        _kv("llama.rope.dimension_count", T_UINT32, g.head_dim),
        _kv("llama.attention.head_count", T_UINT32, g.n_heads),
        _kv("llama.attention.head_count_kv", T_UINT32, g.n_kv_heads),
        _kv("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, g.norm_eps),
        _kv("llama.rope.freq_base", T_FLOAT32, 10000.0),
        _kv("tokenizer.ggml.model", T_STRING, "llama"),
        _kv("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, tokens)),
        _kv("tokenizer.ggml.scores", T_ARRAY, (T_FLOAT32, scores)),
        _kv("tokenizer.ggml.token_type", T_ARRAY, (T_INT32, types)),
        _kv("tokenizer.ggml.bos_token_id", T_UINT32, 1),
        _kv("tokenizer.ggml.eos_token_id", T_UINT32, 2),
        _kv("tokenizer.ggml.unknown_token_id", T_UINT32, 0),
    ]
    # tensor infos need each tensor's size before the data: one pass for shapes (cheap: the
    # generator is re-run for the data, with the same seed)
    infos, offset = [], 0
    for name, shape, kind in _layout(g):
        nbytes = _nbytes(shape, kind)
        infos.append(_str(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
                     + struct.pack("<IQ", kind, offset))
        offset += -(-nbytes // ALIGN) * ALIGN
    path = Path(path)
    with open(path, "wb") as f:
        f.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(infos), len(meta)))
        for m in meta:
            f.write(m)
        for info in infos:
            f.write(info)
        f.write(b"\0" * (-f.tell() % ALIGN))
        for data in _data(g):
            f.write(data)
            f.write(b"\0" * (-len(data) % ALIGN))
    return path


def _layout(g: Geometry):
    """(gguf name, dims innermost first, type) in file order."""
    yield "token_embd.weight", (g.dim, g.vocab_size), F16
    for layer in range(g.n_layers):
        for name, (o, i) in LAYER_TENSORS.items():
            yield f"blk.{layer}.{GGUF_NAMES[name]}.weight", (g.size(i), g.size(o)), Q4_0
        for norm in ("attention_norm", "ffn_norm"):
            yield f"blk.{layer}.{GGUF_NAMES[norm]}.weight", (g.dim,), F32
    yield "output_norm.weight", (g.dim,), F32
    yield "output.weight", (g.dim, g.vocab_size), Q4_0


def _nbytes(shape: tuple, kind: int) -> int:
    n = int(np.prod(shape))
    return {F32: 4 * n, F16: 2 * n, Q4_0: n // 32 * 18}[kind]


def _data(g: Geometry):
    """The tensors' bytes in ``_layout`` order, from flagship.tensors (same seed, same numbers)."""
    pending: dict[str, np.ndarray] = {}
    for name, arr in tensors(g):
        module, _, suffix = name.rpartition(".")
        if module == "tok_embeddings":
            yield arr.astype(np.float16).tobytes()
        elif module.endswith("_norm") or module == "norm":
            yield arr.astype(np.float32).tobytes()
        else:
            pending[suffix] = arr
            if suffix == "biases":  # weight, scales, biases arrive in that order
                yield q4_0_from_mlx(pending["weight"], pending["scales"]).tobytes()
                pending.clear()
