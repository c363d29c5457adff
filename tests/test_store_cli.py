"""`chatapp sessions list|export|rename|delete` and the --resume checks made before any model loads."""

from __future__ import annotations

import json

import pytest

from chatapp.cli import main
from chatapp.store import ChatStore
from chatapp.store.export import from_json
from chatapp.store.paths import snapshot_path

NASTY = "red \x1b[31mtext\x1b[0m and a bell \x07"


@pytest.fixture()
def data(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(cfg))
    d = tmp_path / "data"
    monkeypatch.setenv("CHATAPP_DATA_DIR", str(d))
    return d


def fill(d) -> tuple[int, int]:
    with ChatStore.open(d) as st:
        a = st.create_conversation(model_id="stories260K", model_spec="/models/stories260K")
        st.replace_messages(a, 0, [("user", "Tell me about a cat.", "complete"), ("assistant", "Once.", "complete")])
        b = st.create_conversation(model_id="stories260K")
        st.replace_messages(b, 0, [("user", NASTY, "complete"), ("assistant", "Half", "interrupted")])
    snapshot_path(d, a).parent.mkdir(exist_ok=True)
    snapshot_path(d, a).write_bytes(b"x" * 2048)
    return a, b


def test_list_empty_creates_nothing(data, capsys):
    assert main(["sessions", "list"]) == 0
    assert capsys.readouterr().out.strip() == f"no saved conversations in {data}"
    assert main(["sessions", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert not data.exists()


def test_list_table_and_json(data, capsys):
    a, b = fill(data)
    assert main(["sessions", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "UPDATED", "MSGS", "SNAPSHOT", "MODEL", "TITLE"]
    assert out[1].split()[0] == str(b) and out[2].split()[0] == str(a)  # latest first
    assert "\x1b" not in "\n".join(out) and "␛[31mtext" in out[1]  # titles shown safely
    assert "Tell me about a cat." in out[2] and "MiB" in out[2]
    assert main(["sessions", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["id"] for c in listed] == [b, a] and listed[0]["title"] == NASTY
    assert listed[1]["snapshot_bytes"] == 2048 and listed[1]["model_spec"] == "/models/stories260K"


def test_export_markdown_json_and_file(data, tmp_path, capsys):
    a, b = fill(data)
    assert main(["sessions", "export", str(b)]) == 0
    md = capsys.readouterr().out
    assert md.startswith("# red") and NASTY in md and "*(interrupted)*" in md  # a pipe gets it as stored
    assert main(["sessions", "export", "latest", "--format", "json"]) == 0
    head, msgs = from_json(capsys.readouterr().out)
    assert head["id"] == b and [m.content for m in msgs] == [NASTY, "Half"]
    out = tmp_path / "a.md"
    assert main(["sessions", "export", str(a), "-o", str(out)]) == 0
    assert "## Assistant\n\nOnce." in out.read_text()


def test_rename_and_delete(data, capsys):
    a, b = fill(data)
    assert main(["sessions", "rename", str(a), "Cats", "and", "dogs"]) == 0
    assert capsys.readouterr().out.strip() == f"renamed conversation {a}"
    assert main(["sessions", "delete", str(a)]) == 0
    with ChatStore.open(data, write=False) as st:
        assert [c.id for c in st.list_conversations()] == [b]
    assert not snapshot_path(data, a).exists()


def test_errors_are_one_line(data, capsys, tmp_path):
    assert main(["sessions", "export", "7"]) == 2
    assert capsys.readouterr().err.strip() == f"chatapp: error: no conversation 7 in {data}"
    assert not data.exists()  # checked read-only: nothing created
    fill(data)
    for argv in (["sessions", "delete", "99"], ["sessions", "rename", "x", "name"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("chatapp: error: ")
    bad = tmp_path / "bad.toml"
    bad.write_text("[data]\ndir = 3\n")
    assert main(["sessions", "list", "--config", str(bad)]) == 2
    assert "data.dir: must be a string" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sessions", "export", "1", "--format", "html"])


def test_resume_checks_before_loading_anything(data, capsys):
    assert main(["--no-tui", "--resume", "-p", "hi"]) == 2
    assert "there is no saved conversation" in capsys.readouterr().err and not data.exists()
    fill(data)
    assert main(["--no-tui", "--resume", "12", "-p", "hi"]) == 2
    assert "no conversation 12" in capsys.readouterr().err
    assert main(["--resume", "12"]) == 2  # the TUI path checks the same way before starting
    assert "no conversation 12" in capsys.readouterr().err
