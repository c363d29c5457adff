"""Where numba keeps the compiled kernels: a folder named for this package's source.

numba's disk cache checks only the file that holds a cached function: a kernel whose callee in
another module changed (quant_split.dequant_rows under prefill_attention.chunk_attention, say)
loaded its old machine code, silently, until its own file changed too. That happens to every
editable install after a pull, and to anyone who edits a kernel. So the cache lives in a folder
named for a digest of every source file here and numba's version: any change to any kernel
compiles all of them afresh, once, and folders of older sources are never read again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from chatapp.user_dirs import user_cache_root

_SOURCE = Path(__file__).resolve().parent


def source_digest() -> str:
    """A digest of this package's source files (names and contents) and numba's version."""
    h = hashlib.sha256()
    try:
        import numba

        h.update(numba.__version__.encode())
    except ImportError:
        pass
    for path in sorted(_SOURCE.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def kernel_cache_dir() -> Path:
    """The folder for this source's compiled kernels: under ``$NUMBA_CACHE_DIR`` where it is set
    (the start bench, the precompile test), else under the user's cache for chatapp."""
    root = os.environ.get("NUMBA_CACHE_DIR")
    return (Path(root) if root else user_cache_root() / "numba") / source_digest()



def use_kernel_cache_dir() -> None:
    """Point numba's disk cache at ``kernel_cache_dir()``, before any kernel is defined (numba
    reads the setting when a cached function is created, at its module's import)."""
    try:
        from numba.core import config
    except ImportError:
        return
    config.CACHE_DIR = str(kernel_cache_dir())
