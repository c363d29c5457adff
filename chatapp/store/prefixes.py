"""The shared-prefix KV store: the full-precision K/V of conversation prefixes, on disk, shared by
every conversation of the same model and prompt format.

**Keys.** A token sequence is cut into blocks of :data:`BLOCK` tokens. Each block has a chain
hash, ``hash = H(parent hash, its token ids)``, where the first block's parent is the
*namespace*: a hash of the weights fingerprint, the prompt format's key, the model's arguments,
the K/V dtype and geometry (:class:`Namespace`). Equal hashes mean equal tokens from the start
of the conversation under the same model and format, so K/V can be shared.

**Files.** ``<data dir>/prefixes/<start>-<parent>-<hash>.safetensors``, one per block: K/V of
tokens ``[start, start + n)`` per layer (``layer.<i>.keys`` / ``layer.<i>.values``, shaped
[1, kv_heads, n, head_dim], in the cache's full-precision dtype), and string metadata:
``format`` "chatapp-kv-prefix", ``version`` "1", ``namespace``, ``parent``, ``hash``, ``start``,
``n_tokens``, ``tokens`` (JSON list), ``model_id`` and ``prompt_format`` (for listing only),
``created``, ``data_sha256`` (every tensor's name, dtype, shape and bytes). A block holds
:data:`BLOCK` tokens, or fewer at the end of a stored prefix (a *tail*); a full block written
later under the same parent replaces the tails it contains.

**Lookup** walks the chain of full blocks by hash (one ``stat`` each); where it stops, it takes,
among the blocks under the last parent, the one sharing the most leading tokens with the rest
of the prompt: the match is token-exact, so any common prefix is found, not only whole blocks.
Every block used is read and checked (format, version, namespace, the hash of its tokens, the
data checksum, shapes): a damaged or foreign block is skipped with one line and removed, and the
prefix ends before it.

**Bounds.** After each write, the least recently used blocks are removed until all of them fit
in ``data.prefix_cap_mb``. Using a prefix touches its blocks leaf first, so the blocks nearest
the start of a chain (shared by most prefixes) are the most recent and go last.

Writes go to a temporary file moved into place with ``os.replace`` (a reader sees a whole block
or none); they are not fsync'ed: a block torn by a power cut fails its checksum and is removed.
Only the process holding the data directory's lock writes, touches or removes; others may read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from chatapp.prompt.conversation import common_prefix

FORMAT = "chatapp-kv-prefix"
VERSION = "1"
BLOCK = 256  # tokens per block: large enough that a 2,000-token prompt is a handful of files
MIN_REUSE = 32  # a shorter match costs more to read and convert than to prefill
SUFFIX = ".safetensors"
_NAME = re.compile(r"^(\d+)-([0-9a-f]{32})-([0-9a-f]{32})\.safetensors$")
_TMP_MARK = ".tmp"


class PrefixError(Exception):
    """A block that cannot be used (damaged, foreign); ``str()`` is the one-line reason."""


class PrefixWriteError(Exception):
    """A block could not be written (disk full, read-only); ``str()`` is the reason."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def chain_hash(parent: str, tokens: Iterable[int]) -> str:
    """The hash of a block: its parent's hash and its token ids."""
    return _digest(parent + ":" + ",".join(str(int(t)) for t in tokens))


@dataclass(frozen=True)
class Namespace:
    """Whose K/V these are: everything that changes the keys and values of the same token ids."""

    weights_fingerprint: str
    prompt_format: str  # PromptFormat.key: the exact rendering
    model_config: str  # hash of the model's arguments (RoPE, norms, ...)
    dtype: str  # the caches' full-precision dtype
    layers: int
    kv_heads: int
    head_dim: int
    model_id: str = field(default="", compare=False)  # shown by `chatapp sessions prefixes`; not keyed

    @property
    def root(self) -> str:
        keyed = {k: v for k, v in asdict(self).items() if k != "model_id"}
        return _digest(json.dumps({"format": FORMAT, "version": VERSION, "block": BLOCK, **keyed}, sort_keys=True))


