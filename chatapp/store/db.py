"""The transcript store: every conversation and message in one SQLite database.

Schema (version 2)::

    meta(key TEXT PRIMARY KEY, value TEXT)            -- schema_version
    conversations(id INTEGER PRIMARY KEY AUTOINCREMENT, title, model_id, model_spec,
                  weights_fingerprint, prompt_format, created REAL, updated REAL)
    messages(conversation_id -> conversations.id ON DELETE CASCADE, seq INTEGER,
             role 'system'|'user'|'assistant', content TEXT,
             status 'complete'|'in_progress'|'interrupted', created REAL, updated REAL,
             PRIMARY KEY (conversation_id, seq))
    messages_fts                                      -- FTS5 index of messages.content (search.py),
                                                      -- kept in step by triggers; added in version 2

``seq`` is the message's index in the conversation. Times are Unix seconds. Ids are never
reused (AUTOINCREMENT), so a snapshot file named by id can only ever belong to that conversation.

The database runs in WAL mode with ``synchronous=NORMAL``: a commit survives the process being
killed (only a power loss can drop the last commits), readers never block the writer, and a
failed write (disk full, read-only file system) rolls back its transaction, leaving everything
committed before intact. Only the holder of the data directory's lock (see lock.py) opens the
store for writing; anyone may open it read-only.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import quote

from .lock import DataDirLock, StoreBusy
from .paths import db_path, remove_stale_tmp, snapshot_path
from .search import install_index
from .textio import clean_text

SCHEMA_VERSION = 2  # 2: the full-text index (search.py); a version-1 database is upgraded on open
ROLES = ("system", "user", "assistant")
STATUSES = ("complete", "in_progress", "interrupted")
TITLE_CHARS = 60

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL DEFAULT '',
    model_id TEXT NOT NULL DEFAULT '',
    model_spec TEXT NOT NULL DEFAULT '',
    weights_fingerprint TEXT NOT NULL DEFAULT '',
    prompt_format TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('complete', 'in_progress', 'interrupted')),
    created REAL NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (conversation_id, seq)
);
CREATE INDEX IF NOT EXISTS conversations_by_update ON conversations(updated);
"""


class StoreError(Exception):
    """The store cannot be used or changed; ``str()`` is one line for the user."""


class NotFound(StoreError):
    """No conversation with that id (or none at all for "latest")."""


class ReadOnlyStore(StoreError):
    """A change was asked of a store opened read-only."""


@dataclass
class StoredMessage:
    seq: int
    role: str
    content: str
    status: str  # "complete", "in_progress" or "interrupted"
    created: float
    updated: float

    @property
    def interrupted(self) -> bool:
        """Cut short (cancelled, or found unfinished after a crash)."""
        return self.status != "complete"

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ConversationInfo:
    id: int
    title: str
    model_id: str
    model_spec: str  # what to load to continue it: a local folder's absolute path or a repo id
    weights_fingerprint: str
    prompt_format: str
    created: float
    updated: float
    messages: int
    snapshot_bytes: int  # 0 when there is no snapshot

    def to_json(self) -> dict:
        return asdict(self)


