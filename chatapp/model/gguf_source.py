"""Which GGUF file a ``--model`` spec names: a ``.gguf`` file, a folder holding one, or a hub
repo of GGUF files (``REPO:NAME``, or ``--gguf-file NAME``, which the CLI turns into that form).

The glue between the engine's loader and :mod:`chatapp.model.gguf`; it belongs with the folder
loaders in ``chatapp/model/`` once those move there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from chatapp.model.hub import DownloadProgress, looks_like_path, resolve_gguf_file
from chatapp.model.modelfiles import ModelLoadError

GGUF_SUFFIX = ".gguf"


def with_gguf_file(spec: str, filename: str) -> str:
    """The one spec for a repo/folder and a GGUF file in it: 'REPO:NAME' ('FOLDER/NAME' for a folder)."""
    if Path(spec).expanduser().is_dir():
        return str(Path(spec) / filename)
    return f"{spec}:{filename}"


def split_spec(spec: str) -> tuple[str, str | None]:
    """'org/repo:file.gguf' -> ('org/repo', 'file.gguf'); anything else -> (spec, None)."""
    if ":" in spec and not Path(spec).expanduser().exists():
        repo, _, name = spec.rpartition(":")
        if repo and name.lower().endswith(GGUF_SUFFIX):
            return repo, name
    return spec, None


def _several(where: str, files: list[Path]) -> ModelLoadError:
    names = ", ".join(p.name for p in files)
    return ModelLoadError(f"{where} holds {len(files)} GGUF files; choose one with --gguf-file NAME "
                          f"(or give the file's path): {names}")


def find_gguf(
    spec: str,
    *,
    progress: Callable[[DownloadProgress], None] | None = None,
    offline: bool | None = None,
) -> tuple[Path, str] | None:
    """(GGUF file, model id) when ``spec`` names a GGUF model, else None (a folder or repo in the
    mlx-lm layouts). A hub repo's file is downloaded if it is not cached (unless offline)."""
    repo, name = split_spec(spec)
    local = Path(repo).expanduser()
    if local.is_file():
        return (local.resolve(), local.stem) if local.suffix.lower() == GGUF_SUFFIX else None
    if local.is_dir():
        files = sorted(local.glob(f"*{GGUF_SUFFIX}"))
        if (local / "config.json").is_file() or not files:
            return None
        if len(files) > 1:
            raise _several(spec, files)
        return files[0].resolve(), files[0].stem
    if local.suffix.lower() == GGUF_SUFFIX or looks_like_path(repo):
        if local.suffix.lower() == GGUF_SUFFIX:
            raise ModelLoadError(f"no GGUF file at {spec}")
        return None  # the folder loader says there is nothing there
    path = resolve_gguf_file(repo, name, progress=progress, offline=offline)
    return (path, f"{repo}:{path.name}") if path is not None else None


def local_gguf(spec: str) -> Path | None:
    """The GGUF file ``spec`` names when it is on disk now (never the network; for --show-config)."""
    try:
        found = find_gguf(spec, offline=True)
    except ModelLoadError:
        return None
    return found[0] if found else None
