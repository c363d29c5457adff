"""Conversations that survive: transcripts in SQLite, KV snapshots, resume.

The API (for the CLI and the TUI's sessions screen; see docs/persistence.md):

* :class:`ChatStore` (``ChatStore.open(data_dir, write=...)``): ``list_conversations``,
  ``get``, ``messages``, ``resolve`` (an id or "latest"), ``rename``, ``delete``, ``close``;
  :func:`export` renders one conversation as Markdown or JSON; :func:`model_spec_of` says
  which model continues a conversation.
* :func:`open_chat` / :class:`PersistentChat` (in :mod:`chatapp.store.chat`): a Session saved
  as it goes (``prepare``, ``send``, ``regenerate``, ``edit_last``, ``new_chat``,
  ``save_snapshot``, ``resume``, ``take_notes``, ``close``).
* :func:`resolve_data_dir`: where the data lives for a Config.

Importing this package loads no MLX (``chatapp sessions ...`` stays light, and the CLI may read
the store before the BLAS preload); :mod:`chatapp.store.chat` and :mod:`chatapp.store.snapshot`
load it, and the names they define are reachable here lazily.
"""

from __future__ import annotations

from .db import ChatStore, ConversationInfo, NotFound, ReadOnlyStore, StoredMessage, StoreError, model_spec_of
from .export import FORMATS as EXPORT_FORMATS
from .export import export
from .lock import StoreBusy
from .paths import DATA_DIR_ENV, resolve_data_dir, snapshot_path
from .textio import clean_text, decode_line, is_blank, read_lines

_CHAT_NAMES = ("open_chat", "PersistentChat", "ModelIdentity", "ResumeInfo", "Note", "Prepared")

__all__ = [
    "ChatStore", "ConversationInfo", "DATA_DIR_ENV", "EXPORT_FORMATS", "NotFound", "ReadOnlyStore", "StoreBusy",
    "StoreError", "StoredMessage", "clean_text", "decode_line", "export", "is_blank", "model_spec_of", "read_lines",
    "resolve_data_dir", "snapshot_path", *_CHAT_NAMES,
]


def __getattr__(name: str):
    # The chat layer imports the engine (and so MLX): load it only when asked for.
    if name in _CHAT_NAMES:
        from . import chat

        return getattr(chat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
