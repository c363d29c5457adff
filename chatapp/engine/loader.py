"""Load a model for chat: from a local folder or a Hugging Face repo id.

Two on-disk formats are understood:

* **mlx-lm** folders (``config.json`` + ``model*.safetensors`` + tokenizer files), loaded with
  mlx-lm's own loader, so every architecture mlx-lm supports works.
* **legacy-npz** folders from the early mlx-community repos (e.g.
  ``mlx-community/Llama-2-7b-chat-4-bit``): ``weights.npz`` (or ``weights.NN.npz`` shards) in the
  layout of mlx-examples' ``llms/llama/llama.py``, a small config with ``dim``/``n_layers``/...
  keys and a SentencePiece ``tokenizer.model``. mlx-lm refuses those ("No safetensors found");
  here their weights are renamed onto mlx-lm's Llama and the tokenizer is built from
  ``tokenizer.model``.

Every failure the user can cause or fix (unknown repo, no network, missing files, unsupported
architecture, not enough memory) raises :class:`ModelLoadError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import sys
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tqdm.std import tqdm as _std_tqdm

from chatapp.engine.device import (
    DTYPES,
    cast_floating,
    checkpoint_float_dtype,
    dtype_name,
    is_quant_param,
    pick_backend,
)
from chatapp.engine.modelconfig import config_value

__all__ = [
    "ALLOW_PATTERNS",
    "DownloadProgress",
    "LoadedModel",
    "ModelLoadError",
    "available_memory_bytes",
    "estimate_weight_bytes",
    "find_weight_files",
    "format_bytes",
    "is_legacy_dir",
    "legacy_config_to_mlx",
    "legacy_weight_name",
    "load_model",
    "progress_tqdm_class",
    "resolve_model_path",
    "save_model_dir",
    "weights_fingerprint",
]

# What a model download fetches: config, weights (mlx-lm safetensors or legacy npz) and every
# kind of tokenizer file. Custom *.py model code is fetched but never run (trust_remote_code
# stays off).
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.npz",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.py",
    "*.jinja",
]

# Files that, any one of them, give a folder a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt", "spiece.model")
# Files save_model_dir copies next to the weights.
_TOKENIZER_COPY = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "vocab.txt",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)

_MiB = 1 << 20
_GiB = 1 << 30


class ModelLoadError(Exception):
    """A model could not be loaded; ``str(err)`` is one line meant for the user."""


@dataclass(frozen=True)
class DownloadProgress:
    """Progress of a model download, reported to ``load_model(progress=...)``.

    ``filename`` is the file being downloaded (empty until known). Byte counts cover the files
    that actually need downloading (files already in the cache count as done). Reports come
    from the download's worker threads: a UI must hand them over to its own thread.
    """

    filename: str
    bytes_done: int
    bytes_total: int
    percent: float
    files_done: int
    files_total: int


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    model_id: str
    path: Path
    format: str  # "mlx-lm" | "legacy-npz"
    dtype: str  # activation dtype the float parameters now have, e.g. "float32"
    weights_fingerprint: str
    has_chat_template: bool
    max_position_embeddings: int | None
    n_kv_heads: int | None
    head_dim: int | None
    n_layers: int | None
    cpu_plan: Any = None  # chatapp.backend.cpu.CpuPlan, set by engine.setup.load_engine


# --------------------------------------------------------------------------------------------
# download progress


class _NullWriter(io.TextIOBase):
    """Where the progress bars render: nowhere (the app shows its own progress)."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


