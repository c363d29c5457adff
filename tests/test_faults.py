"""Bad input and faults, end to end: the real `chatapp --no-tui` in a subprocess.

Every run gets a temporary data directory (CHATAPP_DATA_DIR) and an empty config directory
(CHATAPP_CONFIG_DIR), so nothing of the user's leaks in or out. Independent runs are started
together to keep the wall time down.
"""

from __future__ import annotations

import http.server
import json
import os
import pty
import resource
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from chatapp.store.chat import PARTIAL_SECONDS
from chatapp.store.paths import DB_NAME, snapshot_path
from chatapp.textsafe import printable

REPO = Path(__file__).resolve().parent.parent
STORY = "Tell me a long story about a cat and a dog."


# ---- helpers ---------------------------------------------------------------------------------------
def make_env(tmp_path: Path, data: Path | None = None, **extra) -> dict:
    cfg = tmp_path / "config-dir"
    cfg.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(CHATAPP_CONFIG_DIR=str(cfg), CHATAPP_DATA_DIR=str(data or tmp_path / "data"), HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf-home"))
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


class Chatapp:
    """A running `python -m chatapp ...` whose stdout and stderr are collected as they come."""

    def __init__(self, args: list[str], env: dict, stdout=subprocess.PIPE, preexec_fn=None):
        self.p = subprocess.Popen([sys.executable, "-m", "chatapp", *args], cwd=REPO, env=env,
                                  stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.PIPE,
                                  preexec_fn=preexec_fn)
        self.out, self.err = bytearray(), bytearray()
        self._threads = [threading.Thread(target=self._pump, args=(s, b), daemon=True)
                         for s, b in ((self.p.stdout, self.out), (self.p.stderr, self.err)) if s is not None]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, buf: bytearray) -> None:
        while True:
            chunk = stream.read1(4096)
            if not chunk:
                return
            buf.extend(chunk)

    @property
    def pid(self) -> int:
        return self.p.pid

    def send(self, data: bytes) -> None:
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def close_stdin(self) -> None:
        self.p.stdin.close()

    def wait_for(self, predicate, timeout: float = 60, what: str = "") -> None:
        end = time.monotonic() + timeout
        while not predicate():
            if self.p.poll() is not None and not predicate():
                raise AssertionError(f"chatapp exited ({self.p.returncode}) before {what}: {self.stderr}")
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}: {self.stderr}")
            time.sleep(0.05)

    def finish(self, timeout: float = 60) -> int:
        if self.p.stdin and not self.p.stdin.closed:
            self.p.stdin.close()
        rc = self.p.wait(timeout)
        for t in self._threads:
            t.join(5)
        return rc

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", "replace")


def run_all(runs: list[Chatapp], timeout: float = 90) -> list[int]:
    return [r.finish(timeout) for r in runs]


def chat_args(model: Path, *more: str) -> list[str]:
    return ["--no-tui", "-m", str(model), "--temp", "0", "--seed", "0", *more]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def messages(data: Path, cid: int | None = None) -> list[tuple[str, str, str]]:
    conn = sqlite3.connect(f"file:{data / DB_NAME}?mode=ro", uri=True)
    try:
        if cid is None:
            cid = conn.execute("SELECT id FROM conversations ORDER BY updated DESC LIMIT 1").fetchone()[0]
        return conn.execute("SELECT role, content, status FROM messages WHERE conversation_id = ? ORDER BY seq",
                            (cid,)).fetchall()
    finally:
        conn.close()


def integrity(data: Path) -> str:
    conn = sqlite3.connect(data / DB_NAME)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(scope="module")
def base(stories_path, tmp_path_factory):
    """A data directory holding one finished turn (and its snapshot) of stories260K."""
    root = tmp_path_factory.mktemp("base")
    data = root / "data"
    r = Chatapp(chat_args(stories_path, "--max-tokens", "20", "-p", "Tell me about a cat."), make_env(root, data))
    assert r.finish() == 0, r.stderr
    assert snapshot_path(data, 1).exists() and len(messages(data)) == 2
    return data


