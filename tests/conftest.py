"""Shared fixtures: tiny random-weight Llamas and the real models in ../shared/models."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Keep every test (and every `chatapp` subprocess a test starts) away from the user's own
# config and data: an empty config dir and a throwaway data dir, unless a test sets its own.
# Each pytest-xdist worker makes its own (it inherits its controller's environment, and two
# workers' tests must not share one data dir); without workers, dirs set before pytest started
# are kept.
_PROCESS = os.environ.get("PYTEST_XDIST_WORKER", "controller")
_MADE_FOR = os.environ.get("CHATAPP_TEST_DIRS_FOR")
if _MADE_FOR != _PROCESS:
    for _var, _prefix in (("CHATAPP_CONFIG_DIR", "chatapp-test-config-"), ("CHATAPP_DATA_DIR", "chatapp-test-data-")):
        if _var not in os.environ or _MADE_FOR is not None:
            os.environ[_var] = tempfile.mkdtemp(prefix=_prefix)
            atexit.register(shutil.rmtree, os.environ[_var], True)
    os.environ["CHATAPP_TEST_DIRS_FOR"] = _PROCESS

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = REPO.parent / "shared" / "models"


def shared_model(name: str) -> Path:
    path = SHARED_MODELS / name
    if not (path / "config.json").exists():
        pytest.skip(f"needs the shared test model {name} in {SHARED_MODELS} (../shared is absent)")
    return path


@functools.lru_cache(maxsize=None)
def tiny_llama(layers: int = 2, head_dim: int = 64, kv_heads: int = 2, heads: int = 8, max_pos: int = 4096,
               seed: int = 0, quantize_bits: int | None = None):
    """A random-weight mlx-lm Llama with GQA; cached because tests only read it."""
    from chatapp.model.synthetic import LlamaShape, build_random_llama

    shape = LlamaShape(
        hidden_size=heads * head_dim // 2, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=256,
        max_position_embeddings=max_pos,
    )
    model, _ = build_random_llama(shape, seed=seed, quantize_bits=quantize_bits)
    return model


@pytest.fixture(scope="session")
def stories_path() -> Path:
    return shared_model("stories260K")


@pytest.fixture(scope="session")
def stories4_path() -> Path:
    return shared_model("stories260K-4bit")


@pytest.fixture(scope="session")
def stories(stories_path):
    from mlx_lm import load

    return load(str(stories_path))


@pytest.fixture(autouse=True)
def _no_leftover_prefill_kernel():
    """The prefill attention kernel is process-wide (installed by load_engine on the CPU
    backend): each test starts without it and leaves none behind."""
    from cache import set_prefill_kernel

    set_prefill_kernel(None)
    yield
    set_prefill_kernel(None)