class _DownloadTracker:
    """Turns the progress bars snapshot_download drives into DownloadProgress reports.

    snapshot_download creates, from the ``tqdm_class`` it is given: a files bar (unit "it",
    total = number of files, +1 as each file completes), a "Downloading bytes" network-transfer
    bar and a bytes bar whose total grows by a file's size when that file's download starts and
    whose count grows as its bytes land on disk. The per-file bars are internal to the hub and
    carry no name through ``tqdm_class``, so the file name comes from ``plan`` (the files to
    download with their sizes): a total growing by N bytes means the planned file of N bytes
    has started.
    """

    def __init__(self, callback: Callable[[DownloadProgress], None] | None,
                 plan: list[tuple[str, int]] | None = None):
        self.callback = callback
        self.lock = threading.RLock()
        self.pending = [(name, int(size or 0)) for name, size in (plan or [])]
        self.planned_bytes = sum(size for _, size in self.pending) if plan else None
        self.filename = ""
        self.bytes_done = 0
        self.bar_bytes_total = 0
        self.files_done = 0
        self.files_total = 0
        self.last: DownloadProgress | None = None

    def bytes_total(self) -> int:
        total = self.planned_bytes if self.planned_bytes is not None else self.bar_bytes_total
        return max(int(total), int(self.bytes_done))

    def on_bytes_total(self, total: float | None) -> None:
        total = int(total or 0)
        delta = total - self.bar_bytes_total
        self.bar_bytes_total = total
        if delta > 0 and self.pending:
            idx = next((i for i, (_, size) in enumerate(self.pending) if size == delta), 0)
            self.filename = self.pending.pop(idx)[0]

    def snapshot(self) -> DownloadProgress:
        total = self.bytes_total()
        if total > 0:
            percent = 100.0 * self.bytes_done / total
        elif self.files_total > 0:
            percent = 100.0 * self.files_done / self.files_total
        else:
            percent = 0.0
        return DownloadProgress(
            filename=self.filename,
            bytes_done=int(self.bytes_done),
            bytes_total=total,
            percent=min(100.0, percent),
            files_done=int(self.files_done),
            files_total=int(self.files_total),
        )

    def emit(self) -> None:
        report = self.snapshot()
        if report == self.last:
            return
        self.last = report
        if self.callback is not None:
            self.callback(report)

    def finish(self) -> None:
        """The download returned: report it complete."""
        with self.lock:
            self.files_done = self.files_total = max(self.files_total, self.files_done)
            if self.planned_bytes is not None:
                self.bytes_done = self.planned_bytes
            self.bytes_done = max(self.bytes_done, self.bar_bytes_total)
            if self.planned_bytes is None:
                self.bar_bytes_total = self.bytes_done
            self.emit()


class _ProgressTqdm(_std_tqdm):
    """A silent tqdm that feeds a :class:`_DownloadTracker` (see :func:`progress_tqdm_class`)."""

    _tracker: _DownloadTracker
    monitor_interval = 0  # no tqdm monitor thread

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)  # only huggingface_hub's own tqdm accepts it
        kwargs["file"] = _NullWriter()
        kwargs["disable"] = False  # a disabled tqdm stops counting
        unit = kwargs.get("unit", "it")
        desc = str(kwargs.get("desc") or "")
        if unit != "B":
            self._role = "files"
        elif desc.lower().startswith("downloading bytes"):
            self._role = "transfer"  # network bytes (an estimate); the disk bytes bar is used
        else:
            self._role = "bytes"
        self._seen_total = None
        super().__init__(*args, **kwargs)
        self._sync()

    def _sync(self) -> None:
        tracker = self._tracker
        with tracker.lock:
            if self._role == "files":
                tracker.files_total = int(self.total or 0)
                tracker.files_done = int(self.n)
            elif self._role == "bytes":
                if self.total != self._seen_total:
                    self._seen_total = self.total
                    tracker.on_bytes_total(self.total)
                tracker.bytes_done = max(0, int(self.n))
            else:
                return
            tracker.emit()

    def update(self, n=1):
        result = super().update(n)
        self._sync()
        return result

    def refresh(self, *args, **kwargs):
        result = super().refresh(*args, **kwargs)
        if hasattr(self, "_role"):
            self._sync()
        return result


def progress_tqdm_class(
    callback: Callable[[DownloadProgress], None] | None,
    plan: list[tuple[str, int]] | None = None,
) -> type[_std_tqdm]:
    """A tqdm class to pass as ``snapshot_download(tqdm_class=...)``.

    It prints nothing and calls ``callback`` with a :class:`DownloadProgress` whenever the
    numbers change. ``plan`` lists ``(filename, size)`` of the files to be downloaded, in the
    order they are fetched; it provides the names and the overall byte total. The tracker is
    reachable as ``cls._tracker``.
    """
    tracker = _DownloadTracker(callback, plan)
    return type("ChatappDownloadTqdm", (_ProgressTqdm,), {"_tracker": tracker})


