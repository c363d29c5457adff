"""One conversation over two ranks: `mlx.launch --backend ring -n 2` on loopback, against the
single-process engine, plus the failure paths (a rank killed, a rank hung, a model that does not
split) and the pieces that need no launch (environment detection, stdin commands, checks).

The references are the single-process engine run in this process through the same path the CLI
takes (config -> load_engine -> session_from_config -> Session.send), and the expected stdout is
what `chatapp --no-tui` prints for it: the replies, separated by a blank line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from chatapp import slash_commands
from chatapp.distributed import channel as dist_channel
from chatapp.distributed import job as dist_job
from chatapp.distributed import shard as dist_shard
from chatapp.distributed.channel import Watchdog
from chatapp.distributed.launch import launched, world_from_env
from chatapp.distributed.shard import ShardError, check_shardable
from chatapp.slash_commands import Command, CommandError, parse_line

REPO = Path(__file__).resolve().parent.parent
LINES = ["Once upon a time", "The cat", "Then"]


# ---------------------------------------------------------------------------------------------
# helpers: models, the launcher, the single-process reference


def _launcher() -> list[str]:
    exe = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def _free_ports() -> int:
    """A port p with p and p + 1 free (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("config")  # empty: no user config file
    e = dict(os.environ)
    e.update(CHATAPP_CONFIG_DIR=str(cfg), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    e.pop("MLX_RANK", None)
    e.pop("MLX_HOSTFILE", None)
    return e


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Random-weight models written with the stories tokenizer (skips without ../shared)."""
    from tests.conftest import shared_model

    stories = shared_model("stories260K")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    from chatapp.model.loader import save_model_dir
    from chatapp.model.synthetic import LlamaShape, build_random_llama

    root = tmp_path_factory.mktemp("models")
    out = {"stories": stories}
    shape = LlamaShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=16, intermediate_size=256, vocab_size=512)
    model, config = build_random_llama(shape, seed=1)
    out["kv4"] = save_model_dir(root / "kv4", model, config, stories)
    shape = LlamaShape(hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                       head_dim=16, intermediate_size=256, vocab_size=512)
    model, config = build_random_llama(shape, seed=1)
    out["kv3"] = save_model_dir(root / "kv3", model, config, stories)
    # Qwen2: an architecture mlx-lm can pipeline.
    qcfg = {"model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
            "num_attention_heads": 8, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 512,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}
    mx.random.seed(3)
    q = qwen2.Model(qwen2.ModelArgs.from_dict(qcfg))
    params = []
    for name, p in tree_flatten(q.parameters()):
        if name.endswith("norm.weight"):
            params.append((name, mx.ones_like(p)))
        elif name.endswith("bias"):
            params.append((name, mx.random.normal(p.shape) * 0.02))
        else:
            params.append((name, mx.random.normal(p.shape) * (1.0 if "embed" in name else p.shape[-1] ** -0.5)))
    q.load_weights(params)
    out["qwen"] = save_model_dir(root / "qwen", q, qcfg, stories)
    return out


def _flags(model, mode="prealloc", max_tokens=10, extra=()):
    return ["--model", str(model), "--temp", "0", "--max-tokens", str(max_tokens), "--cache-mode", mode,
            "--window", "16", "--sinks", "4", "--evict-chunk", "16", *extra]


_OVERRIDES = {"--model": "model.id", "--temp": "sampling.temp", "--max-tokens": "sampling.max_tokens",
              "--cache-mode": "cache.mode", "--window": "cache.window", "--sinks": "cache.sinks",
              "--evict-chunk": "cache.evict_chunk"}


def single_process(flags: list[str], lines: list[str], env: dict, monkeypatch):
    """The single-process run of ``lines``: (replies, per-turn stats, session)."""
    from chatapp.config import load_config
    from chatapp.engine.events import TokenEvent, TurnDone
    from chatapp.engine.setup import load_engine, session_from_config

    monkeypatch.setenv("CHATAPP_CONFIG_DIR", env["CHATAPP_CONFIG_DIR"])
    pairs = [f for f in flags if f != "--ignore-eos"]
    overrides = {_OVERRIDES[k]: v for k, v in zip(pairs[::2], pairs[1::2]) if k in _OVERRIDES}
    if "--ignore-eos" in flags:
        overrides["sampling.ignore_eos"] = True
    config = load_config(None, overrides)
    session = session_from_config(config, load_engine(config))
    replies, stats = [], []
    for line in lines:
        cmd = parse_line(line)
        if cmd.kind == "send":
            text = ""
            for ev in session.send(cmd.text):
                if isinstance(ev, TokenEvent):
                    text += ev.text
                elif isinstance(ev, TurnDone):
                    stats.append(ev.stats)
            replies.append(text)
        else:
            slash_commands.validate_command(session, cmd)
            slash_commands.apply_command(session, cmd)
    return replies, stats, session


def expected_stdout(replies: list[str]) -> str:
    return "\n".join(r + "\n" for r in replies)


class Job:
    """`mlx.launch --backend ring -n 2 -- python -m chatapp --no-tui ...`, read as it runs.

    stdin stays open until the job ends: mlx.launch never passes EOF on to the ranks (and spins
    on a closed stdin), so conversations end with /quit.
    """

    def __init__(self, flags: list[str], env: dict, extra_env: dict | None = None):
        cmd = [*_launcher(), "--backend", "ring", "-n", "2", "--starting-port", str(_free_ports()), "--",
               sys.executable, "-m", "chatapp", "--no-tui", *flags]
        e = dict(env, **(extra_env or {}))
        self.p = subprocess.Popen(cmd, cwd=REPO, env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE)
        self.out, self.err = bytearray(), bytearray()
        self.threads = [threading.Thread(target=self._pump, args=(self.p.stdout, self.out), daemon=True),
                        threading.Thread(target=self._pump, args=(self.p.stderr, self.err), daemon=True)]
        for t in self.threads:
            t.start()

    @staticmethod
    def _pump(stream, buf):
        while True:
            chunk = stream.read1(4096) if hasattr(stream, "read1") else stream.read(4096)
            if not chunk:
                return
            buf.extend(chunk)

    def send(self, lines: list[str]) -> None:
        self.p.stdin.write("".join(line + "\n" for line in lines).encode())
        self.p.stdin.flush()

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.02)
        if not predicate():
            self.kill()
            raise AssertionError(f"timed out waiting for {what}\nstdout: {self.stdout!r}\nstderr: {self.stderr}")

    def finish(self, timeout: float = 60) -> "Job":
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end in {timeout} s\nstdout: {self.stdout!r}\nstderr: {self.stderr}")
        finally:
            for t in self.threads:
                t.join(timeout=5)
            self.p.stdin.close()
        return self

    def kill(self) -> None:
        for pid in self.rank_pids().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.p.kill()
        self.p.wait()

    def rank_pid(self, rank: int) -> int:
        self.wait_for(lambda: rank in self.rank_pids(), 10, f"rank {rank}'s process")
        return self.rank_pids()[rank]

    def rank_pids(self) -> dict[int, int]:
        """The ranks' pids: children of the launcher, told apart by MLX_RANK in their environment."""
        pids = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
                if ppid != self.p.pid:
                    continue
                environ = (d / "environ").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            for item in environ:
                if item.startswith(b"MLX_RANK="):
                    pids[int(item[9:])] = int(d.name)
        return pids

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", errors="replace")

    def exit_codes(self) -> dict[int, int]:
        """What mlx.launch reports per rank (it reports only non-zero exits; it always returns 0)."""
        return {int(r): int(c) for r, c in re.findall(r"Node with rank (\d+) exited with code (-?\d+)", self.stderr)}

    def chat_errors(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("chatapp") and "error:" in ln]


def run_job(flags, lines, env, extra_env=None, timeout=60) -> Job:
    job = Job(flags, env, extra_env)
    job.send([*lines, "/quit"])
    return job.finish(timeout)


def _stats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# two ranks give the single-process replies


def _check_matrix_run(job: Job, stats: Path, replies, ref_stats, mode: str, turns: int = 3) -> list[dict]:
    assert job.stdout.startswith(expected_stdout(replies[:turns]))
    rows = _stats(stats)
    assert len(rows) == turns
    for row, ref in zip(rows, ref_stats):
        assert row["mode"] == mode
        assert row["distributed"]["ranks"] == 2 and row["distributed"]["strategy"] == "tensor"
        per_rank = row["per_rank_bytes"]
        # each rank holds half of the KV heads: half the single-process cache each
        assert per_rank == [ref.cache.bytes_held // 2] * 2
        assert row["distributed"]["total_bytes"] == ref.cache.bytes_held
        assert row["cache"]["bytes_held"] == per_rank[0]
    if mode == "window":
        assert rows[-1]["cache"]["evicted"] > 0
    return rows


@pytest.mark.parametrize("mode", ["prealloc", "window"])
def test_two_ranks_match_single_process_stories(models, env, data_dir, tmp_path, monkeypatch, mode):
    flags = _flags(models["stories"], mode)
    replies, ref_stats, _ = single_process(flags, LINES, env, monkeypatch)
    stats = tmp_path / "stats.jsonl"
    job = run_job([*flags, "--stats-json", str(stats), "--data-dir", str(data_dir)], LINES, env)
    assert job.exit_codes() == {}, job.stderr
    assert job.chat_errors() == []
    assert job.stdout == expected_stdout(replies)
    _check_matrix_run(job, stats, replies, ref_stats, mode)


def test_kv4_window_matches_single_process_then_a_hung_rank_is_caught(models, env, tmp_path, monkeypatch):
    """The 4-KV-head model in window mode: three turns give the single-process replies. Then,
    mid-way through a long fourth reply, rank 1 is stopped (SIGSTOP): its sockets stay open, so
    only the watchdog can notice; rank 0 gives up after CHATAPP_DIST_TIMEOUT seconds."""
    flags = _flags(models["kv4"], "window")
    replies, ref_stats, _ = single_process(flags, [*LINES, "/set max_tokens=200", "Tell me more"], env, monkeypatch)
    assert ref_stats[3].finish == "length"  # the fourth reply runs long
    stats = tmp_path / "stats.jsonl"
    job = Job([*flags, "--stats-json", str(stats)], env, {dist_channel.TIMEOUT_ENV: "4"})  # short, with room for load
    job.send([*LINES, "/set max_tokens=3000", "Tell me more"])
    three = expected_stdout(replies[:3])
    job.wait_for(lambda: job.stdout.startswith(three + "\n") and len(job.stdout) > len(three) + 3,
                 60, "the fourth reply to stream")
    pid1 = job.rank_pid(1)
    os.kill(pid1, signal.SIGSTOP)
    try:
        job.wait_for(lambda: "Node with rank 0 exited" in job.stderr, 30, "rank 0 to give up")
    finally:
        os.kill(pid1, signal.SIGKILL)  # a stopped process cannot take mlx.launch's SIGTERM
    job.finish(30)
    _check_matrix_run(job, stats, replies, ref_stats, "window")
    assert job.exit_codes()[0] == dist_job.EXIT_PEER_LOST
    # Search the whole of stderr: mlx.launch relays each rank's stderr on its own thread, so
    # under load another rank's output can land on the same line as rank 0's message.
    found = re.search(r"distributed run stopped during turn 4: no progress for \d+ s in send[^\n]*", job.stderr)
    assert found, job.stderr
    line = found.group(0)
    assert "CHATAPP_DIST_TIMEOUT" in line and "(7 messages, 3 complete replies" in line


def test_prealloc_then_mode_switch_and_set(models, env, tmp_path, monkeypatch):
    """Three prealloc turns (the 4-KV-head model), then `/mode window ...` and `/set` mid-conversation.

    A last turn samples at temp 1.0 with a random seed: rank 0 draws it and sends it with the
    turn, and the end-of-turn agreement check (tokens and conversation checksums) passes, or the
    job would stop with "the ranks diverged".
    """
    flags = _flags(models["kv4"], "prealloc")
    lines = [*LINES, "/mode window window=16 sinks=4 evict_chunk=8", "And then", "/set max_tokens=5", "The end"]
    replies, ref_stats, _ = single_process(flags, lines, env, monkeypatch)
    stats = tmp_path / "stats.jsonl"
    job = run_job([*flags, "--stats-json", str(stats)], [*lines, "/set temp=1.0 seed=-1", "Sing"], env)
    assert job.exit_codes() == {}, job.stderr
    assert job.chat_errors() == []
    assert job.stdout.startswith(expected_stdout(replies) + "\n")
    assert re.search(r"^chatapp: cache mode window: (converted the live cache|re-prefilled)", job.stderr, re.M)
    assert "chatapp: sampling: max_tokens=5" in job.stderr
    assert "chatapp: sampling: temp=1.0, seed=-1" in job.stderr
    rows = _stats(stats)
    assert [r["mode"] for r in rows] == ["prealloc"] * 3 + ["window"] * 3
    assert rows[4]["generated_tokens"] <= 5 and rows[5]["generated_tokens"] >= 1
    assert [r["per_rank_bytes"] for r in rows[:5]] == [[s.cache.bytes_held // 2] * 2 for s in ref_stats]


def test_pipeline_two_ranks_match_single_process_then_ctrl_c_cancels_on_both(models, env, tmp_path, monkeypatch):
    """Qwen2 is pipelined by mlx-lm: each rank holds half of the layers (window: chunked prefill).

    Then a long fourth reply is interrupted with SIGINT on rank 0: both ranks stop at the same
    token (rank 1 passes the end-of-turn agreement check and exits 0), rank 0 exits 130 as the
    single-process CLI does after a cancelled turn.
    """
    flags = _flags(models["qwen"], "window")
    lines = [*LINES, "/set max_tokens=200", "Tell me more"]
    replies, ref_stats, _ = single_process(flags, lines, env, monkeypatch)
    assert ref_stats[3].finish == "length"  # the fourth reply runs long
    stats = tmp_path / "stats.jsonl"
    job = Job([*flags, "--distributed", "pipeline", "--stats-json", str(stats)], env)
    job.send([*LINES, "/set max_tokens=3000", "Tell me more"])
    three = expected_stdout(replies[:3])
    job.wait_for(lambda: job.stdout.startswith(three + "\n") and len(job.stdout) > len(three) + 3,
                 60, "the fourth reply to stream")
    os.kill(job.rank_pid(0), signal.SIGINT)
    job.finish(30)
    assert job.exit_codes() == {0: 130}, job.stderr
    assert job.chat_errors() == []
    rows = _stats(stats)
    assert [r["finish"] for r in rows] == ["length"] * 3 + ["cancelled"]
    assert rows[-1]["generated_tokens"] < 3000
    assert job.stdout.startswith(three)
    for row, ref in zip(rows[:3], ref_stats):
        assert row["distributed"]["strategy"] == "pipeline"
        assert sum(row["per_rank_bytes"]) == ref.cache.bytes_held
        assert row["per_rank_bytes"][0] == row["per_rank_bytes"][1]


# ---------------------------------------------------------------------------------------------
# failures


def _long_second_turn(models, env, monkeypatch):
    """Lines whose second reply runs long (no EOS with --ignore-eos; checked: no stop string in
    its first 200 tokens)."""
    flags = _flags(models["kv4"], "prealloc", max_tokens=6, extra=("--ignore-eos",))
    lines = ["Once upon a time", "/set max_tokens=200", "Tell me more"]
    replies, stats, _ = single_process(flags, lines, env, monkeypatch)
    assert stats[1].finish == "length"
    return flags, ["Once upon a time", "/set max_tokens=3000", "Tell me more"], replies[0]


def test_killing_a_rank_mid_reply_stops_cleanly(models, env, tmp_path, monkeypatch):
    flags, lines, first = _long_second_turn(models, env, monkeypatch)
    stats = tmp_path / "stats.jsonl"
    job = Job([*flags, "--stats-json", str(stats)], env)
    job.send(lines)
    job.wait_for(lambda: job.stdout.startswith(first + "\n\n") and len(job.stdout) > len(first) + 3,
                 60, "the second reply to stream")
    os.kill(job.rank_pid(1), signal.SIGKILL)
    job.finish(30)
    codes = job.exit_codes()
    assert codes.get(1) == -9
    assert codes.get(0) in (dist_job.EXIT_PEER_LOST, 128 + signal.SIGTERM), job.stderr  # an exit, not a kill
    errors = job.chat_errors()
    assert len(errors) == 1, job.stderr
    assert errors[0].startswith("chatapp: error: distributed run stopped during turn 2: ")
    assert "kept the conversation up to the last complete message (3 messages, 1 complete reply" in errors[0]
    assert "the unfinished reply was not kept" in errors[0]
    assert job.stdout.startswith(first + "\n\n") and job.stdout.endswith("\n")
    assert len(_stats(stats)) == 1  # only the complete turn


def test_heads_that_do_not_divide_are_refused_in_one_line(models, env):
    job = run_job([*_flags(models["kv3"]), "--distributed", "tensor"], ["Hello"], env)
    assert job.exit_codes() == {0: 2, 1: 2}, job.stderr
    errors = job.chat_errors()
    assert errors == [
        f"chatapp: error: cannot shard {models['kv3']} over 2 ranks: tensor parallelism splits the attention "
        "heads, and its 6 query heads and 3 KV heads must both divide by 2 (use 3 ranks)"
    ]
    assert job.stdout == ""


# ---------------------------------------------------------------------------------------------
# no launch needed


def test_launched_reads_what_mlx_launch_sets(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    single = tmp_path / "single.json"
    single.write_text("\n")  # mlx.launch writes an empty hostfile for one rank
    assert world_from_env({"MLX_RANK": "1", "MLX_HOSTFILE": str(hosts)}) == (1, 2, "ring")
    assert launched({"MLX_RANK": "1", "MLX_HOSTFILE": str(hosts)})
    assert not launched({"MLX_RANK": "0", "MLX_HOSTFILE": str(single)})
    assert not launched({"MLX_RANK": "0", "MLX_HOSTFILE": str(tmp_path / "missing.json")})
    assert launched({"MLX_RANK": "0", "MLX_WORLD_SIZE": "4"})
    assert world_from_env({"MLX_RANK": "2", "MLX_IBV_DEVICES": str(hosts)}) == (2, 2, "jaccl")
    assert world_from_env({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"}) == (2, 3, "mpi")
    assert not launched({"OMPI_COMM_WORLD_SIZE": "1"})
    assert not launched({})


def test_distributed_module_imports_no_mlx():
    code = ("import sys; import chatapp.distributed.job, chatapp.distributed.launch as d; d.launched(); "
            "print('mlx' in sys.modules, 'mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_stdin_commands_parse():
    assert parse_line("  ") is None
    assert parse_line("hello\n") == Command("send", text="hello")
    assert parse_line("//mode is a word") == Command("send", text="/mode is a word")
    assert parse_line("/mode window window=64 sinks=2") == Command("mode", mode="window",
                                                                   changes={"window": 64, "sinks": 2})
    assert parse_line("/MODE auto").mode == "auto"
    assert parse_line("/set temp=0.5 max-tokens=9 seed=-1") == Command(
        "set", changes={"temp": 0.5, "max_tokens": 9, "seed": -1})
    assert parse_line("/quit").kind == "quit" and parse_line("/exit").kind == "quit"
    for bad, msg in [("/mode", "name a mode"), ("/mode fast", "unknown cache mode 'fast'"),
                     ("/mode window size=3", "unknown setting 'size'"), ("/mode window window=x", "must be an integer"),
                     ("/set temp=-1", "temp: must be >= 0"), ("/set top_p=0", "top_p: must be > 0"),
                     ("/set temp", "expected key=value"), ("/frobnicate", "unknown command /frobnicate"),
                     ("/quit now", "takes no arguments")]:
        with pytest.raises(CommandError, match=re.escape(msg)):
            parse_line(bad)


def test_commands_apply_to_a_session(stories):
    from cache import CacheSettings
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session

    model, tok = stories
    s = Session(model, tok, cache_settings=CacheSettings(), mode="prealloc", generation=GenerationSettings(temp=0))
    with pytest.raises(CommandError, match="head_dim .8. is not a multiple of kv_group_size"):
        slash_commands.validate_command(s, parse_line("/mode window-quant"))
    with pytest.raises(CommandError, match="window: must be >= sinks"):
        slash_commands.validate_command(s, parse_line("/mode window window=2 sinks=4"))
    assert s.mode == "prealloc"  # refused before anything changed
    cmd = parse_line("/mode window window=32 sinks=4 evict_chunk=8")
    slash_commands.validate_command(s, cmd)
    assert slash_commands.apply_command(s, cmd).startswith("cache mode window: ")
    assert s.mode == "window" and s.settings.window == 32
    assert slash_commands.apply_command(s, parse_line("/set temp=0.3 seed=-1 max_tokens=7")) == \
        "sampling: temp=0.3, seed=-1, max_tokens=7"
    assert (s.generation.temp, s.generation.seed, s.generation.max_tokens) == (0.3, None, 7)


def test_shardability_checks(models):
    from mlx_lm.utils import load_model as lm_load_model

    kv3, kv3_config = lm_load_model(Path(models["kv3"]), lazy=True)
    with pytest.raises(ShardError, match=r"6 query heads and 3 KV heads must both divide by 2 \(use 3 ranks\)"):
        check_shardable(kv3, kv3_config, 2, "tensor", "kv3")
    with pytest.raises(ShardError, match=r"4 KV heads must both divide by 8 \(use 2 or 4 ranks\)"):
        kv4, kv4_config = lm_load_model(Path(models["kv4"]), lazy=True)
        check_shardable(kv4, kv4_config, 8, "tensor", "kv4")
    check_shardable(kv3, kv3_config, 3, "tensor", "kv3")
    with pytest.raises(ShardError, match="mlx-lm implements pipeline parallelism only for some architectures .*"
                                         "not llama; use --distributed tensor"):
        check_shardable(kv3, kv3_config, 2, "pipeline", "kv3")
    qwen, qwen_config = lm_load_model(Path(models["qwen"]), lazy=True)
    check_shardable(qwen, qwen_config, 2, "pipeline", "qwen")
    with pytest.raises(ShardError, match="it has only 4 layers"):
        check_shardable(qwen, qwen_config, 5, "pipeline", "qwen")
    from chatapp.model.synthetic import LlamaShape, build_random_llama

    odd, _ = build_random_llama(LlamaShape(intermediate_size=255))  # heads divide, the MLP does not
    with pytest.raises(ShardError, match=r"^cannot shard odd over 2 ranks \(tensor\): Cannot shard the output of "
                                         r"size 255 across 2 devices"):
        dist_shard._apply_shard(odd, _Group(0, 2), "tensor", "odd")
    no_shard = SimpleNamespace()
    with pytest.raises(ShardError, match="has no shard\\(\\); it cannot be pipelined either"):
        check_shardable(no_shard, {"model_type": "toy"}, 2, "tensor", "toy")


def test_watchdog_fires_only_while_busy_and_stalled():
    now = [0.0]
    fired = []
    wd = Watchdog(5.0, fired.append, clock=lambda: now[0])
    wd.busy("in send")
    now[0] = 4.0
    assert wd.stalled() is None
    wd.beat()
    now[0] = 8.0
    assert wd.stalled() is None  # 4 s since the last beat
    now[0] = 10.0
    assert wd.stalled() == pytest.approx(6.0)
    wd.idle()
    now[0] = 100.0
    assert wd.stalled() is None  # waiting for the user is not a stall
    assert Watchdog(0, fired.append).stalled() is None  # 0 turns it off
    # and on its thread it reports once, then stops
    wd = Watchdog(0.05, fired.append, poll=0.01)
    wd.busy("in send")
    wd.start()
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    wd.stop()
    assert fired and fired[0].startswith("no progress for 0 s in send")


def test_distributed_flag_without_a_job_is_a_clear_error(capsys):
    args = SimpleNamespace(distributed="tensor", prompt="hi", no_tui=True)
    assert dist_job.run_distributed(args, None, None) == 2
    err = capsys.readouterr().err
    assert err.startswith("chatapp: error: --distributed needs a job of 2 or more ranks; start it with mlx.launch")
    assert err.count("\n") == 1


def test_bench_prompt_one_point_and_table(models, tmp_path, monkeypatch, capsys):
    """`chatapp bench distributed`: the prompt, a real one-rank point, and the table it builds.

    (The N-rank point runs the same command under mlx.launch, as the tests above do.)
    """
    from chatapp.bench import distributed_bench as bench

    assert len(bench.prompt_text(300)) == 300
    row = bench.run_point(str(models["kv4"]), 40, 4, 1, "prealloc", tmp_path, 120)
    assert 0 < row["prompt_tokens"] <= 41 and row["generated_tokens"] >= 1 and row["cache"]["bytes_held"] > 0

    def fake_point(model, context, decode, ranks, mode, workdir, timeout):
        held = 1000 * context
        per_rank = [held // ranks] * ranks
        return {"prompt_tokens": context, "decode_tps": 20.0 / ranks, "ttft": 0.1, "cache": {"bytes_held": held},
                "steps": [{"context": context, "ms": 50.0 * ranks}],
                **({"per_rank_bytes": per_rank} if ranks > 1 else {})}

    monkeypatch.setattr(bench, "run_point", fake_point)
    args = SimpleNamespace(model=str(models["kv4"]), contexts="64,128", decode_tokens=4, ranks=2, repeats=3,
                           cache_mode="prealloc", timeout=10, json=str(tmp_path / "b.json"), plot=None)
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "per_rank_cache_saving_128: 50% (0.12 MiB on one rank -> 0.06 MiB per rank)" in out
    data = json.loads((tmp_path / "b.json").read_text())
    assert [r[:4] for r in data["rows"]] == [[1, 64, 20.0, 50.0], [2, 64, 10.0, 100.0], [1, 128, 20.0, 50.0],
                                             [2, 128, 10.0, 100.0]]
    assert data["rows"][3][-1] == "64000/64000"
    assert data["meta"]["decode_tps_runs_2r_64"] == "10.0, 10.0, 10.0"
    assert bench.run(SimpleNamespace(**{**vars(args), "ranks": 1})) == 2


class _Group:
    """What load_shard needs of a group to split the weights (no collective is run here)."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("kind", ["mlx-lm", "legacy-npz"])
def test_load_shard_splits_heads_and_keeps_the_dtype(models, tmp_path, monkeypatch, kind):
    """Each rank gets its half of every attention and MLP projection (stories: 8 heads, 4 KV heads)."""
    import mlx.core as mx

    from chatapp.config import load_config
    from chatapp.model.loader import load_model
    from tests.test_loader import make_legacy_stories

    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(tmp_path / "cfg"))
    path = models["stories"] if kind == "mlx-lm" else make_legacy_stories(models["stories"], tmp_path / "legacy")
    config = load_config(None, {"model.id": str(path)})
    full = load_model(str(path)).model.layers[0].self_attn
    halves = []
    for rank in (0, 1):
        loaded, info = dist_shard.load_shard(config, _Group(rank, 2), None)
        assert (info.strategy, info.n_heads, info.n_kv_heads, info.local_kv_heads) == ("tensor", 8, 4, 2)
        assert loaded.format == kind and loaded.dtype == "float32" and loaded.n_kv_heads == 2
        attn = loaded.model.layers[0].self_attn
        assert (attn.n_heads, attn.n_kv_heads) == (4, 2)
        assert attn.k_proj.weight.shape == (full.k_proj.weight.shape[0] // 2, full.k_proj.weight.shape[1])
        halves.append((attn.q_proj.weight, attn.o_proj.weight))
    assert mx.array_equal(mx.concatenate([halves[0][0], halves[1][0]], axis=0), full.q_proj.weight)
    assert mx.array_equal(mx.concatenate([halves[0][1], halves[1][1]], axis=1), full.o_proj.weight)


def test_load_shard_pipeline_keeps_its_layers(models, tmp_path, monkeypatch):
    from chatapp.config import load_config

    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(tmp_path / "cfg"))
    config = load_config(None, {"model.id": str(models["qwen"])})
    loaded, info = dist_shard.load_shard(config, _Group(1, 2), "pipeline")
    assert (info.strategy, info.local_layers, info.local_kv_heads) == ("pipeline", 2, 4)
    assert loaded.model.inner.model.start_idx == 0 and loaded.model.inner.model.end_idx == 2  # rank 1: first layers
    with pytest.raises(ShardError, match="not llama; use --distributed tensor"):
        dist_shard.load_shard(load_config(None, {"model.id": str(models["kv4"])}), _Group(0, 2), "pipeline")


class _Exit(Exception):
    pass


class _FakeChannel:
    """Plays the other rank's side of the collectives for one DistributedJob."""

    def __init__(self, other_row=None, hello=None):
        self.other_row, self.hello = other_row, hello
        self.sent = []

    def gather(self, row):
        return [row, self.other_row if self.other_row is not None else row]

    def message(self, op=0, payload=b""):
        self.sent.append(op)
        return dist_channel.OP_CMD, json.dumps(self.hello).encode()

    def send_json(self, op, obj):
        self.sent.append(op)

    def any(self, flag):
        return flag


def _job(stories_path, tmp_path, monkeypatch, rank=0, channel=None):
    import io

    from chatapp.config import load_config
    from chatapp.engine.setup import load_engine, session_from_config

    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(tmp_path / "cfg"))
    config = load_config(None, {"model.id": str(stories_path), "sampling.temp": 0, "sampling.max_tokens": 4})
    args = SimpleNamespace(prompt=None, no_tui=True, distributed=None, verbose=True, stats_json=None)
    out, err = io.StringIO(), io.StringIO()
    job = dist_job.DistributedJob(args, config, None, _Group(rank, 2), out=out, err=err)
    job.channel = channel or _FakeChannel()
    job.session = session_from_config(config, load_engine(config))
    job.session._cancel = dist_channel.SharedCancel(job.channel)
    job.info = dist_shard.ShardInfo("tensor", rank, 2, 8, 4, 2, 5)

    def stop(code):
        raise _Exit(code)

    job._exit = stop
    return job, out, err


def test_job_reports_per_rank_bytes_and_stops_on_divergence(stories_path, tmp_path, monkeypatch):
    job, out, err = _job(stories_path, tmp_path, monkeypatch)
    done, state = job.execute(Command("send", text="Once upon a time"), seed=None)
    assert out.getvalue().endswith("\n") and len(job.session.conversation.messages) == 2
    job._report(done, state)
    held = job.session.cache_view().bytes_held
    assert err.getvalue().rstrip().endswith(f"2 ranks (tensor): cache {dist_fmt(held)} + {dist_fmt(held)} = "
                                            f"{dist_fmt(2 * held)}")
    # the other rank holds other tokens: every rank stops, rank 0 says what it kept
    job.channel.other_row = [len(job.session.cached) + 1, 0, 0, 0, 0, 0, 0]
    with pytest.raises(dist_channel.DistributedError, match=r"the ranks diverged \(cached differs"):
        job._sync()
    with pytest.raises(_Exit) as stop:
        job.abort("the ranks diverged")
    assert stop.value.args == (dist_job.EXIT_PEER_LOST,)
    assert err.getvalue().splitlines()[-1] == (
        "chatapp: error: distributed run stopped during turn 1: the ranks diverged; kept the conversation up to "
        "the last complete message (2 messages, 1 complete reply, all printed above)")


def test_job_signals(stories_path, tmp_path, monkeypatch):
    job, out, err = _job(stories_path, tmp_path, monkeypatch)
    job._on_signal(signal.SIGINT)  # first Ctrl-C: cancel the reply (on every rank, through the flag)
    assert job.session._cancel.is_set()
    with pytest.raises(_Exit) as stop:
        job._on_signal(signal.SIGINT)  # second: stop
    assert stop.value.args == (130,)
    job._abort_lock = threading.Lock()
    with pytest.raises(_Exit) as stop:
        job._on_signal(signal.SIGTERM)
    assert stop.value.args == (143,)
    assert "received SIGTERM (mlx.launch stops every rank when one of them exits" in err.getvalue()
    # once every rank knows how the run ends (after QUIT and its barrier), SIGTERM just ends it that way
    job.final_code, before = 0, err.getvalue()
    with pytest.raises(_Exit) as stop:
        job._on_signal(signal.SIGTERM)
    assert stop.value.args == (0,) and err.getvalue() == before


def test_follower_refuses_another_protocol(stories_path, tmp_path, monkeypatch):
    job, out, err = _job(stories_path, tmp_path, monkeypatch, rank=1,
                         channel=_FakeChannel(hello={"protocol": dist_channel.PROTOCOL + 1}))
    with pytest.raises(_Exit) as stop:
        job.start()
    assert stop.value.args == (2,)
    assert err.getvalue().strip() == (
        f"chatapp[rank 1]: error: stopping: rank 0 speaks protocol {dist_channel.PROTOCOL + 1}, "
        f"this rank {dist_channel.PROTOCOL}: "
        "run the same chatapp version on every host")
    assert out.getvalue() == ""


def test_followers_take_rank_0_settings_but_keep_their_cpu_section(tmp_path, monkeypatch):
    from chatapp.config import load_config

    monkeypatch.setenv("CHATAPP_CONFIG_DIR", str(tmp_path / "cfg"))
    rank0 = load_config(None, {"cache.window": 77, "sampling.temp": 0.25, "cpu.blas": "off"})
    local = load_config(None, {"cache.window": 5, "cpu.blas": "auto"})
    sent = json.loads(json.dumps({k: v for k, v in rank0.to_dict().items() if k != "cpu"}))
    got = dist_job._config_from(sent, local)
    assert got.cache == rank0.cache and got.sampling == rank0.sampling and got.model == rank0.model
    assert got.cpu == local.cpu


def dist_fmt(n):
    from chatapp.engine.stats import fmt_bytes

    return fmt_bytes(n)


def test_lead_loop_in_process(stories_path, tmp_path, monkeypatch):
    """Rank 0's loop against a stand-in for the other rank: output format, commands, errors, quit."""
    import io

    flags = ["--model", str(stories_path), "--temp", "0", "--max-tokens", "4"]
    env = {"CHATAPP_CONFIG_DIR": str(tmp_path)}
    as_text, _, _ = single_process(flags, ["//mode window"], env, monkeypatch)
    replies, _, _ = single_process(flags, ["Once upon a time", "The cat"], env, monkeypatch)
    # -p TEXT is a message even when it looks like a command
    job, out, err = _job(stories_path, tmp_path, monkeypatch)
    job.args.prompt, job.args.verbose = "/mode window", False
    assert job.lead() == 0
    assert out.getvalue() == expected_stdout(as_text)
    assert job.channel.sent == [dist_channel.OP_CMD, dist_channel.OP_QUIT]
    # stdin: blank lines skipped, a bad command refused without stopping, /quit ends
    job, out, err = _job(stories_path, tmp_path, monkeypatch)
    job.args.verbose = False
    job.stdin = io.StringIO("\n/mode fast\nOnce upon a time\n/set max_tokens=4\nThe cat\n/quit\nnever sent\n")
    assert job.lead() == 0
    assert out.getvalue() == expected_stdout(replies)
    assert err.getvalue().splitlines() == [
        "chatapp: error: /mode: unknown cache mode 'fast' (choose from auto, concat, prealloc, quantized, window, "
        "window-quant, scored, scored-quant)",
        "chatapp: sampling: max_tokens=4",
    ]
    assert job.channel.sent == [dist_channel.OP_CMD] * 3 + [dist_channel.OP_QUIT]


def test_empty_prompt_is_refused_on_every_rank(stories_path, tmp_path, monkeypatch):
    job, out, err = _job(stories_path, tmp_path, monkeypatch)
    job.args.prompt = "  "
    assert job.start() == 2
    assert err.getvalue() == "chatapp: error: the prompt is empty\n"
    job, out, err = _job(stories_path, tmp_path, monkeypatch, rank=1,
                         channel=_FakeChannel(hello={"protocol": dist_channel.PROTOCOL,
                                                     "error": "the prompt is empty"}))
    assert job.start() == 2
    assert err.getvalue() == ""