def title_from(text: str) -> str:
    """A conversation title from its first user message: the first non-blank line, shortened."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"


def describe_sqlite_error(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


class ChatStore:
    """Transcripts in ``<data_dir>/chatapp.sqlite3``; use :meth:`open`.

    Opened for writing, the store holds the data directory's lock until :meth:`close`. Every
    method that changes something runs in one transaction, so it happens entirely or not at all.
    Safe to call from several threads (one connection behind a lock).
    """

    def __init__(self, data_dir: Path, conn: sqlite3.Connection | None, *, writable: bool,
                 lock: DataDirLock | None = None):
        self.data_dir = Path(data_dir)
        self.path = db_path(self.data_dir)
        self._conn = conn
        self.writable = writable
        self._lock = lock
        self._mutex = threading.RLock()
        self.recovered = 0  # in-progress replies found at open and marked interrupted

    # ---- opening ----------------------------------------------------------------------------
    @classmethod
    def open(cls, data_dir: str | Path, *, write: bool = True) -> "ChatStore":
        """Open the store in ``data_dir``.

        ``write=True`` creates the directory and database when missing, takes the lock (raising
        :class:`StoreBusy` when another process has it), marks replies left in progress by a
        killed process as interrupted (see :attr:`recovered`) and removes half-written snapshot
        files. ``write=False`` creates nothing: a missing database reads as empty.
        Raises :class:`StoreError` (or OSError for the directory) with a one-line reason.
        """
        data_dir = Path(data_dir).expanduser()
        if not write:
            return cls._open_read_only(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = DataDirLock.acquire(data_dir)
        store = None
        try:
            conn = _connect(db_path(data_dir))
            store = cls(data_dir, conn, writable=True, lock=lock)
            store._init_schema()
            store.recovered = store._recover()
            remove_stale_tmp(data_dir)
        except sqlite3.Error as e:
            if store is not None:
                store.close()
            lock.release()
            raise StoreError(f"cannot use {db_path(data_dir)}: {describe_sqlite_error(e)}") from None
        except BaseException:
            if store is not None:
                store.close()
            lock.release()
            raise
        return store

    @classmethod
    def _open_read_only(cls, data_dir: Path) -> "ChatStore":
        path = db_path(data_dir)
        if not path.exists():
            return cls(data_dir, None, writable=False)
        try:
            conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=5.0,
                                   isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA query_only=ON")
            version = _schema_version(conn)
        except sqlite3.Error as e:
            raise StoreError(f"cannot read {path}: {describe_sqlite_error(e)}") from None
        if version is None:
            conn.close()
            return cls(data_dir, None, writable=False)
        if version > SCHEMA_VERSION:
            conn.close()
            raise StoreError(
                f"{path} was written by a newer chatapp (schema {version}, this one reads {SCHEMA_VERSION})")
        return cls(data_dir, conn, writable=False)

    def _init_schema(self) -> None:
        try:
            version = _schema_version(self._conn)
            if version is not None and version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} was written by a newer chatapp (schema {version}, this one knows {SCHEMA_VERSION})"
                )
            with self._tx() as c:
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                install_index(c)
                c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                          (str(SCHEMA_VERSION),))
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot use {self.path}: {describe_sqlite_error(e)}") from None

    def _recover(self) -> int:
        """Replies a killed process left "in progress" become "interrupted" (empty ones go)."""
        with self._tx() as c:
            c.execute("DELETE FROM messages WHERE status = 'in_progress' AND content = ''")
            cur = c.execute("UPDATE messages SET status = 'interrupted' WHERE status = 'in_progress'")
            return cur.rowcount

    # ---- plumbing -----------------------------------------------------------------------------
    def _tx(self):
        return _Transaction(self)

    def _need_write(self) -> None:
        if not self.writable:
            raise ReadOnlyStore(f"the conversation store in {self.data_dir} is open read-only")
        if self._conn is None:
            raise StoreError("the conversation store is closed")

    def _query(self, sql: str, args: Sequence = ()) -> list[tuple]:
        if self._conn is None:
            return []
        with self._mutex:
            return self._conn.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._mutex:
            if self._conn is not None:
                try:
                    self._conn.close()
                except sqlite3.Error:
                    pass
                self._conn = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> "ChatStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading ------------------------------------------------------------------------------
    _INFO_SQL = (
        "SELECT c.id, c.title, c.model_id, c.model_spec, c.weights_fingerprint, c.prompt_format, "
        "c.created, c.updated, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) "
        "FROM conversations c"
    )

    def _info(self, row: tuple) -> ConversationInfo:
        try:
            size = snapshot_path(self.data_dir, row[0]).stat().st_size
        except OSError:
            size = 0
        return ConversationInfo(*row, snapshot_bytes=size)

    def list_conversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently updated first."""
        rows = self._query(self._INFO_SQL + " ORDER BY c.updated DESC, c.id DESC")
        return [self._info(r) for r in rows]

    def get(self, conversation_id: int) -> ConversationInfo:
        rows = self._query(self._INFO_SQL + " WHERE c.id = ?", (int(conversation_id),))
        if not rows:
            raise NotFound(f"no conversation {conversation_id} in {self.data_dir}")
        return self._info(rows[0])

    def latest_id(self) -> int | None:
        rows = self._query("SELECT id FROM conversations ORDER BY updated DESC, id DESC LIMIT 1")
        return rows[0][0] if rows else None

    def resolve(self, ref: int | str | None) -> int:
        """A conversation id from a user's reference: an id, or None / "latest" for the latest."""
        if ref is None or (isinstance(ref, str) and ref.strip().lower() in ("", "latest")):
            cid = self.latest_id()
            if cid is None:
                raise NotFound(f"there is no saved conversation in {self.data_dir}")
            return cid
        try:
            cid = int(str(ref).strip())
        except ValueError:
            raise NotFound(f"{ref!r} is not a conversation id (see `chatapp sessions list`)") from None
        self.get(cid)
        return cid

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._query(
            "SELECT seq, role, content, status, created, updated FROM messages "
            "WHERE conversation_id = ? ORDER BY seq", (int(conversation_id),))
        return [StoredMessage(*r) for r in rows]

    def search(self, text: str, limit: int = 50) -> list:
        """Messages of every conversation holding every word of ``text`` (search.py's SearchHit rows);
        raises search.SearchError for an empty text."""
        from .search import search

        if self._conn is None:
            return []
        with self._mutex:
            return search(self._conn, text, limit)

    # ---- changing -----------------------------------------------------------------------------
    def create_conversation(self, *, title: str = "", model_id: str = "", model_spec: str = "",
                            weights_fingerprint: str = "", prompt_format: str = "") -> int:
        now = time.time()
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO conversations(title, model_id, model_spec, weights_fingerprint, prompt_format, "
                "created, updated) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (clean_text(title), model_id, model_spec, weights_fingerprint, prompt_format, now, now))
            return int(cur.lastrowid)

    def set_model(self, conversation_id: int, *, model_id: str, model_spec: str, weights_fingerprint: str,
                  prompt_format: str) -> None:
        with self._tx() as c:
            self._exists(c, conversation_id)
            c.execute("UPDATE conversations SET model_id = ?, model_spec = ?, weights_fingerprint = ?, "
                      "prompt_format = ? WHERE id = ?",
                      (model_id, model_spec, weights_fingerprint, prompt_format, int(conversation_id)))

    def rename(self, conversation_id: int, title: str) -> None:
        title = clean_text(title).strip()
        if not title:
            raise StoreError("the new name is empty")
        with self._tx() as c:
            self._exists(c, conversation_id)
            c.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, int(conversation_id)))

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation, its messages and its snapshot."""
        with self._tx() as c:
            self._exists(c, conversation_id)
            c.execute("DELETE FROM messages WHERE conversation_id = ?", (int(conversation_id),))
            c.execute("DELETE FROM conversations WHERE id = ?", (int(conversation_id),))
        try:
            snapshot_path(self.data_dir, conversation_id).unlink()
        except FileNotFoundError:
            pass

    def put_message(self, conversation_id: int, seq: int, role: str, content: str, status: str) -> None:
        """Insert or overwrite message ``seq`` (used for the in-progress reply)."""
        self.replace_messages(conversation_id, seq, [(role, content, status)], drop_after=False)

    def replace_messages(self, conversation_id: int, start: int,
                         messages: Iterable[tuple[str, str, str]], *, drop_after: bool = True) -> None:
        """Make messages ``start, start+1, ...`` be ``messages`` ((role, content, status) each),
        deleting every later one when ``drop_after``; all in one transaction."""
        rows = []
        for role, content, status in messages:
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}")
            if status not in STATUSES:
                raise ValueError(f"unknown status {status!r}")
            rows.append((role, clean_text(content), status))
        now = time.time()
        cid = int(conversation_id)
        with self._tx() as c:
            self._exists(c, cid)
            if drop_after:
                c.execute("DELETE FROM messages WHERE conversation_id = ? AND seq >= ?", (cid, start))
            for i, (role, content, status) in enumerate(rows):
                c.execute(
                    "INSERT INTO messages(conversation_id, seq, role, content, status, created, updated) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(conversation_id, seq) DO UPDATE SET "
                    "role = excluded.role, content = excluded.content, status = excluded.status, "
                    "updated = excluded.updated",
                    (cid, start + i, role, content, status, now, now))
            if not self._has_title(c, cid):
                first_user = c.execute(
                    "SELECT content FROM messages WHERE conversation_id = ? AND role = 'user' ORDER BY seq LIMIT 1",
                    (cid,)).fetchone()
                if first_user:
                    c.execute("UPDATE conversations SET title = ? WHERE id = ? AND title = ''",
                              (title_from(first_user[0]), cid))
            c.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, cid))

    def delete_messages(self, conversation_id: int, start: int) -> None:
        """Delete messages ``start`` onwards."""
        self.replace_messages(conversation_id, start, [], drop_after=True)

    @staticmethod
    def _has_title(c: sqlite3.Connection, cid: int) -> bool:
        row = c.execute("SELECT title FROM conversations WHERE id = ?", (cid,)).fetchone()
        return bool(row and row[0])

    @staticmethod
    def _exists(c: sqlite3.Connection, cid: int) -> None:
        if c.execute("SELECT 1 FROM conversations WHERE id = ?", (int(cid),)).fetchone() is None:
            raise NotFound(f"no conversation {cid}")

    # ---- checks -------------------------------------------------------------------------------
    def integrity_ok(self) -> bool:
        rows = self._query("PRAGMA integrity_check")
        return bool(rows) and rows[0][0] == "ok"


def model_spec_of(data_dir: str | Path, ref: int | str | None) -> tuple[int, str]:
    """(conversation id, the model to load to continue it) for ``ref`` (an id, or None /
    "latest"), read without writing anything. Raises NotFound."""
    with ChatStore.open(data_dir, write=False) as store:
        cid = store.resolve(ref)
        return cid, store.get(cid).model_spec


class _Transaction:
    """``with store._tx() as conn:`` one BEGIN IMMEDIATE ... COMMIT, rolled back on error."""

    def __init__(self, store: ChatStore):
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        self.store._need_write()
        self.store._mutex.acquire()
        try:
            self.store._conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.store._mutex.release()
            raise
        return self.store._conn

    def __exit__(self, exc_type, exc, tb) -> None:
        conn = self.store._conn
        try:
            if exc_type is None:
                try:
                    conn.execute("COMMIT")
                except BaseException:
                    _rollback(conn)
                    raise
            else:
                _rollback(conn)
        finally:
            self.store._mutex.release()


def _rollback(conn: sqlite3.Connection) -> None:
    try:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass


def _connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(str(path), timeout=5.0, isolation_level=None, check_same_thread=False)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(f"{path}: could not switch the database to WAL mode (got {mode})")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=ON")
    except sqlite3.Error as e:
        raise StoreError(f"cannot use {path}: {describe_sqlite_error(e)}") from None
    return conn


def _schema_version(conn: sqlite3.Connection) -> int | None:
    has_meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
    if not has_meta:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    try:
        return int(row[0]) if row else None
    except ValueError:
        return None


__all__ = [
    "ChatStore", "ConversationInfo", "NotFound", "ReadOnlyStore", "SCHEMA_VERSION", "StoreBusy",
    "StoreError", "StoredMessage", "describe_sqlite_error", "model_spec_of", "title_from",
]