# --------------------------------------------------------------------------------------------
# Hugging Face resolution


def _hf_cache_dir() -> Path:
    """The hub cache, read from the environment now (huggingface_hub reads it at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _env_offline() -> bool:
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    return bool(constants.HF_HUB_OFFLINE)


_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or spec in (".", "..")
        or spec.count("/") > 1
        or "\\" in spec
        or not _REPO_ID.match(spec)
    )


def _one_line(err: BaseException, limit: int = 240) -> str:
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "") or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import httpx2

        errors.append(httpx2.TransportError)
    except ImportError:  # older huggingface_hub uses httpx or requests
        pass
    for mod_name, attr in (("httpx", "TransportError"), ("requests", "ConnectionError"), ("requests", "Timeout")):
        try:
            errors.append(getattr(__import__(mod_name), attr))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _hub_error(repo_id: str, err: BaseException, cache_dir: Path,
               incomplete: str | Path | None = None) -> ModelLoadError | None:
    """A ModelLoadError for a hub/network failure, or None if ``err`` is none of those."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, GatedRepoError):
        return ModelLoadError(
            f"{repo_id} is a gated repository on Hugging Face: accept its licence on huggingface.co "
            "and log in (`hf auth login`) to download it"
        )
    if isinstance(err, RepositoryNotFoundError):
        return ModelLoadError(
            f"unknown model {repo_id!r}: no such repository on Hugging Face "
            "(check the name; private repositories need `hf auth login`)"
        )
    if isinstance(err, RevisionNotFoundError):
        return ModelLoadError(f"{repo_id} has no such revision on Hugging Face")
    if isinstance(err, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or isinstance(err, _network_errors()):
        if incomplete:
            return ModelLoadError(
                f"cannot reach Hugging Face and the cached copy of {repo_id} is incomplete ({incomplete})"
            )
        return ModelLoadError(
            f"cannot reach Hugging Face and {repo_id} is not in the local cache ({cache_dir})"
        )
    if isinstance(err, HfHubHTTPError):
        return ModelLoadError(f"downloading {repo_id} from Hugging Face failed: {_one_line(err)}")
    return None


def _download_plan(repo_id: str, cache_dir: Path) -> list[tuple[str, int]] | None:
    """The files snapshot_download will fetch, in order, with sizes (None if unknown).

    A dry run with one worker lists them in the same order the real run (also one worker)
    downloads them. Any failure just means no file names in the progress reports; the real
    download then reports the actual error.
    """
    from huggingface_hub import snapshot_download

    try:
        infos = snapshot_download(
            repo_id, allow_patterns=ALLOW_PATTERNS, cache_dir=str(cache_dir), dry_run=True, max_workers=1
        )
    except Exception:
        return None
    return [(info.filename, int(info.file_size or 0)) for info in infos if info.will_download]


def resolve_model_path(
    spec: str,
    *,
    progress: Callable[[DownloadProgress], None] | None = None,
    offline: bool | None = None,
) -> tuple[Path, str]:
    """Where the model ``spec`` lives on disk, downloading it if needed; returns (path, model_id).

    A local folder is used as is. Otherwise ``spec`` is a Hugging Face repo id: a complete copy
    in the local cache is used without touching the network; failing that (unless offline) it
    is downloaded, reporting progress.
    """
    local = Path(spec).expanduser()
    if local.is_dir():
        return local.resolve(), local.resolve().name
    if local.exists():
        raise ModelLoadError(f"{spec} is a file, not a model folder")
    if _looks_like_path(spec):
        raise ModelLoadError(f"no model folder at {spec} (and it is not a Hugging Face repo id)")

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo_id = spec
    cache_dir = _hf_cache_dir()
    offline = _env_offline() if offline is None else offline

    incomplete = None
    try:
        path = Path(snapshot_download(
            repo_id, allow_patterns=ALLOW_PATTERNS, cache_dir=str(cache_dir), local_files_only=True
        ))
        # A cached snapshot may lack files (an interrupted download, or one made with other
        # patterns): offline it is still what there is, and the folder check names what's missing.
        if offline or _folder_complete(path):
            return path, repo_id
        incomplete = path
    except HFValidationError as err:
        raise ModelLoadError(f"{spec!r} is neither a local folder nor a valid Hugging Face repo id") from err
    except LocalEntryNotFoundError as err:
        incomplete = getattr(err, "snapshot_path", None)  # IncompleteSnapshotError has it
    if offline:
        if incomplete:
            raise ModelLoadError(
                f"offline mode is on and the cached copy of {repo_id} is incomplete ({incomplete})"
            )
        raise ModelLoadError(
            f"offline mode is on and {repo_id} is not in the local cache ({cache_dir})"
        )

    plan = _download_plan(repo_id, cache_dir)
    tqdm_class = progress_tqdm_class(progress, plan)
    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=ALLOW_PATTERNS,
            cache_dir=str(cache_dir),
            tqdm_class=tqdm_class,
            # one file at a time when the plan names them, so the reported name is exact
            max_workers=1 if plan else 8,
        )
    except Exception as err:
        mapped = _hub_error(repo_id, err, cache_dir, incomplete)
        if mapped is None:
            if isinstance(err, OSError):
                raise ModelLoadError(f"downloading {repo_id} failed: {_one_line(err)}") from err
            raise
        raise mapped from err
    tqdm_class._tracker.finish()
    return Path(path), repo_id


