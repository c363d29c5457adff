"""Where conversations and KV snapshots live on disk.

The data directory is, first match wins:

1. ``--data-dir DIR`` on the command line;
2. ``$CHATAPP_DATA_DIR`` when set and non-empty (tests point it at a temporary directory);
3. ``data.dir`` from a config file, when non-empty;
4. ``platformdirs.user_data_dir("chatapp")`` (``~/.local/share/chatapp`` on Linux,
   ``~/Library/Application Support/chatapp`` on macOS).

Inside it::

    chatapp.sqlite3        the transcripts (SQLite, WAL mode; -wal and -shm files next to it)
    chatapp.lock           held (fcntl.flock) by the one process that writes; holds its pid
    snapshots/<id>.safetensors   the KV snapshot of conversation <id>
    prefixes/<start>-<parent>-<hash>.safetensors   one block of the shared-prefix KV store
                                                   (see prefixes.py)

Nothing here creates anything: paths are only computed.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "chatapp"
DATA_DIR_ENV = "CHATAPP_DATA_DIR"
DB_NAME = "chatapp.sqlite3"
LOCK_NAME = "chatapp.lock"
SNAPSHOT_DIR = "snapshots"
PREFIX_DIR = "prefixes"
SNAPSHOT_SUFFIX = ".safetensors"
TMP_MARK = ".tmp"


def resolve_data_dir(config=None) -> Path:
    """The data directory for ``config`` (a :class:`chatapp.config.Config`, or None)."""
    value = ""
    from_cli = False
    if config is not None:
        value = config.data.dir or ""
        from_cli = bool(value) and config.source("data.dir") == "command line"
    if from_cli:
        return Path(value).expanduser()
    env = os.environ.get(DATA_DIR_ENV, "")
    if env:
        return Path(env).expanduser()
    if value:
        return Path(value).expanduser()
    return Path(platformdirs.user_data_dir(APP_NAME))


def db_path(data_dir: Path) -> Path:
    return Path(data_dir) / DB_NAME


def lock_path(data_dir: Path) -> Path:
    return Path(data_dir) / LOCK_NAME


def snapshot_dir(data_dir: Path) -> Path:
    return Path(data_dir) / SNAPSHOT_DIR


def prefix_dir(data_dir: Path) -> Path:
    return Path(data_dir) / PREFIX_DIR


def snapshot_path(data_dir: Path, conversation_id: int) -> Path:
    return snapshot_dir(data_dir) / f"{int(conversation_id)}{SNAPSHOT_SUFFIX}"


def snapshot_tmp_path(final: Path) -> Path:
    """A temporary name next to ``final`` (same file system, so os.replace is atomic).

    It ends in ``.safetensors`` because ``mx.save_safetensors`` appends that suffix otherwise.
    """
    return final.with_name(f".{final.stem}.{os.getpid()}{TMP_MARK}{SNAPSHOT_SUFFIX}")


def is_tmp_snapshot(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(TMP_MARK + SNAPSHOT_SUFFIX)


def snapshot_files(data_dir: Path) -> list[Path]:
    """Finished snapshot files, oldest first (by modification time)."""
    d = snapshot_dir(data_dir)
    try:
        files = [p for p in d.iterdir() if p.suffix == SNAPSHOT_SUFFIX and not is_tmp_snapshot(p)]
    except OSError:
        return []
    out = []
    for p in files:
        try:
            out.append((p.stat().st_mtime, p.name, p))
        except OSError:
            continue
    return [p for _, _, p in sorted(out)]


def prune_snapshots(data_dir: Path, cap_bytes: int, keep: Path | None = None) -> list[Path]:
    """Delete the oldest snapshots until they use at most ``cap_bytes``; returns those deleted.

    ``keep`` (the snapshot just written) goes last: it is removed only if it alone is over the cap.
    """
    files = snapshot_files(data_dir)
    if keep is not None:
        files = [p for p in files if p != keep] + ([keep] if keep in files else [])
    sizes = {}
    for p in files:
        try:
            sizes[p] = p.stat().st_size
        except OSError:
            sizes[p] = 0
    total = sum(sizes.values())
    removed = []
    for p in files:
        if total <= cap_bytes:
            break
        try:
            p.unlink()
        except FileNotFoundError:
            pass
        total -= sizes[p]
        removed.append(p)
    return removed


def remove_stale_tmp(data_dir: Path) -> int:
    """Remove temporary snapshot files a killed writer left behind (call with the lock held)."""
    n = 0
    try:
        entries = list(snapshot_dir(data_dir).iterdir())
    except OSError:
        return 0
    for p in entries:
        if is_tmp_snapshot(p):
            try:
                p.unlink()
                n += 1
            except OSError:
                pass
    return n
