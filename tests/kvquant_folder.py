"""A tiny model folder whose KV cache can be quantised: stories260K's tokenizer with a
random-weight Llama of head_dim 32 (stories260K's own head_dim, 8, is below MLX's smallest
quantisation group, so window-quant refuses it). Greedy decoding on it is deterministic."""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

from tests.conftest import shared_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


@functools.lru_cache(maxsize=None)
def _build(src: str) -> Path:
    import atexit

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from chatapp.model.synthetic import LlamaShape, build_random_llama

    dest = Path(tempfile.mkdtemp(prefix="chatapp-kvquant-")) / "kvquant-tiny"
    atexit.register(shutil.rmtree, dest.parent, True)
    dest.mkdir()
    shape = LlamaShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=32, intermediate_size=128, vocab_size=512, rope_traditional=True,
                       max_position_embeddings=2048)
    model, config = build_random_llama(shape, seed=3)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (dest / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dest / name)
    return dest


def kvquant_model() -> Path:
    """The folder (built once per test run); skips without ../shared (the tokenizer comes from there)."""
    return _build(str(shared_model("stories260K")))
