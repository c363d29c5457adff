"""KV snapshots: a session's per-layer caches in one safetensors file, checked before use.

File: ``<data dir>/snapshots/<conversation id>.safetensors``, written with
``mx.save_safetensors`` to a temporary name in the same directory, flushed to disk, then moved
into place with ``os.replace`` (so a reader sees the old file or the new one, never half of
one; a failed write leaves the old file untouched).

Tensors:
    ``tokens``          int32 [n]: the token ids the caches represent (``Session.cached``,
                        evicted ones included)
    ``layer.<i>.<j>``   the j-th array of layer i's ``cache.state``

String metadata (all values are strings, as safetensors requires):
    ``format`` "chatapp-kv-snapshot", ``version`` "1",
    ``model_id``, ``weights_fingerprint``  (LoadedModel's: which weights made these keys),
    ``cache_mode``, ``cache_settings`` (CacheSettings as JSON), ``requested_mode`` (e.g. auto),
    ``layers``, ``layer_arrays`` (JSON list: arrays per layer), ``meta_states`` (JSON list of
    each layer's ``meta_state``), ``n_tokens``, ``tokens_sha256`` (of the ids, see
    :func:`token_hash`), ``messages`` (how many transcript messages the snapshot covers),
    ``transcript_sha256`` (:func:`token_hash` of those messages rendered to token ids),
    ``prompt_format``, ``conversation_id``, ``created``, and ``data_sha256``, a sha256 over
    every tensor's name, dtype, shape and bytes, so truncation or corruption anywhere is caught.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from cache import CacheSettings

from .paths import snapshot_tmp_path

FORMAT = "chatapp-kv-snapshot"
VERSION = "1"


class SnapshotError(Exception):
    """A snapshot that cannot be used; ``str()`` is the one-line reason."""


class SnapshotWriteError(Exception):
    """A snapshot could not be written (the previous one, if any, is intact)."""


def token_hash(tokens) -> str:
    """sha256 of token ids written as decimal numbers separated by commas."""
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode("ascii")).hexdigest()


def _tensor_bytes(a: mx.array) -> memoryview:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16: hash the same bits as uint16
        a = a.view(mx.uint16)
    return memoryview(np.ascontiguousarray(np.asarray(a))).cast("B")


def data_hash(arrays: dict[str, mx.array]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        h.update(_tensor_bytes(a))
    return h.hexdigest()


def data_damage(arrays: dict[str, mx.array], expected: str | None) -> str:
    """"" when the arrays read from a file hash to ``expected`` (their :func:`data_hash`), else
    the one-line reason they cannot be used."""
    try:
        mx.eval(list(arrays.values()))
        digest = data_hash(arrays)
    except (RuntimeError, ValueError) as e:
        return f"the file is damaged ({error_reason(e)})"
    return "" if digest == expected else "the file is damaged (its checksum does not match)"


def state_nbytes(caches) -> int:
    """Bytes the caches' states would take in a snapshot (the tensors, without the header)."""
    return sum(a.nbytes for c in caches for a in c.state)


@dataclass
class Snapshot:
    """A snapshot read from disk and checked for integrity (not yet for fitting a session)."""

    path: Path
    model_id: str
    weights_fingerprint: str
    settings: CacheSettings
    requested_mode: str
    tokens: list[int]
    messages: int
    transcript_sha256: str
    prompt_format: str
    conversation_id: int
    created: float
    renderings: list  # per covered message: the text the model saw when it differs from content (Message.raw)
    states: list[list[mx.array]] = field(repr=False)
    metas: list[tuple] = field(repr=False)
    nbytes: int = 0


