"""The prefix store and the memory gauges from the command line: `chatapp sessions prefixes`, a warm
start in a second process (`--verbose`, `--stats-json`)."""

from __future__ import annotations

import json

from chatapp.cli import main
from chatapp.engine.generate import run_turn
from chatapp.store.lock import DataDirLock
from chatapp.store.paths import prefix_dir
from tests.test_faults import Chatapp, chat_args, make_env, rows
from tests.test_prefix_store import IDENT, first_prompt, session
from tests.test_store_cli import data  # noqa: F401 - the fixture: empty config, a fresh data directory


def test_list_clear_and_json(data, capsys):
    from chatapp.store.chat import open_chat

    assert main(["sessions", "prefixes"]) == 0
    assert capsys.readouterr().out.strip() == f"no stored prefixes in {prefix_dir(data)}"
    assert not data.exists()  # listing creates nothing
    s = session()
    prompt = first_prompt(s, "Tell me about a cat.")
    with open_chat(s, IDENT, data, prefix_cap_mb=64) as chat:
        run_turn(chat.send("Tell me about a cat."))
        chat.after_turn()
    assert main(["sessions", "prefixes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "LAST", "USED", "TOKENS", "BLOCKS", "MiB", "FORMAT", "MODEL"]
    row = out[1].split()
    assert row[3:5] == [str(len(prompt)), "3"] and row[-2:] == ["plain", "tiny"]
    assert out[2].startswith("3 blocks, ") and out[2].endswith("of 2048 MiB (data.prefix_cap_mb)")
    assert main(["sessions", "prefixes", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["blocks"] == 3 and listed["bytes"] > 0 and listed["unreadable_blocks"] == 0
    [stored] = listed["prefixes"]
    assert stored["complete"] and stored["tokens"] == len(prompt) and stored["blocks"] == 3
    with DataDirLock.acquire(data):  # another chatapp is running: clearing waits for it
        assert main(["sessions", "prefixes", "--clear"]) == 1
        assert "is using the data directory" in capsys.readouterr().err
    assert main(["sessions", "prefixes", "--clear"]) == 0
    assert capsys.readouterr().out.startswith("removed 3 prefix blocks (")
    assert list(prefix_dir(data).iterdir()) == []


def test_a_second_process_starts_warm_and_records_the_gauges(stories_path, tmp_path):
    """The first run stores its prompt; a second process with the same system prompt reuses it."""
    system = "Lily and her dog Max went to the park to play with a red ball. " * 10
    env = make_env(tmp_path)
    stats = tmp_path / "stats.jsonl"
    first = Chatapp(chat_args(stories_path, "--system", system, "--max-tokens", "8", "--stats-json", str(stats),
                              "-p", "Tell me about a cat."), env)
    assert first.finish() == 0, first.stderr
    second = Chatapp(chat_args(stories_path, "--system", system, "--max-tokens", "8", "--stats-json", str(stats),
                               "--verbose", "-p", "Tell me about a dog."), env)
    assert second.finish() == 0, second.stderr
    one, two = rows(stats)
    assert one["prefix_tokens"] == 0 and two["prefix_tokens"] > 150
    assert two["reused_tokens"] == two["prefix_tokens"] and two["prefill_tokens"] < 20
    line = f"chatapp: reused {two['prefix_tokens']} prefix tokens from the prefix store ("
    assert any(ln.startswith(line) and ln.endswith(" ms)") for ln in second.stderr.splitlines()), second.stderr
    for row in (one, two):
        mem = row["memory"]
        assert 0 < mem["active"] <= mem["peak"] < mem["total"] and mem["cache"] >= 0
        assert mem["kv_held"] == row["cache"]["bytes_held"] and 0 < mem["peak_share"] < 1
        assert row["memory_trace"] and row["memory_trace"][-1]["tokens"] == mem["tokens"]
    assert "| MLX " in second.stderr  # the --verbose summary line
