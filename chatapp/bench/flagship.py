"""A random-weight model with Llama-2-7B's exact geometry, as mlx-community shipped it.

`mlx-community/Llama-2-7b-chat-4-bit` is the early mlx-examples layout: one ``weights.npz``
(Meta's tensor names, 4-bit weights packed in uint32 with float16 scales and biases per group of
64, the embedding in float16, the output layer quantised), a small legacy ``config.json`` and
Llama 2's SentencePiece ``tokenizer.model``. ``write_llama2_7b`` writes the same files with
random weights (and the real tokenizer, from ``../shared/models/llama2-tokenizer``), so the
benchmark loads them through chatapp's own loader exactly as a user's download would be.

The weights are w = s * (q - 8) for q uniform in 1..15 (biases = -8 s), s ~ 1 / (4.3 sqrt(K)):
centred, with activations of unit scale layer after layer. The same numbers are exactly a
llama.cpp Q4_0 tensor (blocks of 32 sharing s), so ``write_gguf_q4_0`` gives llama.cpp the
same model to run (gguf.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

LAYER_TENSORS = {  # Meta's names in the legacy layout -> (out, in) in units of the geometry
    "attention.wq": ("dim", "dim"),
    "attention.wk": ("kv_dim", "dim"),
    "attention.wv": ("kv_dim", "dim"),
    "attention.wo": ("dim", "dim"),
    "feed_forward.w1": ("hidden_dim", "dim"),
    "feed_forward.w2": ("dim", "hidden_dim"),
    "feed_forward.w3": ("hidden_dim", "dim"),
}
MARKER = "chatapp-bench.json"
# The layers that write into the residual stream start small (GPT-2's 1/sqrt(2 x layers)), so the
# token's own embedding still steers the output after 32 random layers: with unit gains the
# random blocks' shared component swamps it and greedy decoding repeats one token forever,
# which would make "greedy tokens equal" an empty check.
RESIDUAL_WRITERS = ("attention.wo", "feed_forward.w2")
RESIDUAL_GAIN = 1.0


@dataclass(frozen=True)
class Geometry:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    head_dim: int = 128
    hidden_dim: int = 11008
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    group_size: int = 64
    bits: int = 4
    seed: int = 0
    version: int = 3  # of the weights' recipe: bump to rewrite cached model folders

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def size(self, name: str) -> int:
        return getattr(self, name)

    def legacy_config(self) -> dict:
        return {
            "dim": self.dim, "n_layers": self.n_layers, "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim, "hidden_dim": self.hidden_dim, "norm_eps": self.norm_eps,
            "vocab_size": self.vocab_size, "model_type": "llama",
            "quantization": {"group_size": self.group_size, "bits": self.bits},
        }


LLAMA2_7B = Geometry()


def _quantised(rng: np.random.Generator, out: int, inp: int, g: Geometry, gain: float = 1.0) -> dict[str, np.ndarray]:
    """Random packed 4-bit weights as MLX stores them: uint32 [out, in/8], fp16 scales/biases.

    q is uniform in 1..15 (not 0..15): with biases = -8 s the weights are then exactly centred.
    A 0..15 draw leaves every weight a mean of -s/2, a shared direction that 32 layers amplify
    until greedy decoding repeats one token."""
    q = rng.integers(1, 16, size=(out, inp), dtype=np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).view(np.uint32).reshape(out, inp * g.bits // 32)
    base = gain / (4.32 * np.sqrt(inp))  # std of q - 8 over 1..15 is 4.32
    scales = (base * rng.uniform(0.8, 1.2, size=(out, inp // g.group_size))).astype(np.float16)
    return {"weight": packed, "scales": scales, "biases": (-8 * scales.astype(np.float32)).astype(np.float16)}


def tensors(g: Geometry):
    """(name, array) of every tensor in the legacy layout, generated one at a time."""
    rng = np.random.default_rng(g.seed)
    yield "tok_embeddings.weight", rng.standard_normal((g.vocab_size, g.dim), dtype=np.float32).astype(np.float16)
    for layer in range(g.n_layers):
        for name, (o, i) in LAYER_TENSORS.items():
            gain = RESIDUAL_GAIN / np.sqrt(2 * g.n_layers) if name in RESIDUAL_WRITERS else 1.0
            for suffix, arr in _quantised(rng, g.size(o), g.size(i), g, gain).items():
                yield f"layers.{layer}.{name}.{suffix}", arr
        for norm in ("attention_norm", "ffn_norm"):
            yield f"layers.{layer}.{norm}.weight", np.ones(g.dim, np.float16)
    yield "norm.weight", np.ones(g.dim, np.float16)
    for suffix, arr in _quantised(rng, g.vocab_size, g.dim, g).items():
        yield f"output.{suffix}", arr


def _up_to_date(folder: Path, g: Geometry) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == asdict(g) and (folder / "weights.npz").is_file()
    except (OSError, ValueError):
        return False


def write_llama2_7b(folder: Path, tokenizer_model: Path, g: Geometry = LLAMA2_7B) -> Path:
    """Write (or reuse, when a previous run left the same geometry and seed) the model folder."""
    folder = Path(folder)
    if _up_to_date(folder, g):
        return folder
    if not tokenizer_model.is_file():
        raise FileNotFoundError(f"{tokenizer_model} not found: the benchmark needs Llama 2's tokenizer.model "
                                "(../shared/models/llama2-tokenizer)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    import zipfile

    # np.savez would hold every array at once (4 GB); writing entry by entry keeps one in memory
    with zipfile.ZipFile(folder / "weights.npz", "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, arr in tensors(g):
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
    (folder / "config.json").write_text(json.dumps(g.legacy_config(), indent=2) + "\n")
    shutil.copyfile(tokenizer_model, folder / "tokenizer.model")
    (folder / MARKER).write_text(json.dumps(asdict(g)))
    return folder


def weight_file_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.npz")) + sum(
        f.stat().st_size for f in Path(folder).glob("*.safetensors"))
