"""What a model folder holds, and the one-line error every loading step raises.

Shared by the hub resolution (:mod:`chatapp.model.hub`), the legacy npz layout
(:mod:`chatapp.model.legacy`) and the loader (:mod:`chatapp.model.loader`); it imports no MLX.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Files that, any one of them, give a folder a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt", "spiece.model")


class ModelLoadError(Exception):
    """A model could not be loaded; ``str(err)`` is one line meant for the user."""


def one_line(err: BaseException, limit: int = 240) -> str:
    """The first non-empty line of an exception's message, cut to ``limit`` characters."""
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "") or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def find_weight_files(path: Path) -> tuple[str, list[Path]]:
    """The weight files of a model folder and its format ("mlx-lm" or "legacy-npz").

    Format is "mlx-lm" with no files when the folder has neither.
    """
    safetensors = sorted(path.glob("model*.safetensors"))
    if safetensors:
        return "mlx-lm", safetensors
    npz = sorted(p for p in path.glob("weights*.npz") if re.fullmatch(r"weights(\.\d+)?\.npz", p.name))
    if npz:
        return "legacy-npz", npz
    return "mlx-lm", []


def has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken"))


def read_config(path: Path, where: str) -> dict:
    """``config.json`` of a model folder as a dict; ModelLoadError when it is not a JSON object."""
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{where}: config.json is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: config.json does not hold a JSON object")
    return config


def folder_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and bool(find_weight_files(path)[1]) and has_tokenizer(path)


def is_legacy_dir(path: Path) -> bool:
    """True for a folder in the legacy mlx-examples npz layout."""
    fmt, files = find_weight_files(Path(path))
    return fmt == "legacy-npz" and bool(files)


def check_files(path: Path, where: str) -> tuple[str, list[Path]]:
    """The folder's format and weight files; ModelLoadError naming everything that is missing."""
    fmt, weights = find_weight_files(path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not weights:
        other = sorted(p.name for p in path.glob("*.safetensors"))
        hint = f"; found only {', '.join(other[:3])}" if other else ""
        missing.append(f"weights (model*.safetensors or weights.npz{hint})")
    if not has_tokenizer(path):
        missing.append("a tokenizer (tokenizer.json or tokenizer.model)")
    if missing:
        raise ModelLoadError(f"{where} is missing {', '.join(missing)}")
    return fmt, weights
