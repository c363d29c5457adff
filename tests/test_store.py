"""The transcript store (SQLite), the data-directory lock, paths, export and input text."""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from chatapp.config import load_config
from chatapp.store import ChatStore, NotFound, ReadOnlyStore, StoreBusy, StoreError, export, resolve_data_dir
from chatapp.store.db import SCHEMA_VERSION, title_from
from chatapp.store.export import from_json, to_markdown
from chatapp.store.lock import holder_pid
from chatapp.store.paths import (
    DB_NAME,
    prune_snapshots,
    remove_stale_tmp,
    snapshot_dir,
    snapshot_files,
    snapshot_path,
    snapshot_tmp_path,
)
from chatapp.store.textio import clean_text, decode_line, read_lines

REPO = Path(__file__).resolve().parent.parent
NASTY = "esc \x1b[31mred\x1b[0m bell \x07 nul \x00 cr \r c1 \x85 bad \ufffd emoji 🐈 rtl \u202e"


@pytest.fixture()
def empty_env(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(cfg))
    monkeypatch.delenv("CHATAPP_DATA_DIR", raising=False)
    return tmp_path


# ---- where data lives ---------------------------------------------------------------------------
def test_data_dir_precedence(empty_env, monkeypatch):
    import platformdirs

    assert resolve_data_dir(load_config()) == Path(platformdirs.user_data_dir("chatapp"))
    conf = empty_env / "c.toml"
    conf.write_text('[data]\ndir = "/from/file"\n')
    assert resolve_data_dir(load_config(conf)) == Path("/from/file")
    monkeypatch.setenv("CHATAPP_DATA_DIR", "/from/env")
    assert resolve_data_dir(load_config(conf)) == Path("/from/env")  # env beats a config file
    assert resolve_data_dir(load_config(conf, {"data.dir": "/from/flag"})) == Path("/from/flag")
    assert resolve_data_dir(None) == Path("/from/env")


# ---- the store ------------------------------------------------------------------------------------
def test_messages_round_trip_exactly_and_wal_mode(tmp_path):
    with ChatStore.open(tmp_path / "d") as st:
        cid = st.create_conversation(model_id="m", model_spec="/abs/m", weights_fingerprint="f", prompt_format="plain")
        st.replace_messages(cid, 0, [("system", "be kind", "complete"), ("user", NASTY, "complete"),
                                     ("assistant", "ok", "interrupted")])
        got = st.messages(cid)
        assert [(m.seq, m.role, m.content, m.status) for m in got] == [
            (0, "system", "be kind", "complete"), (1, "user", NASTY, "complete"), (2, "assistant", "ok", "interrupted")]
        assert got[2].interrupted and not got[1].interrupted
        info = st.get(cid)
        assert info.title == title_from(NASTY) and info.messages == 3 and info.model_spec == "/abs/m"
        assert st.integrity_ok()
    conn = sqlite3.connect(tmp_path / "d" / DB_NAME)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    conn.close()


def test_replace_rewrites_from_the_first_difference_atomically(tmp_path):
    with ChatStore.open(tmp_path) as st:
        cid = st.create_conversation()
        st.replace_messages(cid, 0, [("user", "a", "complete"), ("assistant", "b", "complete"),
                                     ("user", "c", "complete"), ("assistant", "d", "complete")])
        st.replace_messages(cid, 2, [("user", "C", "complete")])  # edit: drops everything after
        assert [m.content for m in st.messages(cid)] == ["a", "b", "C"]
        with pytest.raises(ValueError):
            st.replace_messages(cid, 1, [("assistant", "x", "complete"), ("robot", "y", "complete")])
        assert [m.content for m in st.messages(cid)] == ["a", "b", "C"]  # nothing of the failed call
        st.put_message(cid, 3, "assistant", "partial", "in_progress")
        st.put_message(cid, 3, "assistant", "partial and more", "in_progress")
        assert st.messages(cid)[3].content == "partial and more"
        st.delete_messages(cid, 3)
        assert len(st.messages(cid)) == 3


def test_list_latest_rename_delete(tmp_path):
    with ChatStore.open(tmp_path) as st:
        a = st.create_conversation()
        st.replace_messages(a, 0, [("user", "first conversation\nsecond line", "complete")])
        time.sleep(0.01)
        b = st.create_conversation()
        st.replace_messages(b, 0, [("user", "x" * 200, "complete")])
        assert [c.id for c in st.list_conversations()] == [b, a]
        assert st.resolve(None) == st.resolve("latest") == b and st.resolve(str(a)) == a
        assert st.get(a).title == "first conversation" and len(st.get(b).title) == 60
        st.rename(a, "  Cats  ")
        assert st.get(a).title == "Cats"
        with pytest.raises(StoreError):
            st.rename(a, "   ")
        snap = snapshot_path(st.data_dir, a)
        snap.parent.mkdir()
        snap.write_bytes(b"x" * 10)
        assert st.get(a).snapshot_bytes == 10
        st.delete(a)
        assert not snap.exists() and [c.id for c in st.list_conversations()] == [b]
        for bad in (a, "nope", 999):
            with pytest.raises(NotFound):
                st.resolve(bad)
        c = st.create_conversation()
        assert c > b  # ids are never reused
    with ChatStore.open(tmp_path / "empty") as st:
        with pytest.raises(NotFound, match="no saved conversation"):
            st.resolve("latest")


