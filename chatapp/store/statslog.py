"""``--stats-json FILE``: one JSON object per turn, appended; the one writer of those rows.

Used by ``--no-tui`` (``stdin_chat``) and by a distributed run's rank 0; each row is
:meth:`~chatapp.engine.stats.TurnStats.to_json` plus what the caller adds (the conversation id
and how it was resumed; the per-rank cache use of a distributed run).
"""

from __future__ import annotations

import json
from typing import Any, TextIO


class StatsLog:
    """Append turn rows to ``path`` (None: a log that writes nothing)."""

    def __init__(self, path: str | None):
        self._file: TextIO | None = open(path, "a", encoding="utf-8") if path else None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, stats, **extra: Any) -> None:
        """One row: the turn's statistics, then ``extra``'s keys; flushed at once (a killed run
        keeps every finished turn)."""
        if self._file is None:
            return
        row = stats.to_json()
        row.update(extra)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