# --------------------------------------------------------------------------------------------
# folder inspection


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


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in _TOKENIZER_FILES) or any(path.glob("*.tiktoken"))


def _read_config(path: Path, where: str) -> dict:
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{where}: config.json is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: config.json does not hold a JSON object")
    return config


def _folder_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and bool(find_weight_files(path)[1]) and _has_tokenizer(path)


def is_legacy_dir(path: Path) -> bool:
    """True for a folder in the legacy mlx-examples npz layout."""
    fmt, files = find_weight_files(Path(path))
    return fmt == "legacy-npz" and bool(files)


def _check_files(path: Path, where: str) -> tuple[str, list[Path]]:
    fmt, weights = find_weight_files(path)
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not weights:
        other = sorted(p.name for p in path.glob("*.safetensors"))
        hint = f"; found only {', '.join(other[:3])}" if other else ""
        missing.append(f"weights (model*.safetensors or weights.npz{hint})")
    if not _has_tokenizer(path):
        missing.append("a tokenizer (tokenizer.json or tokenizer.model)")
    if missing:
        raise ModelLoadError(f"{where} is missing {', '.join(missing)}")
    return fmt, weights


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
# legacy npz format (mlx-examples llms/llama)

_LEGACY_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LEGACY_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LEGACY_SUFFIXES = ("weight", "scales", "biases", "bias")
_LEGACY_MODEL_TYPES = (None, "", "llama", "mistral")  # same layout in mlx-examples
_LEGACY_IGNORED = re.compile(r"(^|\.)rope\.freqs$|\.inner_attention\.rope\.freqs$")


def legacy_weight_name(name: str) -> str | None:
    """The mlx-lm Llama name of a legacy mlx-examples weight (None if it has none)."""
    module, _, suffix = name.rpartition(".")
    if suffix not in _LEGACY_SUFFIXES:
        return None
    if module in _LEGACY_TOP_MAP:
        return f"{_LEGACY_TOP_MAP[module]}.{suffix}"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
    if m and m.group(2) in _LEGACY_LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LEGACY_LAYER_MAP[m.group(2)]}.{suffix}"
    return None