def test_read_only_open_creates_nothing_and_cannot_write(tmp_path):
    missing = tmp_path / "missing"
    with ChatStore.open(missing, write=False) as st:
        assert st.list_conversations() == [] and st.latest_id() is None
        with pytest.raises(ReadOnlyStore):
            st.create_conversation()
    assert not missing.exists()
    with ChatStore.open(tmp_path / "d") as w:
        cid = w.create_conversation()
        w.replace_messages(cid, 0, [("user", "hi", "complete")])
        with ChatStore.open(tmp_path / "d", write=False) as r:  # a reader next to the writer
            assert [m.content for m in r.messages(cid)] == ["hi"]
            with pytest.raises(ReadOnlyStore):
                r.rename(cid, "x")


def test_in_progress_rows_become_interrupted_at_next_open(tmp_path):
    with ChatStore.open(tmp_path) as st:
        cid = st.create_conversation()
        st.replace_messages(cid, 0, [("user", "q", "complete")])
        st.put_message(cid, 1, "assistant", "half a repl", "in_progress")
        other = st.create_conversation()
        st.put_message(other, 0, "assistant", "", "in_progress")
    with ChatStore.open(tmp_path, write=False) as r:
        assert r.messages(cid)[1].status == "in_progress"  # readers see it as it is
    with ChatStore.open(tmp_path) as st:
        assert st.recovered == 1
        assert [(m.content, m.status) for m in st.messages(cid)] == [("q", "complete"), ("half a repl", "interrupted")]
        assert st.messages(other) == []  # an empty in-progress row is dropped


def test_newer_schema_and_non_database_are_refused(tmp_path):
    with ChatStore.open(tmp_path / "a") as st:
        st._conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="newer chatapp"):
        ChatStore.open(tmp_path / "a")
    with pytest.raises(StoreError, match="newer chatapp"):
        ChatStore.open(tmp_path / "a", write=False)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / DB_NAME).write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot use"):
        ChatStore.open(tmp_path / "b")
    assert (tmp_path / "b" / DB_NAME).read_bytes().startswith(b"this is not")  # left alone
    # the lock was released on failure
    ChatStore.open(tmp_path / "b" / "sub").close()


# ---- one writer ------------------------------------------------------------------------------------
def test_second_writer_is_refused_and_lock_dies_with_its_process(tmp_path):
    first = ChatStore.open(tmp_path)
    assert holder_pid(tmp_path) == os.getpid()
    with pytest.raises(StoreBusy, match=f"pid {os.getpid()}"):
        ChatStore.open(tmp_path)
    first.close()
    ChatStore.open(tmp_path).close()  # free again
    # another process takes the lock and is killed: the lock goes with it
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from chatapp.store.db import ChatStore
        s = ChatStore.open({str(tmp_path)!r})
        print("locked", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(StoreBusy) as e:
            ChatStore.open(tmp_path)
        assert e.value.pid == p.pid
    finally:
        p.kill()
        p.wait()
    ChatStore.open(tmp_path).close()


# ---- snapshot files ----------------------------------------------------------------------------------
def test_prune_oldest_first_and_stale_tmp(tmp_path):
    d = snapshot_dir(tmp_path)
    d.mkdir(parents=True)
    paths = []
    for i in range(4):
        p = snapshot_path(tmp_path, i + 1)
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
        paths.append(p)
    newest = paths[0]  # the one just written is kept even though it is the oldest by mtime
    removed = prune_snapshots(tmp_path, 2500, keep=newest)
    assert removed == [paths[1], paths[2]] and snapshot_files(tmp_path) == [newest, paths[3]]
    assert prune_snapshots(tmp_path, 500, keep=newest) == [paths[3], newest]
    tmp = snapshot_tmp_path(snapshot_path(tmp_path, 7))
    tmp.write_bytes(b"half")
    assert tmp.name.endswith(".safetensors") and snapshot_files(tmp_path) == []
    assert remove_stale_tmp(tmp_path) == 1 and not tmp.exists()


# ---- export -------------------------------------------------------------------------------------------
def test_export_markdown_and_json_round_trip(tmp_path):
    with ChatStore.open(tmp_path) as st:
        cid = st.create_conversation(model_id="stories260K")
        st.replace_messages(cid, 0, [("user", NASTY, "complete"), ("assistant", "part", "interrupted")])
        md = export(st, cid, "markdown")
        assert md.startswith("# esc") and "## User" in md and NASTY in md and "*(interrupted)*" in md
        assert "- model: stories260K" in md
        head, msgs = from_json(export(st, cid, "json"))
        assert head["id"] == cid and [(m.role, m.content, m.status) for m in msgs] == [
            ("user", NASTY, "complete"), ("assistant", "part", "interrupted")]
        assert to_markdown(st.get(cid), st.messages(cid)) == md
        with pytest.raises(ValueError):
            export(st, cid, "html")


# ---- input text ------------------------------------------------------------------------------------
def test_input_decoding_keeps_controls_and_replaces_invalid_utf8():
    raw = "héllo \x1b[2J".encode() + b" \xff\xfe end\r\n"
    assert decode_line(raw) == "héllo \x1b[2J \ufffd\ufffd end"
    assert list(read_lines(io.BytesIO(b"a\n\nb\xc3\n\xe2\x82"))) == ["a", "", "b\ufffd", "\ufffd"]
    # argv arrives with surrogateescape: the same bytes give the same text
    assert clean_text(b"x \xff\xfe y".decode("utf-8", "surrogateescape")) == "x \ufffd\ufffd y"
    assert clean_text("lone \ud800 high") == "lone \ufffd high"
    assert clean_text(NASTY) is NASTY or clean_text(NASTY) == NASTY