@dataclass
class BlockInfo:
    """A block as its file name and header describe it (read without loading any tensor)."""

    path: Path
    start: int
    parent: str
    hash: str
    tokens: list[int]
    namespace: str
    model_id: str
    prompt_format: str
    size: int
    used: int  # last use, ns since the epoch (the file's mtime)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class _Segment:
    path: Path
    start: int
    parent: str
    hash: str
    use: int  # how many of its tokens the prompt shares


def block_name(start: int, parent: str, h: str) -> str:
    return f"{start}-{parent}-{h}{SUFFIX}"


def parse_name(path: Path) -> tuple[int, str, str] | None:
    m = _NAME.match(path.name)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else None


def read_header(path: Path) -> dict[str, str]:
    """The string metadata of a safetensors file, read without the tensors (no MLX needed)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise PrefixError("the file is truncated")
            n = struct.unpack("<Q", head)[0]
            if n > 16 << 20:
                raise PrefixError("the header is implausibly large")
            raw = f.read(n)
    except OSError as e:
        raise PrefixError(e.strerror or str(e)) from None
    if len(raw) != n:
        raise PrefixError("the file is truncated")
    try:
        meta = json.loads(raw).get("__metadata__") or {}
    except (ValueError, AttributeError):
        raise PrefixError("the header is damaged") from None
    if not isinstance(meta, dict):
        raise PrefixError("the header is damaged")
    return meta


def block_info(path: Path) -> BlockInfo:
    """A block's identity and tokens from its name and header; PrefixError if they disagree."""
    parsed = parse_name(path)
    if parsed is None:
        raise PrefixError("not a prefix block name")
    start, parent, h = parsed
    md = read_header(path)
    if md.get("format") != FORMAT or md.get("version") != VERSION:
        raise PrefixError("not a chatapp prefix block of this version")
    try:
        tokens = [int(t) for t in json.loads(md["tokens"])]
        if int(md["start"]) != start or md["parent"] != parent or md["hash"] != h:
            raise ValueError("its name and header disagree")
    except (KeyError, ValueError, TypeError) as e:
        raise PrefixError(f"its metadata is damaged ({e})") from None
    if not tokens or chain_hash(parent, tokens) != h:
        raise PrefixError("its token ids do not match its hash")
    st = path.stat()
    return BlockInfo(path, start, parent, h, tokens, md.get("namespace", ""), md.get("model_id", ""),
                     md.get("prompt_format", ""), st.st_size, st.st_mtime_ns)


def namespace_for(session, weights_fingerprint: str, model_id: str = "") -> Namespace:
    """The namespace of a session's K/V: its model's weights and arguments, its prompt format,
    the dtype and geometry of its caches."""
    from chatapp.backend.fused_install import cache_kv_dtype
    from chatapp.model.device import activation_float_dtype, dtype_name

    # the fused CPU routes keep K/V in their own dtype (cpu.kv_dtype), else the model's
    kv_dtype = cache_kv_dtype(session.model) or activation_float_dtype(session.model)
    args = getattr(session.model, "args", None)
    fields = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    config = _digest(json.dumps(fields, sort_keys=True, default=str))
    g = session.geometry
    return Namespace(weights_fingerprint, session.format.key, config, dtype_name(kv_dtype),
                     g.n_layers, g.n_kv_heads, g.head_dim, model_id)


class StoreSource:
    """A :class:`PrefixStore` as a session's ``prefix_source`` (see chatapp/engine/prefix.py);
    ``on_note`` receives the one-line notes of skipped blocks."""

    def __init__(self, store: "PrefixStore", namespace: Namespace, on_note):
        self.store, self.namespace, self.on_note = store, namespace, on_note

    def lookup(self, tokens: list[int]):
        from chatapp.engine.prefix import PrefixHit

        kv, n, notes = self.store.lookup(self.namespace, tokens)
        for note in notes:
            self.on_note(note)
        return PrefixHit(n, kv) if kv is not None else None


@dataclass
class StoredPrefix:
    """One stored prefix, as `chatapp sessions prefixes` lists it: a chain of blocks from the
    start of a conversation to a block nothing extends (blocks shared by several are counted in each)."""

    id: str  # the last block's hash
    model_id: str
    prompt_format: str
    tokens: int
    blocks: int
    bytes: int
    last_used: float  # Unix seconds
    complete: bool  # False when a block before it is missing (it cannot be reached; pruning removes it)

    def to_json(self) -> dict:
        return asdict(self)