def copy_base(base: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(base, data)
    return data


# ---- a model that cannot be used -------------------------------------------------------------------
class _NotFoundHub(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        body = b'{"error": "Repository not found"}'
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


def test_unusable_model_one_line_nonzero_nothing_written(stories_path, tmp_path):
    hub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFoundHub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    folders = {}
    for name in ("incomplete", "arch"):
        folders[name] = tmp_path / name
        shutil.copytree(stories_path, folders[name])
    for f in ("model.safetensors", "tokenizer.json", "tokenizer.model"):
        (folders["incomplete"] / f).unlink()
    cfg = json.loads((folders["arch"] / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (folders["arch"] / "config.json").write_text(json.dumps(cfg))
    cases = {
        "unknown repo": ("nobody-xyz/no-such-model",
                         dict(HF_HUB_OFFLINE=None, HF_ENDPOINT=f"http://127.0.0.1:{hub.server_port}"),
                         "unknown model 'nobody-xyz/no-such-model'"),
        "no network": ("nobody-xyz/no-such-model", dict(HF_HUB_OFFLINE=None, HF_ENDPOINT="http://127.0.0.1:9"),
                       "cannot reach Hugging Face and nobody-xyz/no-such-model is not in the local cache"),
        "missing weights and tokenizer": (str(folders["incomplete"]), {},
                                          "is missing weights (model*.safetensors or weights.npz), a tokenizer"),
        "unsupported architecture": (str(folders["arch"]), {}, "unsupported architecture 'frobnicator'"),
    }
    runs = {}
    for i, (name, (model, extra, _)) in enumerate(cases.items()):
        d = tmp_path / f"case{i}"
        d.mkdir()
        runs[name] = (d, Chatapp(["--no-tui", "-m", model, "-p", "hi"], make_env(d, **extra)))
    try:
        for name, (d, r) in runs.items():
            assert r.finish() == 2, (name, r.stderr)
            line = one_error_line(r.stderr)
            assert line.startswith("chatapp: error: ") and cases[name][2] in line, (name, line)
            assert not (d / "data").exists(), name  # nothing written
            assert r.stdout == ""
    finally:
        hub.shutdown()


def test_bad_config_names_file_key_reason_and_starts_nothing(stories_path, tmp_path):
    cases = {
        "malformed": ("[cache\nwindow = 3\n", "invalid TOML"),
        "unknown key": ("[cache]\nwindw = 64\n", "cache.windw: unknown setting (did you mean cache.window?)"),
        "out of range": ("[sampling]\ntop_p = 1.5\n", "sampling.top_p: must be a number > 0 and <= 1 (got 1.5)"),
    }
    runs = {}
    for name, (text, _) in cases.items():
        d = tmp_path / name.replace(" ", "-")
        d.mkdir()
        conf = d / "bad.toml"
        conf.write_text(text)
        runs[name] = (d, conf, Chatapp(chat_args(stories_path, "--config", str(conf), "-p", "hi"), make_env(d)))
    # the user's own config file is checked the same way
    d = tmp_path / "user-file"
    d.mkdir()
    env = make_env(d)
    (Path(env["CHATAPP_CONFIG_DIR"]) / "config.toml").write_text("[cache]\nsinks = -1\n")
    user = Chatapp(chat_args(stories_path, "-p", "hi"), env)
    for name, (d, conf, r) in runs.items():
        assert r.finish() == 2, r.stderr
        line = one_error_line(r.stderr)
        assert line == f"chatapp: config error: {conf}: {cases[name][1]}" or (
            line.startswith(f"chatapp: config error: {conf}: ") and cases[name][1] in line), line
        assert not (d / "data").exists() and r.stdout == ""
    assert user.finish() == 2
    line = one_error_line(user.stderr)
    assert "config.toml: cache.sinks: must be an integer >= 0 (got -1)" in line


# ---- what the user types ------------------------------------------------------------------------------
def test_empty_and_whitespace_messages_are_ignored(stories_path, tmp_path):
    stats = tmp_path / "stats.jsonl"
    r = Chatapp(chat_args(stories_path, "--max-tokens", "8", "--stats-json", str(stats)), make_env(tmp_path))
    d2 = tmp_path / "p"
    d2.mkdir()
    empty = Chatapp(chat_args(stories_path, "-p", "  \t "), make_env(d2))
    r.send(b"\n   \n\t\nTell me a story.\n \n\r\n")
    assert run_all([r, empty]) == [0, 2], r.stderr
    assert len(rows(stats)) == 1 and rows(stats)[0]["prompt_tokens"] > 0
    assert [(role, c) for role, c, _ in messages(tmp_path / "data")][0] == ("user", "Tell me a story.")
    assert len(messages(tmp_path / "data")) == 2
    assert one_error_line(empty.stderr) == "chatapp: error: the prompt is empty"
    assert not (d2 / "data").exists()


def test_message_longer_than_the_context(stories_path, tmp_path):
    long_text = "The cat sat on the mat and looked at the dog. " * 60  # ~700 tokens; the context is 512
    stats = tmp_path / "auto" / "stats.jsonl"
    (tmp_path / "auto").mkdir()
    (tmp_path / "keep-all").mkdir()
    auto = Chatapp(chat_args(stories_path, "--max-tokens", "8", "--stats-json", str(stats), "-p", long_text),
                   make_env(tmp_path / "auto"))
    keep_all = Chatapp(chat_args(stories_path, "--cache-mode", "prealloc", "-p", long_text),
                       make_env(tmp_path / "keep-all"))
    assert run_all([auto, keep_all]) == [0, 2]
    # auto: the window policy applies, the user is told, the message is stored whole
    assert "longer than the model's context (512)" in auto.stderr and "window" in auto.stderr
    row = rows(stats)[0]
    assert row["mode"] == "window" and row["cache"]["evicted"] > 0 and row["generated_tokens"] > 0
    assert messages(tmp_path / "auto" / "data")[0] == ("user", long_text, "complete")
    # a mode that keeps every token: a clear refusal, nothing sent, nothing stored
    line = one_error_line(keep_all.stderr)
    assert "message not sent" in line and "more than the model's context of 512" in line
    assert keep_all.stdout == ""
    conn = sqlite3.connect(tmp_path / "keep-all" / "data" / DB_NAME)
    assert conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    conn.close()


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A random-weight Llama with a byte-level tokenizer, saved as a model folder: its replies
    are arbitrary bytes (control characters, escape sequences, invalid UTF-8)."""
    from chatapp.model.loader import save_model_dir
    from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

    root = tmp_path_factory.mktemp("byte-model")
    byte_tokenizer()._tokenizer.save_pretrained(root / "tok")
    shape = LlamaShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=256, vocab_size=258)
    model, config = build_random_llama(shape, seed=1)
    return save_model_dir(root / "model", model, config, root / "tok")


def test_control_characters_and_invalid_utf8_shown_safely_stored_intact(byte_model, tmp_path):
    message = b"esc \x1b[31mred\x1b[0m title \x1b]0;pwned\x07 bell \x07 nul \x00 bad \xff\xfe\xc3 end\n"
    expected_user = message[:-1].decode("utf-8", "replace")
    master, slave = pty.openpty()
    tty_run = Chatapp(["--no-tui", "-m", str(byte_model), "--temp", "1.0", "--seed", "5", "--max-tokens", "80"],
                      make_env(tmp_path), stdout=slave)
    os.close(slave)
    (tmp_path / "pipe").mkdir()
    pipe_run = Chatapp(["--no-tui", "-m", str(byte_model), "--temp", "1.0", "--seed", "5", "--max-tokens", "80"],
                       make_env(tmp_path / "pipe"))
    for r in (tty_run, pipe_run):
        r.send(message)
        r.close_stdin()
    shown = bytearray()
    end = time.monotonic() + 90
    while time.monotonic() < end:
        if not select.select([master], [], [], 0.5)[0]:
            if tty_run.p.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        shown.extend(chunk)
    os.close(master)
    assert run_all([tty_run, pipe_run]) == [0, 0], tty_run.stderr + pipe_run.stderr
    stored = messages(tmp_path / "data")
    assert stored[0] == ("user", expected_user, "complete")
    reply = stored[1][1]
    assert any(ord(c) < 32 and c not in "\n\t" for c in reply)  # the model did emit control characters
    # on a terminal: no raw control bytes at all (the pty turns "\n" into "\r\n")
    text = bytes(shown).replace(b"\r\n", b"\n")
    assert not [b for b in text if (b < 32 and b not in b"\n\t") or b == 0x7F]
    assert printable(reply) in text.decode("utf-8")
    # to a pipe: the reply goes out as it is, and it is stored exactly so
    assert messages(tmp_path / "pipe" / "data")[1][1] == reply and reply in pipe_run.stdout


# ---- stopping a reply ---------------------------------------------------------------------------------
def test_sigint_then_sigterm_during_replies(stories_path, tmp_path):
    stats = tmp_path / "stats.jsonl"
    # --ignore-eos: where the first reply is cut depends on timing, and some cut points lead the
    # model to end the second reply after a few words; both replies must still be running when signalled.
    r = Chatapp(chat_args(stories_path, "--max-tokens", "3000", "--ignore-eos", "--stats-json", str(stats)),
                make_env(tmp_path))
    r.send(f"{STORY}\n".encode())
    r.wait_for(lambda: len(r.out) > 300, what="the first reply")
    r.p.send_signal(signal.SIGINT)  # stops this reply only
    r.wait_for(lambda: len(rows(stats)) == 1, what="the first turn to end")
    first_out = bytes(r.out)
    r.send(b"What happened next?\n")
    r.wait_for(lambda: len(r.out) > len(first_out) + 300, what="the second reply")
    r.p.send_signal(signal.SIGTERM)  # stops the reply, saves, exits
    assert r.finish(30) == 143, r.stderr
    one, two = rows(stats)
    assert one["finish"] == two["finish"] == "cancelled" and one["generated_tokens"] < 3000
    # the cache held the interrupted reply: the next turn reused all of it
    assert two["reused_tokens"] >= one["prompt_tokens"] + one["generated_tokens"] - 3
    data = tmp_path / "data"
    stored = messages(data)
    assert [(role, status) for role, _, status in stored] == [
        ("user", "complete"), ("assistant", "interrupted"), ("user", "complete"), ("assistant", "interrupted")]
    assert stored[1][1] == first_out.decode().strip()
    assert snapshot_path(data, 1).exists()  # written on the way out
    stats2 = tmp_path / "stats2.jsonl"
    again = Chatapp(chat_args(stories_path, "--resume", "-v", "--max-tokens", "8", "--stats-json", str(stats2),
                              "-p", "And then?"), make_env(tmp_path))
    assert again.finish() == 0, again.stderr
    row = rows(stats2)[0]
    assert row["resume"]["source"] == "snapshot" and row["reused_tokens"] >= row["resume"]["snapshot_tokens"] - 2
    assert "resumed conversation 1 (4 messages) from its KV snapshot" in again.stderr
    assert len(messages(data)) == 6


def test_sigkill_mid_reply_keeps_completed_messages_and_resume_works(stories_path, base, tmp_path):
    data = copy_base(base, tmp_path)
    before = messages(data)
    # --ignore-eos: the reply must still be running when it is killed, however fast this machine is
    r = Chatapp(chat_args(stories_path, "--resume", "--max-tokens", "3000", "--ignore-eos", "-p", STORY),
                make_env(tmp_path, data))
    r.wait_for(lambda: len(r.out) > 200, what="the reply")
    time.sleep(PARTIAL_SECONDS + 0.3)  # at least one in-progress write after the first
    shown = r.stdout
    r.p.kill()
    assert r.finish() == -signal.SIGKILL
    stored = messages(data)
    assert stored[:3] == before + [("user", STORY, "complete")]
    role, partial, status = stored[3]
    assert role == "assistant" and status == "in_progress" and partial and shown.strip().startswith(partial.strip())
    stats = tmp_path / "stats.jsonl"
    again = Chatapp(chat_args(stories_path, "--resume", "--max-tokens", "8", "--stats-json", str(stats),
                              "-p", "What happened next?"), make_env(tmp_path, data))
    assert again.finish() == 0, again.stderr
    assert "1 reply left unfinished by an earlier run (killed, crashed or out of disk space) was kept as saved, " \
           "marked interrupted" in again.stderr
    stored = messages(data)
    assert stored[:3] == before + [("user", STORY, "complete")]
    assert stored[3] == ("assistant", partial, "interrupted")
    assert [m[0] for m in stored[4:]] == ["user", "assistant"] and stored[5][2] == "complete"
    row = rows(stats)[0]
    # the snapshot of the first turn still fits the transcript: only the rest is prefilled
    assert row["resume"]["source"] == "snapshot" and row["reused_tokens"] >= row["resume"]["snapshot_tokens"] - 2


# ---- the data directory ----------------------------------------------------------------------------------
def test_two_instances_on_one_data_directory(stories_path, base, tmp_path):
    data = copy_base(base, tmp_path)
    env = make_env(tmp_path, data)
    stats = tmp_path / "stats.jsonl"
    first = Chatapp(chat_args(stories_path, "--max-tokens", "12", "--stats-json", str(stats)), env)
    first.send(b"Tell me about a dog.\n")
    first.wait_for(lambda: len(rows(stats)) == 1, what="the first turn")
    second = Chatapp(chat_args(stories_path, "--max-tokens", "8", "-p", "Hello from the second one."), env)
    delete = Chatapp(["sessions", "delete", "1"], env)
    listing = Chatapp(["sessions", "list"], env)
    assert run_all([second, delete, listing]) == [0, 1, 0]
    note = f"another chatapp (pid {first.pid}) is using the data directory {data}"
    assert note in second.stderr and "will not be saved" in second.stderr and second.stdout.strip()
    assert note in one_error_line(delete.stderr)
    assert "Tell me about a cat." in listing.stdout and "Tell me about a dog." in listing.stdout
    first.send(b"And then?\n")
    assert first.finish() == 0, first.stderr
    assert integrity(data) == "ok"
    conn = sqlite3.connect(data / DB_NAME)
    assert conn.execute("SELECT COUNT(*) FROM conversations").fetchone()[0] == 2  # base + first; none from second
    conn.close()
    assert [c for _, c, _ in messages(data)][0::2] == ["Tell me about a dog.", "And then?"]


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_disk_full_while_saving_goes_on_in_memory(stories_path, base, tmp_path):
    data = copy_base(base, tmp_path)
    before = messages(data)
    snap_before = snapshot_path(data, 1).read_bytes()
    # every file may grow to its present size plus about two database pages: the next writes fail
    limit = max(32768, max(p.stat().st_size for p in data.iterdir() if p.is_file())) + 9000
    lines = ["What did the cat eat?", "Where did it sleep?", "Who was its friend?", "Was it sunny?"]
    stats = tmp_path / "stats.jsonl"  # a few KiB: within the limit
    r = Chatapp(chat_args(stories_path, "--resume", "--max-tokens", "40", "--stats-json", str(stats)),
                make_env(tmp_path, data), preexec_fn=_limit_file_size(limit))
    r.send("".join(f"{q}\n" for q in lines).encode())
    assert r.finish() == 0, r.stderr
    assert [row["generated_tokens"] > 0 for row in rows(stats)] == [True] * len(lines)  # all answered
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("chatapp: error:")]
    assert errors and all("intact" in ln for ln in errors) and "Traceback" not in r.stderr
    assert any("could not save the conversation" in ln and "the chat goes on in memory" in ln for ln in errors)
    assert integrity(data) == "ok"
    stored = messages(data)
    assert stored[:2] == before  # nothing saved before was damaged
    users = [c for role, c, _ in stored[2:] if role == "user"]
    assert users == lines[: len(users)] and len(stored) < 2 + 2 * len(lines)  # a prefix; the rest in memory
    assert snapshot_path(data, 1).read_bytes() == snap_before
    assert not [p for p in (data / "snapshots").iterdir() if p.name != "1.safetensors"]


def test_truncated_snapshot_is_detected_and_the_transcript_reprefilled(stories_path, base, tmp_path):
    """(Corrupt bytes, another model or weights, an edited transcript: see test_store_chat.py.)"""
    from chatapp.store.snapshot import read_snapshot

    data = copy_base(base, tmp_path)
    snap = snapshot_path(data, 1)
    snap.write_bytes(snap.read_bytes()[:5000])
    stats = tmp_path / "stats.jsonl"
    r = Chatapp(chat_args(stories_path, "--resume", "--max-tokens", "8", "--stats-json", str(stats),
                          "-p", "What did it eat?"), make_env(tmp_path, data))
    assert r.finish() == 0, r.stderr
    line = one_error_line(r.stderr)
    assert line.startswith("chatapp: note: conversation 1: KV snapshot not used (the file is damaged")
    assert line.endswith("re-prefilling its 2 messages from the transcript")
    row = rows(stats)[0]
    assert row["resume"]["source"] == "transcript" and row["reused_tokens"] == 0
    assert len(messages(data)) == 4
    assert read_snapshot(snap).messages == 4  # a good snapshot again


def test_resume_with_nothing_to_resume(stories_path, tmp_path):
    r = Chatapp(chat_args(stories_path, "--resume", "-p", "hi"), make_env(tmp_path))
    assert r.finish() == 2
    assert "no saved conversation" in one_error_line(r.stderr) and not (tmp_path / "data").exists()
