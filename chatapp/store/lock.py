"""One writer per data directory: an exclusive ``fcntl.flock`` on ``chatapp.lock``.

The process that holds the lock writes the pid into the file. The kernel releases the lock
when that process exits, however it exits (SIGKILL included), so a stale lock never blocks
anyone; the pid in the file is only there to name the holder in messages.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from .paths import lock_path


class StoreBusy(Exception):
    """Another process holds the data directory's lock."""

    def __init__(self, data_dir: Path, pid: int | None):
        self.data_dir = Path(data_dir)
        self.pid = pid
        who = f"another chatapp (pid {pid})" if pid else "another chatapp"
        super().__init__(f"{who} is using the data directory {self.data_dir}")


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def holder_pid(data_dir: Path) -> int | None:
    """The pid written by the current holder (None when unknown or not held)."""
    return _read_pid(lock_path(data_dir))


class DataDirLock:
    """Held for the life of a writing process; :meth:`release` (or exit) frees it."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> "DataDirLock":
        """Take the lock, or raise :class:`StoreBusy` at once (never waits); OSError when the
        lock file cannot be created (read-only or missing directory)."""
        path = lock_path(data_dir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreBusy(Path(data_dir), _read_pid(path)) from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except OSError:
            pass  # the pid is informative only; the lock is what counts
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> "DataDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
