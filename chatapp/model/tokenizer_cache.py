"""Built GGUF tokenizers kept on disk, so that a model's second start does not build its
vocabulary again.

Building a SentencePiece vocabulary from a GGUF file ranks every split of every piece
(spm_rules.score_ordered_merges), and handing the result to transformers deep-copies it: Gemma 3's
262,144 pieces took 5.8 s of a 9.7 s load on the Xeon (2.5 s ranking, 1.2 s the tokenizers
model, 2.1 s the copy). The built pipeline is saved as a ``tokenizer.json`` under chatapp's
cache, named for a digest of the file's ``tokenizer.*`` metadata and of the code that builds
it, and transformers reads that file directly (no copy). A cache that cannot be written or read
only costs the next start the build.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from chatapp.user_dirs import user_cache_root

from .gguf_file import GGUFHeader

_BUILDERS = ("gguf_tokenizer.py", "spm_rules.py", "tokenizer_cache.py")


@functools.cache
def _builder_digest() -> bytes:
    """The source of the modules that build a vocabulary, and the tokenizers version: a change
    to either builds afresh (read once a process)."""
    import tokenizers

    h = hashlib.sha256(tokenizers.__version__.encode())
    here = Path(__file__).resolve().parent
    for name in _BUILDERS:
        h.update((here / name).read_bytes())
    return h.digest()


def vocabulary_digest(header: GGUFHeader) -> str:
    """A digest of everything a GGUF tokenizer is built from: the ``tokenizer.*`` metadata."""
    h = hashlib.sha256(_builder_digest())
    for key in sorted(k for k in header.metadata if k.startswith("tokenizer.")):
        value = header.metadata[key]
        h.update(key.encode() + b"\0")
        if isinstance(value, list) and value and isinstance(value[0], str):
            h.update("\0".join(value).encode("utf-8", "surrogatepass"))
        elif isinstance(value, list):
            h.update(np.asarray(value).tobytes())
        else:
            h.update(repr(value).encode())
        h.update(b"\1")
    return h.hexdigest()[:32]


def cached_tokenizer_path(header: GGUFHeader) -> Path:
    """Where the file's built tokenizer lives (or will) in chatapp's cache."""
    return user_cache_root() / "tokenizers" / f"{vocabulary_digest(header)}.json"


def from_file(path: Path, make: Callable[..., Any], **options) -> Any | None:
    """``make(tokenizer_file=path, **options)`` where a tokenizer file is there; None where it is
    not, or does not load (a torn or foreign file, then removed: the caller builds again)."""
    if not path.is_file():
        return None
    try:
        return make(tokenizer_file=str(path), **options)
    except Exception:  # noqa: BLE001 - whatever the file holds, the answer is to build again
        path.unlink(missing_ok=True)
        return None


def save(backend: Any, path: Path) -> bool:
    """Write the built pipeline to ``path`` (a whole file or none); False where it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        backend.save(str(partial))
        os.replace(partial, path)
    except OSError:
        return False
    return True
