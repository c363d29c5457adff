"""Full-text search over every saved transcript (SQLite FTS5).

The index ``messages_fts`` is an external-content FTS5 table over ``messages.content``: it
stores only the index, and three triggers keep it in step with every insert, update and delete
of a message, inside the same transaction as the change (so it can never lag the transcript).
Schema 2 added it; :func:`install_index` creates it and indexes what a schema-1 database holds.

User text never reaches FTS5's query syntax: :func:`fts_query` quotes every word, so ``"``,
``*``, ``AND(``, ``-`` or ``NEAR`` are searched for as text. The last word matches as a prefix
(search as you type). A store opened read-only on a schema-1 database (no index yet) searches
with ``LIKE`` instead, which gives the same answers, slower.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import asdict, dataclass

INDEX_SQL = [
    "CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5("
    "content, content='messages', content_rowid='rowid', tokenize='unicode61 remove_diacritics 2')",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_ai AFTER INSERT ON messages BEGIN "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.rowid, new.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_ad AFTER DELETE ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content); END",
    "CREATE TRIGGER IF NOT EXISTS messages_fts_au AFTER UPDATE OF content ON messages BEGIN "
    "INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.rowid, old.content); "
    "INSERT INTO messages_fts(rowid, content) VALUES (new.rowid, new.content); END",
]
LINE_CHARS = 100  # the matching line shown, at most
DEFAULT_LIMIT = 50
_WORD = re.compile(r"\S+")


class SearchError(ValueError):
    """The search text cannot be searched for (empty); ``str()`` is one line for the user."""


@dataclass
class SearchHit:
    conversation_id: int
    title: str
    updated: float  # the conversation's last change
    seq: int  # the message's index in the conversation
    role: str
    line: str  # the message's first line that matches, shortened around the match

    def to_json(self) -> dict:
        return asdict(self)


def has_index(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'messages_fts'").fetchone() is not None


def install_index(conn: sqlite3.Connection) -> None:
    """Create the index and its triggers (inside the caller's transaction); a database that had
    messages before the index (schema 1) gets them all indexed once."""
    existed = has_index(conn)
    for stmt in INDEX_SQL:
        conn.execute(stmt)
    if not existed:
        conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")


def words(text: str) -> list[str]:
    # A NUL would end the query string inside SQLite's C code (and stored text has none).
    return _WORD.findall((text or "").replace("\x00", " "))


def fts_query(text: str) -> str:
    """An FTS5 MATCH expression that finds messages holding every word of ``text`` (the last as a
    prefix), whatever characters they contain. Raises SearchError for an empty text."""
    found = words(text)
    if not found:
        raise SearchError("the search is empty: give a word to look for")
    quoted = ['"' + w.replace('"', '""') + '"' for w in found]
    quoted[-1] += "*"
    return " ".join(quoted)


def matching_line(content: str, terms: list[str], width: int = LINE_CHARS) -> str:
    """The first line of ``content`` that holds a term (else the first line), cut to ``width``
    characters around the first match."""
    lowered = [t.lower() for t in terms]
    lines = [ln.strip() for ln in content.splitlines() if ln.strip()] or [""]
    best, at = lines[0], -1
    for ln in lines:
        low = ln.lower()
        hits = [low.find(t) for t in lowered if t and low.find(t) >= 0]
        if hits:
            best, at = ln, min(hits)
            break
    if len(best) <= width:
        return best
    start = max(0, min(at - width // 3, len(best) - width)) if at > 0 else 0
    cut = best[start:start + width - 2]
    return ("…" if start else "") + cut + "…"


def search(conn: sqlite3.Connection, text: str, limit: int = DEFAULT_LIMIT) -> list[SearchHit]:
    """Messages of every saved conversation that hold every word of ``text``, best match first
    (FTS5's bm25), then the newest message. ``conn``: the store's connection (``ChatStore.search``
    calls this holding its lock). Raises SearchError for an empty text."""
    match = fts_query(text)
    terms = [w.strip('"*') or w for w in words(text)]
    head = ("SELECT m.conversation_id, c.title, c.updated, m.seq, m.role, m.content "
            "FROM messages m JOIN conversations c ON c.id = m.conversation_id ")
    if has_index(conn):
        # The index first, on its own: joined in one query, SQLite may look the FTS table up
        # by rowid for each message and drop the MATCH (every message then "matches").
        ranked = conn.execute(
            "SELECT rowid FROM messages_fts WHERE messages_fts MATCH ? ORDER BY bm25(messages_fts), rowid DESC "
            "LIMIT ?", (match, int(limit))).fetchall()
        order = {rid: i for i, (rid,) in enumerate(ranked)}
        rows = []
        ids = list(order)
        for i in range(0, len(ids), 500):  # SQLite's limit on bound parameters
            part = ids[i:i + 500]
            rows += conn.execute(head.replace("SELECT ", "SELECT m.rowid, ", 1)
                                 + f"WHERE m.rowid IN ({','.join('?' * len(part))})", part).fetchall()
        rows = [r[1:] for r in sorted(rows, key=lambda r: order[r[0]])]
    else:  # a schema-1 database opened read-only: no index yet
        like = " AND ".join("m.content LIKE ? ESCAPE '\\'" for _ in terms)
        args = ["%" + re.sub(r"([%_\\])", r"\\\1", t) + "%" for t in terms]
        rows = conn.execute(head + f"WHERE {like} ORDER BY c.updated DESC, m.seq LIMIT ?",
                            (*args, int(limit))).fetchall()
    return [SearchHit(cid, title, updated, seq, role, matching_line(content, terms))
            for cid, title, updated, seq, role, content in rows]


__all__ = ["SearchError", "SearchHit", "fts_query", "install_index", "matching_line", "search"]
