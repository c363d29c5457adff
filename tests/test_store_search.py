"""Full-text search (store/search.py): the FTS5 index kept in step with the transcripts, the
upgrade of a schema-1 database, safe queries, and `chatapp sessions search`."""

from __future__ import annotations

import json
import sqlite3

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.cli import main
from chatapp.store import ChatStore
from chatapp.store.db import SCHEMA_VERSION
from chatapp.store.paths import db_path
from chatapp.store.search import SearchError, fts_query, matching_line

# The schema chatapp wrote before the index existed (version 1), frozen here as it was.
SCHEMA_V1 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL DEFAULT '', model_id TEXT NOT NULL DEFAULT '',
    model_spec TEXT NOT NULL DEFAULT '', weights_fingerprint TEXT NOT NULL DEFAULT '',
    prompt_format TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE, seq INTEGER NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')), content TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('complete', 'in_progress', 'interrupted')),
    created REAL NOT NULL, updated REAL NOT NULL, PRIMARY KEY (conversation_id, seq));
CREATE INDEX conversations_by_update ON conversations(updated);
INSERT INTO meta VALUES ('schema_version', '1');
INSERT INTO conversations(title, model_id, created, updated) VALUES ('Cats', 'stories', 1.0, 2.0);
INSERT INTO messages VALUES (1, 0, 'user', 'Tell me about a cat.', 'complete', 1.0, 1.0);
INSERT INTO messages VALUES (1, 1, 'assistant', 'Once there was a cat\nwho liked fish.', 'complete', 1.0, 2.0);
"""


def make_v1(data_dir):
    data_dir.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(db_path(data_dir))
    conn.executescript(SCHEMA_V1)
    conn.commit()
    conn.close()


def hits(store, text):
    return [(h.conversation_id, h.seq) for h in store.search(text)]


def test_schema_1_database_is_searchable_read_only_and_upgraded_on_open(tmp_path):
    make_v1(tmp_path)
    # Read-only (no index yet): the LIKE fallback finds the same messages.
    with ChatStore.open(tmp_path, write=False) as store:
        assert hits(store, "fish") == [(1, 1)]
        assert sorted(hits(store, "CAT")) == [(1, 0), (1, 1)]
    with ChatStore.open(tmp_path) as store:  # opening for writing upgrades it
        version = store._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
        assert version == str(SCHEMA_VERSION) == "2"
        assert hits(store, "fish") == [(1, 1)]
        [hit] = store.search("liked fi")  # every word; the last one as a prefix
        assert hit.title == "Cats" and hit.role == "assistant" and hit.line == "who liked fish."
        assert store.integrity_ok()


def test_index_follows_inserts_updates_and_deletes(tmp_path):
    with ChatStore.open(tmp_path) as store:
        a = store.create_conversation()
        store.replace_messages(a, 0, [("user", "apples and pears", "complete")])
        b = store.create_conversation()
        store.replace_messages(b, 0, [("user", "plums", "complete"), ("assistant", "more apples", "in_progress")])
        assert sorted(hits(store, "apples")) == [(a, 0), (b, 1)]
        store.put_message(b, 1, "assistant", "bananas now", "complete")  # the streaming reply overwritten
        assert hits(store, "apples") == [(a, 0)] and hits(store, "bananas") == [(b, 1)]
        store.delete_messages(b, 1)
        assert hits(store, "bananas") == []
        store.delete(a)
        assert hits(store, "apples") == [] and hits(store, "plums") == [(b, 0)]
        store._conn.execute("INSERT INTO messages_fts(messages_fts) VALUES ('integrity-check')")


def test_every_hit_holds_the_words(tmp_path):
    """A regression: joined in one query with the FTS table, SQLite returned messages that did
    not match (a long conversation written turn by turn, as the app writes it)."""
    words_ = ["honey", "rivers", "prime", "sea", "France", "bees"]
    with ChatStore.open(tmp_path) as store:
        cid = store.create_conversation()
        store.replace_messages(cid, 0, [("system", "You are helpful.", "complete")])
        for i in range(40):
            w = words_[i % len(words_)]
            store.replace_messages(cid, 1 + 2 * i, [("user", f"question {i} about {w}", "complete")])
            for part in (f"a {w}", f"a {w} answer {i}"):  # the streaming reply, then the final one
                store.put_message(cid, 2 + 2 * i, "assistant", part, "in_progress")
            store.replace_messages(cid, 2 + 2 * i, [("assistant", f"a {w} answer {i}", "complete")])
        found = store.search("honey")
        assert len(found) == 14 and all("honey" in h.line for h in found)
        assert len({(h.conversation_id, h.seq) for h in found}) == 14
        assert len(store.search("honey", limit=3)) == 3


@pytest.mark.parametrize("text", ['"', '*', 'AND(', '-', 'NEAR(a b)', 'a OR', '"unclosed', "col:x", "^", "(", "''"])
def test_fts_syntax_is_searched_as_text(tmp_path, text):
    with ChatStore.open(tmp_path) as store:
        cid = store.create_conversation()
        store.replace_messages(cid, 0, [("user", f"odd {text} here", "complete")])
        store.search(text)  # never an FTS syntax error


def test_empty_search_is_refused():
    for text in ("", "   ", "\n\t"):
        with pytest.raises(SearchError):
            fts_query(text)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=30))
def test_any_text_makes_a_valid_query(text):
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
    conn.execute("INSERT INTO t VALUES ('some words')")
    try:
        q = fts_query(text)
    except SearchError:
        assert not text.replace("\x00", " ").split()
        return
    conn.execute("SELECT * FROM t WHERE t MATCH ?", (q,)).fetchall()


def test_matching_line_cuts_around_the_match():
    long = "x" * 300 + " needle " + "y" * 300
    line = matching_line("first\n" + long, ["needle"])
    assert "needle" in line and len(line) <= 100 and line.startswith("…")
    assert matching_line("a\nb", ["zzz"]) == "a"


# ---- the CLI ----------------------------------------------------------------------------------------
@pytest.fixture()
def data(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(cfg))
    d = tmp_path / "data"
    monkeypatch.setenv("CHATAPP_DATA_DIR", str(d))
    return d


def test_cli_search_lines_json_and_bad_input(data, capsys):
    make_v1(data)
    assert main(["sessions", "search", "fish"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert line.split()[0] == "1" and "Cats" in line and "assistant: who liked fish." in line
    assert main(["sessions", "search", "nothing-like-it"]) == 0
    assert "no saved message holds" in capsys.readouterr().out
    assert main(["sessions", "search", "--json", "cat"]) == 0
    assert {h["seq"] for h in json.loads(capsys.readouterr().out)} == {0, 1}
    for bad in (['"', 'AND('], ["*"], ["--", "-"]):
        assert main(["sessions", "search", *bad]) == 0, bad
        assert "Traceback" not in capsys.readouterr().err
    assert main(["sessions", "search", " "]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "the search is empty" in err
    assert main(["sessions", "search", "x", "--limit", "0"]) == 2
