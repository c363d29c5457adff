"""Was this process started as a rank of a distributed job?  (no MLX here: the CLI asks before the
BLAS preload, which must come before ``mlx.core``)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def world_from_env(env: dict[str, str] | None = None) -> tuple[int, int, str] | None:
    """(rank, size, backend) as the launcher told this process, or None outside a launched job.

    Read from the variables the launchers set: ``mlx.launch --backend ring`` exports
    ``MLX_RANK`` and ``MLX_HOSTFILE`` (a file holding a JSON list with one entry per rank; it is
    empty for a single host without ``-n``), ``--backend jaccl`` ``MLX_RANK`` and
    ``MLX_IBV_DEVICES`` (a JSON file, one row per rank), ``--backend nccl`` ``MLX_RANK`` and
    ``MLX_WORLD_SIZE``, and ``mpirun`` (``--backend mpi``) ``OMPI_COMM_WORLD_SIZE`` /
    ``PMI_SIZE`` with the matching rank variable.
    """
    env = os.environ if env is None else env

    def as_int(v: str | None) -> int | None:
        try:
            return int(v) if v is not None and v.strip() != "" else None
        except ValueError:
            return None

    def json_rows(path: str | None) -> int | None:
        if not path:
            return None
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        if not text:
            return 1
        try:
            data = json.loads(text)
        except ValueError:
            return None
        return len(data) if isinstance(data, list) else None

    rank = as_int(env.get("MLX_RANK"))
    if rank is not None:
        if env.get("MLX_WORLD_SIZE"):
            size = as_int(env.get("MLX_WORLD_SIZE"))
            return (rank, size, "nccl") if size else None
        if env.get("MLX_IBV_DEVICES"):
            size = json_rows(env.get("MLX_IBV_DEVICES"))
            return (rank, size, "jaccl") if size else None
        if env.get("MLX_HOSTFILE"):
            size = json_rows(env.get("MLX_HOSTFILE"))
            return (rank, size, "ring") if size else None
    for size_var, rank_var in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK")):
        size = as_int(env.get(size_var))
        if size is not None:
            return (as_int(env.get(rank_var)) or 0, size, "mpi")
    return None


def launched(env: dict[str, str] | None = None) -> bool:
    """True inside a launched distributed job with more than one rank (imports no MLX)."""
    world = world_from_env(env)
    return world is not None and world[1] > 1
