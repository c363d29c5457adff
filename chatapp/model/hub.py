"""Hugging Face: resolve a repo id to a folder on disk, downloading it with progress reports.

A complete copy in the local hub cache is used without touching the network; otherwise the
repo is downloaded (unless offline). Every failure the user can cause or fix (unknown repo, no
network, a gated repo) raises :class:`~chatapp.model.modelfiles.ModelLoadError` with one line.
No MLX here.
"""

from __future__ import annotations

import io
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm.std import tqdm as _std_tqdm

from chatapp.model.modelfiles import ModelLoadError, folder_complete, one_line

__all__ = ["ALLOW_PATTERNS", "DownloadProgress", "close_repo_names", "local_model_path", "progress_tqdm_class",
           "resolve_model_path"]

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


def looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or spec in (".", "..")
        or spec.count("/") > 1
        or "\\" in spec
        or not _REPO_ID.match(spec)
    )


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
        close = close_repo_names(repo_id)
        if close:
            return ModelLoadError(f"unknown model {repo_id!r}: no such repository on Hugging Face; close "
                                  f"{SUGGEST_AUTHOR} names: {', '.join(close)}")
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
        return ModelLoadError(f"downloading {repo_id} from Hugging Face failed: {one_line(err)}")
    return None


SUGGEST_AUTHOR = "mlx-community"  # where close names for an unknown repo id are looked for
_SUGGEST_QUERIES = 4  # hub searches at most, each a shorter prefix of the name


def _search_queries(name: str) -> list[str]:
    """"Llama-2-7b-4bit" -> ["Llama-2-7b-4bit", "Llama-2-7b", "Llama-2", "Llama"]: the hub searches
    by substring, so a name that does not exist is shortened at its separators until some match."""
    cuts = [m.start() for m in re.finditer(r"[-_. ]", name)] + [len(name)]
    queries = [name[:cut] for cut in reversed(cuts) if cut >= 3]
    return list(dict.fromkeys(queries or [name]))[:_SUGGEST_QUERIES]


def close_repo_names(repo_id: str, limit: int = 5) -> list[str]:
    """Up to ``limit`` repo ids of :data:`SUGGEST_AUTHOR` closest to ``repo_id`` by name, from the
    hub's search; [] when the search fails (it is only a hint)."""
    import difflib

    from huggingface_hub import HfApi
    from huggingface_hub.utils import logging as hub_logging

    name = repo_id.rsplit("/", 1)[-1]
    found: dict[str, None] = {}
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # no "Retrying in 1s" lines around a one-line error
    try:
        for query in _search_queries(name):
            for model in HfApi().list_models(author=SUGGEST_AUTHOR, search=query, limit=100):
                if model.id != repo_id:
                    found[model.id] = None
            if len(found) >= limit:
                break
    except Exception:  # noqa: BLE001 - no suggestions then
        return []
    finally:
        hub_logging.set_verbosity(verbosity)

    def closeness(candidate: str) -> float:
        return difflib.SequenceMatcher(None, name.lower(), candidate.rsplit("/", 1)[-1].lower()).ratio()

    return sorted(found, key=lambda c: (-closeness(c), c))[:limit]


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


def local_model_path(spec: str) -> tuple[Path, str] | None:
    """(path, model_id) of ``spec`` when it is on disk already (a folder, or a repo in the hub
    cache), else None; never touches the network."""
    local = Path(spec).expanduser()
    if local.is_dir():
        return local.resolve(), local.resolve().name
    if looks_like_path(spec):
        return None
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(spec, allow_patterns=ALLOW_PATTERNS, cache_dir=str(_hf_cache_dir()),
                                 local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (or not a valid id): unknown until it is downloaded
        return None
    return Path(path), spec


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
    if looks_like_path(spec):
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
        if offline or folder_complete(path):
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
                raise ModelLoadError(f"downloading {repo_id} failed: {one_line(err)}") from err
            raise
        raise mapped from err
    tqdm_class._tracker.finish()
    return Path(path), repo_id


# --------------------------------------------------------------------------------------------
# GGUF repos: one file of a repo, not a snapshot


def _gguf_choice(repo_id: str, names: list[str], filename: str | None) -> str:
    """The GGUF file to use among ``names``; ModelLoadError when it is not there or not chosen."""
    if filename is not None:
        if filename not in names:
            listed = f"its GGUF files: {', '.join(names)}" if names else "it holds no GGUF files"
            raise ModelLoadError(f"{repo_id} has no file {filename!r} ({listed})")
        return filename
    if len(names) > 1:
        raise ModelLoadError(f"{repo_id} holds {len(names)} GGUF files; choose one with --gguf-file NAME or "
                             f"{repo_id}:NAME: {', '.join(names)}")
    return names[0]


def resolve_gguf_file(
    repo_id: str,
    filename: str | None = None,
    *,
    progress: Callable[[DownloadProgress], None] | None = None,
    offline: bool | None = None,
) -> Path | None:
    """The local path of a repo's GGUF file (``filename``, or its only one), downloading it if
    needed; None when the repo is an ordinary (config.json) model repo and no file was named.

    The cache is looked at first (a cached file needs no network); offline, only the cache.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    cache_dir = _hf_cache_dir()
    offline = _env_offline() if offline is None else offline
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=["*.gguf", "config.json"],
                                        cache_dir=str(cache_dir), local_files_only=True))
    except HFValidationError as err:
        raise ModelLoadError(f"{repo_id!r} is neither a local path nor a valid Hugging Face repo id") from err
    except Exception:  # noqa: BLE001 - not cached
        cached = None
    local = sorted(p.name for p in cached.glob("*.gguf")) if cached else []
    if cached and (filename in local or (filename is None and local and not (cached / "config.json").exists())):
        return cached / _gguf_choice(repo_id, local, filename)
    if offline:
        if filename is None and not local:
            return None  # not a cached GGUF repo: the folder path says what is missing
        raise ModelLoadError(f"offline mode is on and {repo_id}{':' + filename if filename else ''} is not in the "
                             f"local cache ({cache_dir})")
    if filename is None:
        # no online listing: the hub client retries an unreachable hub for ~20 s before every
        # download, and an ordinary repo is the common case (its download reports what is missing)
        return None
    name = filename
    tqdm_class = progress_tqdm_class(progress, None)
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=[name], cache_dir=str(cache_dir),
                                      tqdm_class=tqdm_class, max_workers=1))
    except Exception as err:  # noqa: BLE001
        mapped = _hub_error(repo_id, err, cache_dir)
        if mapped is None:
            raise ModelLoadError(f"downloading {repo_id}:{name} failed: {one_line(err)}") from err
        raise mapped from err
    tqdm_class._tracker.finish()
    if not (path / name).is_file():
        found = sorted(p.name for p in path.glob("*.gguf"))
        raise ModelLoadError(f"{repo_id} has no file {name!r}" + (f" (it has: {', '.join(found)})" if found else ""))
    return path / name