def legacy_config_to_mlx(legacy: dict, weights: dict[str, mx.array]) -> dict:
    """An mlx-lm ``llama`` config for a legacy mlx-examples config.

    Defaults follow mlx-examples' llama.py ``sanitize_config``/``ModelArgs``: n_kv_heads =
    n_heads, head_dim = dim // n_heads, hidden_dim from w1's rows, vocab_size (when absent or
    -1, as in Meta's params.json) from the embedding rows, rope_theta 10000 and traditional
    (adjacent-pair) RoPE.
    """
    try:
        dim = int(legacy["dim"])
        n_layers = int(legacy["n_layers"])
        n_heads = int(legacy["n_heads"])
    except KeyError as err:
        raise ModelLoadError(f"legacy config.json lacks {err.args[0]!r}") from err
    hidden_dim = legacy.get("hidden_dim")
    if hidden_dim is None:
        w1 = weights.get("layers.0.feed_forward.w1.weight")
        if w1 is None:
            raise ModelLoadError("legacy config.json lacks 'hidden_dim' and the weights have no feed_forward.w1")
        hidden_dim = w1.shape[0]
    vocab_size = legacy.get("vocab_size", -1)
    if vocab_size is None or int(vocab_size) < 0:
        emb = weights.get("tok_embeddings.weight")
        if emb is None:
            raise ModelLoadError("legacy config.json has no vocab_size and the weights no tok_embeddings")
        vocab_size = emb.shape[0]
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": dim,
        "num_hidden_layers": n_layers,
        "intermediate_size": int(hidden_dim),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(legacy.get("n_kv_heads") or n_heads),
        "head_dim": int(legacy.get("head_dim") or dim // n_heads),
        "rms_norm_eps": float(legacy.get("norm_eps", 1e-5)),
        "vocab_size": int(vocab_size),
        "rope_theta": float(legacy.get("rope_theta", 10000)),
        "rope_traditional": bool(legacy.get("rope_traditional", True)),
        "tie_word_embeddings": "output.weight" not in weights,
    }
    for key in ("max_position_embeddings", "max_seq_len", "max_sequence_length"):
        if legacy.get(key):
            config["max_position_embeddings"] = int(legacy[key])
            break
    if legacy.get("rope_scaling"):
        config["rope_scaling"] = legacy["rope_scaling"]
    if legacy.get("quantization"):
        config["quantization"] = dict(legacy["quantization"])
    config["legacy_config"] = dict(legacy)
    return config


def _load_legacy_model(path: Path, files: list[Path], where: str) -> tuple[nn.Module, dict]:
    from mlx_lm.models import llama

    legacy = _read_config(path, where)
    model_type = legacy.get("model_type")
    if model_type not in _LEGACY_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported architecture {model_type!r} in legacy-npz folder {where}: only the "
            "Llama/Mistral layout of mlx-examples can be read"
        )
    raw: dict[str, mx.array] = {}
    for file in files:
        raw.update(mx.load(str(file)))
    config = legacy_config_to_mlx(legacy, raw)

    weights: dict[str, mx.array] = {}
    unknown = []
    for name, value in raw.items():
        if _LEGACY_IGNORED.search(name):
            continue
        new = legacy_weight_name(name)
        if new is None:
            unknown.append(name)
        else:
            weights[new] = value
    if unknown:
        raise ModelLoadError(
            f"{where}: weights.npz has tensors the legacy Llama layout does not know: {', '.join(sorted(unknown)[:4])}"
        )

    model = llama.Model(llama.ModelArgs.from_dict(config))
    quantized = {name[: -len(".scales")] for name in weights if name.endswith(".scales")}
    if quantized:
        modules = dict(model.named_modules())

        def params_for(p: str, m: nn.Module):
            if p not in quantized or not hasattr(m, "to_quantized"):
                return False
            in_dims = modules[p].weight.shape[-1]
            group_size = in_dims // weights[f"{p}.scales"].shape[-1]
            bits = weights[f"{p}.weight"].shape[-1] * 32 // in_dims
            return {"group_size": group_size, "bits": bits}

        q = config.get("quantization") or {}
        nn.quantize(model, group_size=q.get("group_size", 64), bits=q.get("bits", 4), class_predicate=params_for)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as err:
        raise ModelLoadError(f"{where}: legacy weights do not fit the model its config describes: {_one_line(err)}") from err
    return model, config


