"""What the conversation benchmarks (resume, prefix) share: the BLAS check, which models to run,
loading stories260K-4bit, and the app's CPU fast path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STORIES = Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K-4bit"
SMOLLM2_GGUF = STORIES.parent / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("random", "stories")


def start_bench():
    """Quiet transformers and warn when no optimised BLAS is loaded; returns the BLAS in use."""
    from transformers.utils import logging as hf_logging

    from chatapp.backend.blas import current_blas

    hf_logging.set_verbosity_error()  # "sequence longer than the model's maximum": expected for stories
    blas = current_blas()
    if not blas.loaded:
        print("# WARNING: no optimised BLAS loaded (run through `chatapp bench`); numbers use the reference BLAS")
    return blas


def model_names(text: str, stories: str | Path) -> list[str]:
    """``--models``: random and/or stories; stories is skipped (said) when its folder is absent."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in MODEL_NAMES]
    if bad or not names:
        raise SystemExit(f"--models: unknown {bad}; use random and/or stories")
    if "stories" in names and not (Path(stories) / "config.json").exists():
        print(f"# skipping stories: no model at {stories}")
        names.remove("stories")
    return names


def load_stories(path: str | Path) -> tuple[Any, Any, Any, str]:
    """stories260K-4bit: (model, tokenizer, ModelIdentity, description)."""
    from chatapp.model.loader import load_model
    from chatapp.store.chat import ModelIdentity

    lm = load_model(str(path))
    desc = f"{lm.model_id}: {lm.n_layers} layers, {lm.n_kv_heads} KV heads of {lm.head_dim}, {lm.dtype}"
    return lm.model, lm.tokenizer, ModelIdentity.from_loaded(lm, str(path)), desc


def fast_path(model, off: bool, numerics: str = "exact") -> str:
    """Give ``model`` the app's CPU fast path (as ``load_engine`` does, on ``numerics``: the app's
    own default is ``auto``) unless ``off``; says what it did."""
    if off:
        return "off (--no-fast-path)"
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.model.device import pick_backend

    return apply_fast_path(model, backend=pick_backend().name, numerics=numerics).summary()


def loadavg() -> str:
    """The 1/5/15-minute load averages: the speeds here depend on what else the machine runs."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "n/a"