def stored_prefixes(infos: list[BlockInfo]) -> list[StoredPrefix]:
    """The prefixes the blocks form, the most recently used first."""
    by_hash = {b.hash: b for b in infos}
    parents = {b.parent for b in infos}
    out = []
    for leaf in (b for b in infos if b.hash not in parents):
        chain, b = [leaf], leaf
        while b.start > 0 and b.parent in by_hash:
            b = by_hash[b.parent]
            chain.append(b)
        out.append(StoredPrefix(leaf.hash, leaf.model_id, leaf.prompt_format, leaf.end, len(chain),
                                sum(c.size for c in chain), max(c.used for c in chain) / 1e9, chain[-1].start == 0))
    return sorted(out, key=lambda p: -p.last_used)


class PrefixStore:
    """The blocks in one directory; see the module docstring.

    ``writable`` (the process holds the data directory's lock) allows writing, touching and
    removing; a read-only store only looks up. ``cap_bytes`` bounds the blocks' total size.
    """

    def __init__(self, directory: str | Path, cap_bytes: int, writable: bool = True):
        self.dir = Path(directory)
        self.cap_bytes = int(cap_bytes)
        self.writable = writable

    # ---- lookup -----------------------------------------------------------------------------------
    def match(self, ns: Namespace, tokens: list[int]) -> tuple[list[_Segment], list[str]]:
        """The blocks covering the longest stored prefix of ``tokens`` (header checks only), and a
        note for each unusable block met on the way (removed when writable)."""
        parent, pos, segments, notes = ns.root, 0, [], []
        while pos < len(tokens):
            block = tokens[pos : pos + BLOCK]
            if len(block) == BLOCK:
                h = chain_hash(parent, block)
                path = self.dir / block_name(pos, parent, h)
                if path.exists():
                    segments.append(_Segment(path, pos, parent, h, BLOCK))
                    parent, pos = h, pos + BLOCK
                    continue
            best = self._best_child(parent, pos, tokens[pos:], notes)
            if best is not None:
                segments.append(best)
            break
        return segments, notes

    def _best_child(self, parent: str, pos: int, rest: list[int], notes: list[str]) -> _Segment | None:
        best: _Segment | None = None
        for path in self._children(pos, parent):
            try:
                info = block_info(path)
            except (PrefixError, OSError) as e:
                notes.append(self._drop(path, str(e)))
                continue
            n = common_prefix(info.tokens, rest)
            if n and (best is None or n > best.use):
                best = _Segment(path, pos, parent, info.hash, n)
        return best

    def _children(self, pos: int, parent: str) -> list[Path]:
        head = f"{pos}-{parent}-"
        try:
            return sorted(p for p in self.dir.iterdir() if p.name.startswith(head) and p.name.endswith(SUFFIX))
        except OSError:
            return []

    def load(self, ns: Namespace, segments: list[_Segment], tokens: list[int]):
        """Read and check the blocks; returns (K/V per layer covering the first n tokens, n, notes).

        A block that fails a check ends the prefix there (its note says why; it is removed)."""
        import mlx.core as mx

        per_layer: list[list[tuple]] = [[] for _ in range(ns.layers)]
        n, notes, used = 0, [], []
        for seg in segments:
            try:
                kv = self._read_block(ns, seg, tokens)
            except PrefixError as e:
                notes.append(self._drop(seg.path, str(e)))
                break
            for i, (k, v) in enumerate(kv):
                per_layer[i].append((k[:, :, : seg.use], v[:, :, : seg.use]))
            n += seg.use
            used.append(seg.path)
        if not n:
            return None, 0, notes
        kv = [(mx.concatenate([k for k, _ in parts], axis=2) if len(parts) > 1 else parts[0][0],
               mx.concatenate([v for _, v in parts], axis=2) if len(parts) > 1 else parts[0][1])
              for parts in per_layer]
        self.touch(used)
        return kv, n, notes

    def lookup(self, ns: Namespace, tokens: list[int]):
        """(K/V per layer, tokens covered, notes) for the longest stored prefix of ``tokens``;
        (None, 0, notes) when less than :data:`MIN_REUSE` tokens are stored."""
        segments, notes = self.match(ns, tokens)
        if sum(s.use for s in segments) < MIN_REUSE:
            return None, 0, notes
        kv, n, more = self.load(ns, segments, tokens)
        return kv, n, notes + more

    def covered(self, ns: Namespace, tokens: list[int]) -> int:
        """How many leading ``tokens`` are stored (header checks only, nothing read or touched)."""
        segments, _ = self.match(ns, tokens)
        return sum(s.use for s in segments)

    def _read_block(self, ns: Namespace, seg: _Segment, tokens: list[int]) -> list[tuple]:
        import mlx.core as mx

        from .snapshot import data_damage, error_reason

        try:
            arrays, md = mx.load(str(seg.path), return_metadata=True)
        except (RuntimeError, ValueError, OSError) as e:
            raise PrefixError(f"the file is damaged ({error_reason(e)})") from None
        if md.get("format") != FORMAT or md.get("version") != VERSION:
            raise PrefixError("not a chatapp prefix block of this version")
        if md.get("namespace") != ns.root or md.get("parent") != seg.parent:
            raise PrefixError("it belongs to another model or prompt format")
        try:
            block_tokens = [int(t) for t in json.loads(md.get("tokens", "[]"))]
        except (ValueError, TypeError):
            raise PrefixError("its metadata is damaged") from None
        if chain_hash(seg.parent, block_tokens) != seg.hash or md.get("hash") != seg.hash:
            raise PrefixError("its token ids do not match its hash")
        if block_tokens[: seg.use] != tokens[seg.start : seg.start + seg.use]:
            raise PrefixError("its token ids are not the prompt's")
        expected = {f"layer.{i}.{kind}" for i in range(ns.layers) for kind in ("keys", "values")}
        if set(arrays) != expected:
            raise PrefixError("it does not fit this model (layers differ)")
        shape = (1, ns.kv_heads, len(block_tokens), ns.head_dim)
        for name, a in arrays.items():
            if tuple(a.shape) != shape or str(a.dtype).removeprefix("mlx.core.") != ns.dtype:
                raise PrefixError(f"it does not fit this model ({name} is {a.dtype} {tuple(a.shape)})")
        damage = data_damage(arrays, md.get("data_sha256"))
        if damage:
            raise PrefixError(damage)
        return [(arrays[f"layer.{i}.keys"], arrays[f"layer.{i}.values"]) for i in range(ns.layers)]

    # ---- writing ----------------------------------------------------------------------------------
    def put(self, ns: Namespace, tokens: list[int], kv) -> int:
        """Store the K/V of ``tokens`` (``kv``: per layer, keys and values covering all of them);
        blocks already stored are kept and touched. Returns the bytes written. Raises
        PrefixWriteError (blocks written before the failure stay)."""
        if not self.writable:
            raise PrefixWriteError("the prefix store is read-only here")
        dtype = str(kv[0][0].dtype).removeprefix("mlx.core.")
        if dtype != ns.dtype:  # a lookup would refuse such blocks: do not write them
            raise PrefixWriteError(f"the caches hold {dtype} keys and values, not the model's {ns.dtype}")
        parent, pos, chain, written = ns.root, 0, [], 0
        while pos < len(tokens):
            block = tokens[pos : pos + BLOCK]
            h = chain_hash(parent, block)
            path = self.dir / block_name(pos, parent, h)
            siblings = [] if path.exists() else self._sibling_infos(pos, parent)
            if len(block) < BLOCK and any(s.tokens[: len(block)] == block for s in siblings):
                chain += [s.path for s in siblings if s.tokens[: len(block)] == block][:1]
                break  # a longer block under the same parent already holds this tail
            if not path.exists():
                written += self._write_block(path, ns, parent, h, pos, block, kv)
                for s in siblings:  # tails this block contains are no longer needed
                    if len(s.tokens) < len(block) and block[: len(s.tokens)] == s.tokens:
                        self._unlink(s.path)
            chain.append(path)
            parent, pos = h, pos + len(block)
        self.touch(chain)
        self.prune(keep=chain)
        return written

    def _sibling_infos(self, pos: int, parent: str) -> list[BlockInfo]:
        out = []
        for p in self._children(pos, parent):
            try:
                out.append(block_info(p))
            except (PrefixError, OSError):
                continue  # a damaged sibling is dealt with when a lookup meets it
        return out

    def _write_block(self, path: Path, ns: Namespace, parent: str, h: str, start: int, block: list[int],
                     kv) -> int:
        import mlx.core as mx

        from .snapshot import data_hash, error_reason

        end = start + len(block)
        arrays = {}
        for i, (k, v) in enumerate(kv):
            arrays[f"layer.{i}.keys"] = k[:, :, start:end]
            arrays[f"layer.{i}.values"] = v[:, :, start:end]
        mx.eval(list(arrays.values()))
        metadata = {
            "format": FORMAT, "version": VERSION, "namespace": ns.root, "parent": parent, "hash": h,
            "start": str(start), "n_tokens": str(len(block)), "tokens": json.dumps(block),
            "model_id": ns.model_id, "prompt_format": ns.prompt_format, "created": repr(time.time()),
            "data_sha256": data_hash(arrays),
        }
        tmp = path.with_name(f".{h}.{os.getpid()}{_TMP_MARK}{SUFFIX}")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            mx.save_safetensors(str(tmp), arrays, metadata=metadata)
            size = tmp.stat().st_size
            os.replace(tmp, path)
        except (OSError, RuntimeError, ValueError) as e:
            self._unlink(tmp)
            raise PrefixWriteError(error_reason(e)) from None
        return size

    # ---- use, bounds, listing ---------------------------------------------------------------------
    def touch(self, chain: list[Path]) -> None:
        """Mark blocks used now, the leaf oldest: pruning then removes chains from their ends."""
        if not self.writable:
            return
        now = time.time_ns()
        for i, path in enumerate(reversed(chain)):
            try:
                os.utime(path, ns=(now + i, now + i))
            except OSError:
                pass

    def blocks(self) -> list[BlockInfo | Path]:
        """Every block file: its BlockInfo, or its path when it cannot be read."""
        out: list[BlockInfo | Path] = []
        try:
            paths = sorted(p for p in self.dir.iterdir() if parse_name(p) is not None)
        except OSError:
            return []
        for p in paths:
            try:
                out.append(block_info(p))
            except (PrefixError, OSError):
                out.append(p)
        return out

    def prune(self, keep: list[Path] = ()) -> list[Path]:
        """Remove blocks until they fit the cap: unreadable ones and orphans (whose parent block
        is gone) first, then the least recently used. ``keep`` goes last."""
        if not self.writable:
            return []
        files = []
        try:
            for p in self.dir.iterdir():
                parsed = parse_name(p)
                if parsed is None:
                    continue
                try:
                    st = p.stat()
                except OSError:
                    continue
                files.append((p, parsed, st.st_size, st.st_mtime_ns))
        except OSError:
            return []
        total = sum(size for _, _, size, _ in files)
        if total <= self.cap_bytes:
            return []
        hashes = {parsed[2] for _, parsed, _, _ in files}
        keep = set(keep)

        def order(item):
            p, (start, parent, _), _, used = item
            orphan = start > 0 and parent not in hashes
            return (p in keep, not orphan, used)

        removed = []
        for p, _, size, _ in sorted(files, key=order):
            if total <= self.cap_bytes:
                break
            self._unlink(p)
            total -= size
            removed.append(p)
        return removed

    def clear(self) -> tuple[int, int]:
        """Remove every block (and temporary file); returns (files, bytes) removed."""
        n = size = 0
        try:
            entries = list(self.dir.iterdir())
        except OSError:
            return 0, 0
        for p in entries:
            if parse_name(p) is None and not (p.name.startswith(".") and p.name.endswith(_TMP_MARK + SUFFIX)):
                continue
            try:
                size += p.stat().st_size
                p.unlink()
                n += 1
            except OSError:
                pass
        return n, size

    def _drop(self, path: Path, reason: str) -> str:
        """Remove an unusable block (when writable) and say so in one line."""
        removed = self.writable and self._unlink(path)
        return (f"prefix store: skipped {path.name} ({reason})" + ("; removed it" if removed else "")
                + ": prefilling instead")

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


__all__ = [
    "BLOCK", "BlockInfo", "FORMAT", "MIN_REUSE", "Namespace", "PrefixError", "PrefixStore", "PrefixWriteError",
    "StoreSource", "StoredPrefix", "VERSION", "block_info", "chain_hash", "namespace_for", "read_header",
    "stored_prefixes",
]