def save_snapshot(path: str | Path, *, caches: list, tokens: list[int], settings: CacheSettings,
                  requested_mode: str, model_id: str, weights_fingerprint: str, messages: int,
                  transcript_sha256: str, prompt_format: str, conversation_id: int,
                  renderings: list | None = None) -> int:
    """Write a snapshot atomically; returns its size in bytes. Raises SnapshotWriteError."""
    path = Path(path)
    arrays: dict[str, mx.array] = {"tokens": mx.array(list(tokens), dtype=mx.int32)}
    counts, metas = [], []
    for i, c in enumerate(caches):
        state = list(c.state)
        counts.append(len(state))
        metas.append([str(x) for x in c.meta_state])
        for j, a in enumerate(state):
            arrays[f"layer.{i}.{j}"] = a  # slices of the cache's buffers: only the held tokens
    mx.eval(list(arrays.values()))
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "model_id": model_id,
        "weights_fingerprint": weights_fingerprint,
        "cache_mode": settings.mode,
        "cache_settings": json.dumps(asdict(settings), sort_keys=True),
        "requested_mode": requested_mode,
        "layers": str(len(caches)),
        "layer_arrays": json.dumps(counts),
        "meta_states": json.dumps(metas),
        "n_tokens": str(len(tokens)),
        "tokens_sha256": token_hash(tokens),
        "messages": str(int(messages)),
        "transcript_sha256": transcript_sha256,
        "renderings": json.dumps(list(renderings or [])),
        "prompt_format": prompt_format,
        "conversation_id": str(int(conversation_id)),
        "created": repr(time.time()),
        "data_sha256": data_hash(arrays),
    }
    tmp = snapshot_tmp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
        expected = sum(a.nbytes for a in arrays.values())
        with open(tmp, "rb+") as f:
            header = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            if size != 8 + header + expected:
                raise OSError(f"short write ({size} of {8 + header + expected} bytes)")
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except (OSError, RuntimeError, ValueError) as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise SnapshotWriteError(error_reason(e)) from None
    return size


def error_reason(e: BaseException) -> str:
    """One line saying why an OS or MLX call failed."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _meta(md: dict[str, str], key: str) -> str:
    if key not in md:
        raise SnapshotError(f"it lacks the {key!r} field")
    return md[key]


def read_snapshot(path: str | Path) -> Snapshot:
    """Read and check a snapshot; raises SnapshotError with the reason it cannot be used
    (missing, truncated, corrupt, another format or version)."""
    path = Path(path)
    if not path.exists():
        raise SnapshotError("no snapshot was saved")
    try:
        arrays, md = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise SnapshotError(f"the file is damaged ({error_reason(e)})") from None
    if md.get("format") != FORMAT:
        raise SnapshotError("the file is not a chatapp KV snapshot")
    if md.get("version") != VERSION:
        raise SnapshotError(f"snapshot version {md.get('version')!r} is not {VERSION!r}")
    try:
        n_layers = int(_meta(md, "layers"))
        counts = json.loads(_meta(md, "layer_arrays"))
        metas = [tuple(m) for m in json.loads(_meta(md, "meta_states"))]
        settings = CacheSettings(**json.loads(_meta(md, "cache_settings")))
        n_tokens = int(_meta(md, "n_tokens"))
        messages = int(_meta(md, "messages"))
        conversation_id = int(_meta(md, "conversation_id"))
        renderings = json.loads(md.get("renderings", "[]"))
        if not isinstance(renderings, list) or not all(r is None or isinstance(r, str) for r in renderings):
            raise ValueError("renderings is not a list of strings")
        created = float(md.get("created", "0"))
    except (ValueError, TypeError) as e:  # CacheConfigError is a ValueError
        raise SnapshotError(f"its metadata is damaged ({error_reason(e)})") from None
    if len(counts) != n_layers or len(metas) != n_layers:
        raise SnapshotError("its metadata is damaged (layer counts disagree)")
    expected = {"tokens"} | {f"layer.{i}.{j}" for i in range(n_layers) for j in range(counts[i])}
    if set(arrays) != expected:
        raise SnapshotError("the file is damaged (tensors are missing or unexpected)")
    damage = data_damage(arrays, md.get("data_sha256"))
    if damage:
        raise SnapshotError(damage)
    tokens = arrays["tokens"].tolist()
    if len(tokens) != n_tokens or token_hash(tokens) != md.get("tokens_sha256"):
        raise SnapshotError("the file is damaged (its token ids do not match their hash)")
    states = [[arrays[f"layer.{i}.{j}"] for j in range(counts[i])] for i in range(n_layers)]
    return Snapshot(
        path=path, model_id=md.get("model_id", ""), weights_fingerprint=md.get("weights_fingerprint", ""),
        settings=settings, requested_mode=md.get("requested_mode", settings.mode), tokens=tokens,
        messages=messages, transcript_sha256=md.get("transcript_sha256", ""),
        prompt_format=md.get("prompt_format", ""), conversation_id=conversation_id, created=created,
        renderings=renderings,
        states=states, metas=metas, nbytes=path.stat().st_size,
    )


__all__ = [
    "FORMAT", "VERSION", "Snapshot", "SnapshotError", "SnapshotWriteError", "data_damage", "data_hash", "read_snapshot",
    "save_snapshot", "state_nbytes", "token_hash",
]