def _spm_detect_normalization(sp) -> tuple[bool, bool]:
    """(strips ends, collapses inner runs of spaces): SentencePiece's remove_extra_whitespaces."""
    strips = sp.encode("a ") == sp.encode("a") and sp.encode(" a") == sp.encode("a")
    collapses = sp.encode("a  b") == sp.encode("a b")
    return strips, collapses


def _load_legacy_tokenizer(path: Path, eos_token_ids=None):
    """A TokenizerWrapper built from a bare SentencePiece ``tokenizer.model``.

    transformers converts it into a fast Llama tokenizer (BOS added, as mlx-examples did by
    hand). SentencePiece models trained with ``remove_extra_whitespaces`` (the default) strip
    and collapse spaces before encoding; the conversion drops that, so it is put back as a
    normaliser, keeping token ids identical to SentencePiece's.
    """
    import sentencepiece as spm
    from mlx_lm import tokenizer_utils as tu
    from tokenizers import Regex, normalizers, pre_tokenizers
    from transformers import LlamaTokenizer
    from transformers.utils import logging as hf_logging

    model_file = path / "tokenizer.model"
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = LlamaTokenizer.from_pretrained(str(path), add_bos_token=True, add_eos_token=False)
    finally:
        hf_logging.set_verbosity(verbosity)

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    strips, collapses = _spm_detect_normalization(sp)
    backend = tokenizer.backend_tokenizer
    extra = []
    if strips:
        extra.append(normalizers.Strip(left=True, right=True))
    if collapses:
        extra.append(normalizers.Replace(Regex(" {2,}"), " "))
    if extra:
        if backend.normalizer is not None:
            extra.append(backend.normalizer)
        backend.normalizer = normalizers.Sequence(extra)
        # The converted tokenizer prepends the "▁" dummy prefix only to text at offset 0 of the
        # input ("first"); once leading spaces are stripped the text starts later, so prepend it
        # to every piece of text, as SentencePiece does to every string it encodes.
        dummy_prefix = bool(sp.encode("a", out_type=str)) and sp.encode("a", out_type=str)[0].startswith("\u2581")
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="always" if dummy_prefix else "never", split=False
        )

    detokenizer_class = tu.NaiveStreamingDetokenizer
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
        if tu._is_spm_decoder(decoder):
            detokenizer_class = tu.SPMStreamingDetokenizer
        elif tu._is_spm_decoder_no_space(decoder):
            from functools import partial

            detokenizer_class = partial(tu.SPMStreamingDetokenizer, trim_space=False)
    except AttributeError:  # mlx-lm renamed its decoder checks: the naive detokenizer is always right
        pass
    return tu.TokenizerWrapper(tokenizer, detokenizer_class, eos_token_ids=eos_token_ids)


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
    ``cast_scales``: False leaves the scales/biases of quantised layers in the checkpoint's
    dtype (the CPU kernels read float16 ones directly: half the bytes per token and no float32
    copies); `chatapp.backend.cpu.accelerate_model` casts those of the layers MLX still runs.
    Raises ModelLoadError with a one-line reason.
    """
    target, do_cast = _target_dtype(dtype)
    path, model_id = resolve_model_path(str(spec), progress=progress, offline=offline)
    where = str(spec) if Path(str(spec)).expanduser().is_dir() else f"{model_id} ({path})"

    fmt, weight_files = _check_files(path, where)
    if fmt == "mlx-lm":
        config = _read_config(path, where)
        _check_architecture(config, where)
    _check_memory(weight_files, target if do_cast else None, where)

    try:
        if fmt == "legacy-npz":
            model, config = _load_legacy_model(path, weight_files, where)
            if (path / "tokenizer.json").exists():
                from mlx_lm.utils import load_tokenizer

                tokenizer = load_tokenizer(path)
            elif (path / "tokenizer.model").exists():
                tokenizer = _load_legacy_tokenizer(path)
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
        raise ModelLoadError(f"could not load {where}: {type(err).__name__}: {_one_line(err)}") from err

    if do_cast:
        final = target or checkpoint_float_dtype(model)
        cast_floating(model, final, skip=None if cast_scales else is_quant_param)
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
    )


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
