"""Where chatapp keeps what it can make again: compiled kernels, downloaded models, built
tokenizers. One rule, below every layer (importing it loads nothing heavy)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_root() -> Path:
    """``$CHATAPP_CACHE_DIR`` when set, else the platform's user cache dir for chatapp."""
    if os.environ.get("CHATAPP_CACHE_DIR"):
        return Path(os.environ["CHATAPP_CACHE_DIR"]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("chatapp"))
