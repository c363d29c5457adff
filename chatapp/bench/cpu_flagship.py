"""`chatapp bench cpu --geometry llama2-7b`: the flagship's geometry against mlx-lm and llama.cpp.

What it runs. flagship.py writes (once; reused while the geometry and seed match) a random-weight
4-bit model with Llama-2-7B's full geometry in the early mlx-community layout, which
chatapp's own loader reads. Each peer then runs in a process of its own (cpu_peer.py), so each
load time and peak RSS is its own:

- chatapp: ``load_model`` + ``apply_fast_path`` (the kernels); a ``--short``-token prompt decoded
  greedily for ``--greedy`` tokens (the equality check); the ``--prompt``-token prompt then
  ``--decode`` tokens (prefill and decode speed); then, for each ``--modes`` x ``--contexts``,
  caches filled with synthetic K/V and ``--long-tokens`` decoded (decode after N cached tokens).
- mlx-lm: ``mlx_lm.stream_generate`` on the same weights (read into mlx-lm's Llama, float32 like
  MLX's fastest CPU configuration). It prefills ~0.15 tokens/s, so it runs the ``--short``
  prompt only (its prefill costs the same per token at any length) and its long-context points
  on the same synthetic fill.
- llama.cpp, when ``llama_cpp`` (llama-cpp-python) is importable: the same weights as a Q4_0
  GGUF (gguf.py), the ``--prompt`` prompt and ``--decode`` tokens.

Load time (target: at most 2x mlx-lm's) comes from ``--load-rounds`` load-only runs of chatapp
and mlx-lm, alternating, after one read of the weight files (so neither finds a colder page cache
than the other). The physical limit is printed next to the result: bytes of weights a decoded token reads
divided by the read bandwidth this machine showed (chatapp.kernels.bandwidth, same threads), the
median of readings before the first peer run and after every one (each chatapp peer its own bytes).
chatapp and llama.cpp run ``--repeats`` times, alternating; the best rate of each is kept.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chatapp.bench.flagship import LLAMA2_7B
from chatapp.bench.report import BenchReport, emit

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO / "bench-out" / "llama2-7b-random"
TOKENIZER = REPO.parent / "shared" / "models" / "llama2-tokenizer" / "tokenizer.model"
PROMPT_TEXT = (
    "You are a helpful assistant. The user is planning a long trip through the mountains and asks about "
    "packing, weather, food, maps, safety and how to keep in touch with family while away from the cities. "
)

GEOMETRY = LLAMA2_7B  # tests swap in a small one
TARGET_DECODE = 1.5  # tokens/s, at 256 and 4096 cached tokens
TARGET_DECODE_X = 10.0  # x mlx-lm
TARGET_PREFILL_X = 15.0
TARGET_RSS_X = 1.3  # peak RSS / weight files
TARGET_LOAD_X = 2.0


def add_flagship_arguments(p) -> None:
    g = p.add_argument_group("--geometry llama2-7b")
    g.add_argument("--model-dir", default=str(DEFAULT_DIR),
                   help="where the random model is written (default bench-out/)")
    g.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    g.add_argument("--short", type=int, default=32,
                   help="prompt tokens of the greedy check, mlx-lm's prompt (default 32)")
    g.add_argument("--greedy", type=int, default=16, help="greedy tokens compared with mlx-lm (default 16)")
    g.add_argument("--contexts", default="2048,4096",
                   help="cached tokens for the long-context decode (default 2048,4096; '': none, for a "
                   "prefill-only run)")
    g.add_argument("--modes", default="prealloc,window-quant", help="chatapp cache modes at long context")
    g.add_argument("--long-tokens", type=int, default=8, help="tokens decoded per long-context point (default 8)")
    g.add_argument("--peers", default="chatapp,mlx-lm,llama.cpp",
                   help="which peers run (default all available; also chatapp-unfused: cpu.fused_decode = false; "
                   "chatapp-fast: cpu.numerics = fast; chatapp-gguf, chatapp-gguf-fast: chatapp on the Q4_0 GGUF "
                   "llama.cpp reads)")
    g.add_argument("--threads", type=int, default=0, help="threads for chatapp's kernels and llama.cpp (0: all cores)")
    g.add_argument("--load-rounds", type=int, default=3, help="interleaved load-only runs per peer (default 3)")
    g.add_argument("--flagship-layers", type=int, default=0,
                   help="decoder layers (0: the geometry's 32); fewer keep the 7B width at a fraction of the time "
                   "and disk")


def _geometry(args):
    """The flagship geometry, with ``--flagship-layers`` decoder layers when given (same width)."""
    from dataclasses import replace

    if args.flagship_layers < 0:
        raise SystemExit("--flagship-layers must be >= 0")
    return replace(GEOMETRY, n_layers=args.flagship_layers) if args.flagship_layers else GEOMETRY


def _prompt_ids(n: int) -> list[int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    ids = [1]
    while len(ids) < n:
        ids += sp.encode(PROMPT_TEXT)
    return ids[:n]


def run_peer(peer: str, spec: dict, log, module: str = "chatapp.bench.cpu_peer", describe=None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", module, peer, f.name], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if out.returncode != 0:
            raise RuntimeError(f"{peer} failed: "
                               f"{out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        rates = "" if spec.get("load_only") else (
            f" ({describe(res)})" if describe else
            f" (decode {res.get('decode_tok_s', 0):.2f} tok/s, prefill {res.get('prefill_tok_s', 0):.1f} tok/s)")
        log(f"# {peer}{' (load only)' if spec.get('load_only') else ''}: "
            f"done in {time.perf_counter() - t:.0f} s{rates}")
        return res
    finally:
        os.unlink(f.name)


def _best(runs: list[dict]) -> dict:
    """The run with the best decode rate, with the best prefill of all runs (same machine phases)."""
    best = dict(max(runs, key=lambda r: r.get("decode_tok_s", 0)))
    best["prefill_tok_s"] = max(r.get("prefill_tok_s", 0) for r in runs)
    best["load_s"] = min(r["load_s"] for r in runs)
    return best


def run_flagship(args) -> int:
    from chatapp.bench.common import loadavg
    from chatapp.bench.flagship import weight_file_bytes, write_llama2_7b
    from chatapp.kernels.bandwidth import read_bandwidth

    log = lambda s: print(s, flush=True)  # noqa: E731
    load_start = loadavg()
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    geometry = _geometry(args)
    folder = Path(args.model_dir)
    if args.flagship_layers and args.model_dir == str(DEFAULT_DIR):
        folder = folder.with_name(f"{folder.name}-{geometry.n_layers}l")
    t = time.perf_counter()
    write_llama2_7b(folder, TOKENIZER, geometry)
    log(f"# model: {folder} ({weight_file_bytes(folder) / 2**30:.2f} GiB of weights; "
        f"ready in {time.perf_counter() - t:.0f} s)")
    import importlib.util

    gguf = None
    if any(p == "llama.cpp" or p.startswith("chatapp-gguf") for p in peers):
        if "llama.cpp" in peers and importlib.util.find_spec("llama_cpp") is None:
            log("# llama.cpp: llama_cpp is not importable (pip install llama-cpp-python); skipped")
            peers.remove("llama.cpp")
        if any(p == "llama.cpp" or p.startswith("chatapp-gguf") for p in peers):
            from chatapp.bench.gguf import write_gguf_q4_0

            gguf = folder / "model-q4_0.gguf"
            if not gguf.exists() or gguf.stat().st_mtime < (folder / "weights.npz").stat().st_mtime:
                write_gguf_q4_0(gguf, geometry, TOKENIZER)
    contexts = [int(c) for c in str(args.contexts).split(",") if c.strip()]
    spec = {
        "model": str(folder), "gguf": str(gguf) if gguf else None, "prompt": _prompt_ids(args.prompt),
        "short": args.short, "greedy": args.greedy, "decode": args.decode_tokens, "contexts": contexts,
        "modes": [m.strip() for m in args.modes.split(",") if m.strip()], "long_tokens": args.long_tokens,
        "seed": args.seed, "threads": args.threads,
    }
    # read again after every peer run: on a shared host it moves +-20% within minutes, and the
    # physical-limit line is only as good as the readings around the runs it divides
    readings = [read_bandwidth(1.0)]
    log(f"# read bandwidth: {readings[0] / 1e9:.1f} GB/s (chatapp's kernel threads)")
    loads = _load_times(folder, spec, [p for p in peers if p in ("chatapp", "mlx-lm")], args.load_rounds, log)

    results: dict[str, list[dict]] = {p: [] for p in peers}
    for r in range(max(1, args.repeats)):
        order = peers if r % 2 == 0 else peers[::-1]
        for peer in order:
            if peer == "mlx-lm" and results[peer]:
                continue  # ~10 minutes a run: once is enough for a 10x comparison
            results[peer].append(run_peer(peer, spec, log))
            readings.append(read_bandwidth(1.0))
    log("# read bandwidth after each run: " + ", ".join(f"{b / 1e9:.1f}" for b in readings[1:]) + " GB/s")
    best = {p: _best(runs) for p, runs in results.items() if runs}
    for peer, seconds in loads.items():  # the dedicated, interleaved load runs, page cache warm
        if seconds:
            best[peer]["load_s"] = min(seconds)
    return _report(args, best, results, readings, weight_file_bytes(folder), load_start)


def _load_times(folder: Path, spec: dict, peers: list[str], rounds: int, log) -> dict[str, list[float]]:
    """Load-only runs of each peer, alternating, after one read of the weight files so that
    every run finds them in the page cache (a generation run's load depends on what the
    previous peer left cached: 7-32 s for the same folder)."""
    for f in folder.glob("*.npz"):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    out: dict[str, list[float]] = {p: [] for p in peers}
    for r in range(rounds):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            out[peer].append(run_peer(peer, {**spec, "load_only": True}, log)["load_s"])
    if out:
        log("# load s (load only, page cache warm): " + "; ".join(
            f"{p} " + ", ".join(f"{s:.1f}" for s in v) for p, v in out.items()))
    return out


def _report(args, best: dict, results: dict, readings: list[float], file_bytes: int, load_start: str) -> int:
    from chatapp.bench.common import loadavg

    ref = best.get("mlx-lm")
    rep = BenchReport(
        "cpu: Llama-2-7B geometry (random 4-bit weights, early mlx-community layout)",
        ["peer", "load s", "peak RSS / files", "prefill tok/s", "prefill x", "decode tok/s", "decode x",
         "greedy = mlx-lm", "greedy = chatapp-unfused", "greedy = chatapp"],
    )
    unfused = best.get("chatapp-unfused")
    exact = best.get("chatapp")
    for peer, r in best.items():
        same = "-" if ref is None or peer == "mlx-lm" else (
            "yes" if r["greedy"][: args.greedy] == ref["greedy"][: args.greedy]
            else _first_diff(r["greedy"], ref["greedy"]))
        same_unfused = "-" if unfused is None or peer == "chatapp-unfused" else (
            "yes" if r["greedy"] == unfused["greedy"] else _first_diff(r["greedy"], unfused["greedy"]))
        same_exact = "-" if exact is None or peer == "chatapp" else (
            "yes" if r["greedy"] == exact["greedy"] else _first_diff(r["greedy"], exact["greedy"]))
        rep.add(peer, r["load_s"], r["peak_rss"] / file_bytes, r["prefill_tok_s"],
                r["prefill_tok_s"] / ref["prefill_tok_s"] if ref else float("nan"), r["decode_tok_s"],
                r["decode_tok_s"] / ref["decode_tok_s"] if ref else float("nan"), same, same_unfused, same_exact)
    long = BenchReport("cpu: decode after N cached tokens (synthetic K/V), Llama-2-7B geometry",
                       ["peer / mode", "cached", "held", "decode tok/s", "x mlx-lm"])
    ref_long = {p["context"]: p["decode_tok_s"] for p in (ref or {}).get("long", [])}
    for peer, r in best.items():
        for p in r.get("long", []):
            name = peer if peer == "mlx-lm" else f"{peer} {p['mode']}"
            x = (p["decode_tok_s"] / ref_long[p["context"]] if p["context"] in ref_long and peer != "mlx-lm"
                 else float("nan"))
            long.add(name, p["context"], p["held"], p["decode_tok_s"], x)
    print(rep.table())
    print()
    print(long.table())
    c = best.get("chatapp")
    lines = _limits(args, best, readings)
    if c:
        lines += _targets(args, c, ref, best, file_bytes)
    lines += _against_llama_cpp(args, best)
    for line in lines:
        print(f"# {line}")
    rep.meta.update(
        long={"columns": long.columns, "rows": long.rows}, runs=results, bandwidth=statistics.median(readings),
        bandwidth_readings=readings,
        weight_file_bytes=file_bytes, summary=lines, load_average_start=load_start, load_average_end=loadavg(),
        prompt=args.prompt, short=args.short, decode_tokens=args.decode_tokens, repeats=args.repeats,
    )
    emit(rep, args.json, None, None)
    return 0


def _limits(args, best: dict, readings: list[float]) -> list[str]:
    """Each chatapp peer's decode against its physical limit: the weight bytes its token reads
    over the median read bandwidth of the run (and the range the readings span)."""
    bw = statistics.median(readings)
    out = []
    for peer, r in best.items():
        per_token = r.get("weight_bytes_per_token")
        if not peer.startswith("chatapp") or not per_token:
            continue
        def reached(bandwidth: float) -> str:  # decode's share of the limit at that bandwidth
            return f"{r['decode_tok_s'] * per_token / bandwidth:.0%}"

        lo, hi = min(readings), max(readings)
        out.append(f"physical limit, {peer}: {per_token / 1e9:.2f} GB of weights per token / {bw / 1e9:.1f} GB/s "
                   f"(median of {len(readings)} readings, {lo / 1e9:.1f}-{hi / 1e9:.1f}) "
                   f"= {bw / per_token:.2f} tokens/s; reached {reached(bw)} ({reached(hi)}-{reached(lo)}) "
                   f"at {args.prompt} tokens")
    return out


def _against_llama_cpp(args, best: dict) -> list[str]:
    """Each chatapp peer's rates as ratios of llama.cpp's (best runs of the same bench)."""
    ll = best.get("llama.cpp")
    if not ll:
        return []
    ll_long = {p["context"]: p["decode_tok_s"] for p in ll.get("long", [])}
    out = []
    for peer, r in best.items():
        if not peer.startswith("chatapp"):
            continue
        parts = [f"decode at {args.prompt} {r['decode_tok_s'] / ll['decode_tok_s']:.2f}x",
                 f"prefill {args.prompt} {r['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x"]
        parts += [f"decode at {p['context']} cached ({p['mode']}) {p['decode_tok_s'] / ll_long[p['context']]:.2f}x"
                  for p in r.get("long", []) if p["context"] in ll_long]
        out.append(f"{peer} / llama.cpp: " + ", ".join(parts))
    return out


def _first_diff(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"no (from token {i})"


def _targets(args, c: dict, ref: dict | None, best: dict, file_bytes: int) -> list[str]:
    out = []

    def check(ok: bool, text: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL'}: {text}")

    at = {(p["mode"], p["context"]): p["decode_tok_s"] for p in c.get("long", [])}
    top = max((p["context"] for p in c.get("long", [])), default=None)
    check(c["decode_tok_s"] >= TARGET_DECODE,
          f"decode at {args.prompt} tokens {c['decode_tok_s']:.2f} tok/s >= {TARGET_DECODE}")
    if top is not None and ("prealloc", top) in at:
        check(at[("prealloc", top)] >= TARGET_DECODE,
              f"decode at {top} cached (prealloc) {at[('prealloc', top)]:.2f} tok/s >= {TARGET_DECODE}")
    if ref:
        x = c["decode_tok_s"] / ref["decode_tok_s"]
        check(x >= TARGET_DECODE_X, f"decode {x:.1f}x mlx-lm >= {TARGET_DECODE_X:.0f}x")
        ref_top = {p["context"]: p["decode_tok_s"] for p in ref.get("long", [])}.get(top)
        if ref_top and ("prealloc", top) in at:
            x = at[("prealloc", top)] / ref_top
            check(x >= TARGET_DECODE_X, f"decode at {top} cached {x:.1f}x mlx-lm >= {TARGET_DECODE_X:.0f}x")
        x = c["prefill_tok_s"] / ref["prefill_tok_s"]
        check(x >= TARGET_PREFILL_X, f"prefill {x:.1f}x mlx-lm >= {TARGET_PREFILL_X:.0f}x")
        same = c["greedy"][: args.greedy] == ref["greedy"][: args.greedy]
        check(same, f"greedy tokens equal to mlx-lm's on the first {args.greedy}")
        x = c["load_s"] / ref["load_s"]
        check(x <= TARGET_LOAD_X,
              f"load {c['load_s']:.1f} s = {x:.2f}x mlx-lm's read of the same folder <= {TARGET_LOAD_X}x")
    x = c["peak_rss"] / file_bytes
    check(x <= TARGET_RSS_X, f"peak RSS {c['peak_rss'] / 2**30:.2f} GiB = {x:.2f}x the weight files <= {TARGET_RSS_X}x")
    return out
