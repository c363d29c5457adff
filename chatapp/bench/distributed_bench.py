"""Distributed decode: one rank against N ranks (mlx.launch, ring backend) on the same model and context.

Every point runs the real command line, end to end, and reads its ``--stats-json`` line:

* 1 rank:  ``python -m chatapp --no-tui --model M --temp 0 --max-tokens D --cache-mode MODE``
* N ranks: ``mlx.launch --backend ring -n N --env OPENBLAS_NUM_THREADS=cpus/N -- python -m chatapp
  --no-tui ...`` (tensor parallelism; on one machine the ranks share its cores and talk over
  loopback TCP)

with one user message of about C tokens (the context) followed by D greedily decoded tokens.
The table shows decode tokens/sec (steps after the first token; the median over ``--repeats``
runs), the median time of one decode step over all runs (robust to the machine's slow spells),
time to first token (the prefill of the C tokens), and the KV cache each rank holds after the
turn (bytes held, ``per_rank_bytes`` in the stats), so the per-rank saving of sharding the KV
heads is explicit.

The default model is a random-weight Llama written to a temporary folder with a byte-level
tokenizer (so one character is one token): 4 layers, hidden 1024, 16 query heads and 8 KV heads
of 64, MLP 2816 (55 M parameters, float32), whose output vocabulary leaves out the end-of-text
token so that every point decodes the same number of tokens. ``--model`` takes any folder or
repo id instead.

What to expect on one small machine: N ranks share the same cores and add 2 all-reduces per layer
per token (plus chatapp's one-element cancel flag per token) over loopback TCP, so they are not
faster; they exist to fit a model (and a KV cache) that one machine cannot hold. The numbers are
recorded as measured; the machine's load at the time matters (see ``load`` in the metadata).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from chatapp.bench.report import BenchReport, emit, line_plot

REPO = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument("--model", help="model folder or repo id (default: a random 4-layer Llama, 16/8 heads)")
    p.add_argument("--contexts", default="256,1024", help="comma-separated context lengths in tokens")
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens decoded per point")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the distributed points")
    p.add_argument("--cache-mode", default="prealloc", help="cache mode of every point")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each point, alternating 1 and N ranks; the table shows the medians")
    p.add_argument("--timeout", type=int, default=900, help="seconds allowed for each point")


# ---- the model --------------------------------------------------------------------------------


def build_bench_model(folder: Path) -> Path:
    """The default bench model: a random Llama with a byte-level tokenizer, saved to ``folder``."""
    from chatapp.model.loader import save_model_dir
    from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

    tok_dir = folder / "tokenizer"
    byte_tokenizer()._tokenizer.save_pretrained(str(tok_dir))
    # 257 outputs: bytes and <s>; the tokenizer's </s> (257) is not among them, so no reply ends
    # early and every point decodes exactly --decode-tokens tokens.
    shape = LlamaShape(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=64, intermediate_size=2816, vocab_size=257, max_position_embeddings=8192)
    model, config = build_random_llama(shape, seed=0)
    return save_model_dir(folder / "model", model, config, tok_dir)


def prompt_text(tokens: int) -> str:
    """About ``tokens`` tokens of plain text (exactly that many characters)."""
    phrase = "the quick brown fox jumps over a lazy dog while seven small birds sing "
    return (phrase * (tokens // len(phrase) + 1))[:tokens]


# ---- one point ----------------------------------------------------------------------------------


def _launcher() -> list[str]:
    exe = shutil.which("mlx.launch", path=str(Path(sys.executable).parent))
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def _free_port(count: int) -> int:
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for k in range(1, count):
                with socket.socket() as s2:
                    s2.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for the ring backend")


def run_point(model: str, context: int, decode: int, ranks: int, mode: str, workdir: Path, timeout: int) -> dict:
    """Run the CLI once (``ranks`` = 1: plain; more: under mlx.launch); returns its stats line."""
    stats = workdir / f"stats-{ranks}-{context}.jsonl"
    stats.unlink(missing_ok=True)
    flags = ["--no-tui", "--model", model, "--temp", "0", "--max-tokens", str(decode), "--cache-mode", mode,
             "--raw", "--stats-json", str(stats)]
    env = dict(os.environ, CHATAPP_CONFIG_DIR=str(workdir / "config"), PYTHONUNBUFFERED="1")
    (workdir / "config").mkdir(exist_ok=True)
    line = prompt_text(context) + "\n"
    cli = [sys.executable, "-m", "chatapp", *flags]
    if ranks == 1:
        out = subprocess.run(cli, input=line, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
        err, code = out.stderr, out.returncode
    else:
        # mlx.launch never passes stdin's end on to the ranks: keep it open and end with /quit.
        threads = max(1, (os.cpu_count() or ranks) // ranks)  # the ranks share this machine's cores
        cmd = [*_launcher(), "--backend", "ring", "-n", str(ranks), "--starting-port", str(_free_port(ranks)),
               "--env", f"OPENBLAS_NUM_THREADS={threads}", "--", *cli]
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        chunks: list[bytes] = []
        readers = [threading.Thread(target=lambda s=s: chunks.append(s.read()), daemon=True)
                   for s in (p.stdout, p.stderr)]
        for t in readers:
            t.start()
        p.stdin.write((line + "/quit\n").encode())
        p.stdin.flush()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for t in readers:
            t.join(timeout=10)
        p.stdin.close()
        err = b"".join(chunks).decode(errors="replace")
        code = 0 if "exited with code" not in err else 1
    rows = [json.loads(r) for r in stats.read_text().splitlines() if r.strip()] if stats.exists() else []
    if code != 0 or not rows:
        tail = "\n".join(err.strip().splitlines()[-5:])
        raise RuntimeError(f"{ranks}-rank point at context {context} failed:\n{tail}")
    return rows[-1]


# ---- the benchmark --------------------------------------------------------------------------------


def run(args) -> int:
    contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()]
    if args.ranks < 2:
        print("chatapp bench distributed: --ranks must be 2 or more", file=sys.stderr)
        return 2
    report = BenchReport(
        "distributed decode: 1 rank vs %d ranks (tensor parallel, ring over loopback)" % args.ranks,
        ["ranks", "context", "decode tok/s", "median ms/token", "TTFT ms", "cache/rank", "cache total",
         "per-rank bytes"],
    )
    with tempfile.TemporaryDirectory(prefix="chatapp-dist-bench-") as tmp:
        work = Path(tmp)
        model = args.model or str(build_bench_model(work))
        report.meta.update({
            "model": args.model or "random Llama: 4 layers, hidden 1024, 16 heads / 8 KV heads of 64, MLP 2816, "
                                   "float32, byte tokenizer",
            "decode_tokens": args.decode_tokens,
            "repeats": max(1, args.repeats),
            "cache_mode": args.cache_mode,
            "cpus": os.cpu_count(),
            "blas_threads_per_rank": f"all for 1 rank; {max(1, (os.cpu_count() or 1) // args.ranks)} for each of "
                                     f"{args.ranks} ranks (OPENBLAS_NUM_THREADS)",
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?",
        })
        results: dict[int, list[tuple[int, float]]] = {1: [], args.ranks: []}
        for context in contexts:
            runs: dict[int, list[dict]] = {1: [], args.ranks: []}
            for _ in range(max(1, args.repeats)):
                for ranks in (1, args.ranks):  # interleaved, so a slow spell of the machine hits both
                    t0 = time.perf_counter()
                    row = run_point(model, context, args.decode_tokens, ranks, args.cache_mode, work, args.timeout)
                    row["wall"] = time.perf_counter() - t0
                    runs[ranks].append(row)
            held = {}
            for ranks, rows in runs.items():
                row = rows[-1]
                per_rank = row.get("per_rank_bytes") or [row["cache"]["bytes_held"]]
                tps = statistics.median(r["decode_tps"] for r in rows)
                ttft = statistics.median(r["ttft"] for r in rows)
                steps = [st["ms"] for r in rows for st in r.get("steps") or []]
                step_ms = statistics.median(steps) if steps else (1000.0 / tps if tps else 0.0)
                held[ranks] = per_rank
                report.add(ranks, row["prompt_tokens"], tps, step_ms, ttft * 1000.0,
                           _mib(per_rank[0]), _mib(sum(per_rank)), "/".join(str(b) for b in per_rank))
                report.meta[f"decode_tps_runs_{ranks}r_{context}"] = ", ".join(f"{r['decode_tps']:.1f}" for r in rows)
                results[ranks].append((row["prompt_tokens"], tps))
            one, many = held[1][0], max(held[args.ranks])
            report.meta[f"per_rank_cache_saving_{context}"] = (
                f"{100.0 * (1 - many / one):.0f}% ({_mib(one)} on one rank -> {_mib(many)} per rank)" if one else "n/a")
    report.meta["results"] = {str(k): v for k, v in results.items()}

    def plot(path):
        line_plot(path, "decode speed, 1 rank vs %d ranks" % args.ranks, "context (tokens)", "decode tok/s",
                  {f"{k} rank{'s' if k > 1 else ''}": ([c for c, _ in v], [t for _, t in v])
                   for k, v in results.items()})

    emit(report, args.json, plot, args.plot)
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"
