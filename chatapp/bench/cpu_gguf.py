"""`chatapp bench cpu --model FILE.gguf`: chatapp and llama.cpp on the same GGUF file.

Each peer runs in a process of its own (cpu_gguf_peer.py) and loads the file itself: chatapp
through the app's own GGUF loader and CPU plan (``engine.setup.load_engine``), llama.cpp through
llama-cpp-python when ``llama_cpp`` is importable (``pip install llama-cpp-python``; never a
runtime dependency). Same thread count for both. ``--repeats`` rounds, the peers alternating
(A B, B A, ...), so both see the same phases of a shared machine; each value in the table is
the best of a peer's runs, and the ratio column compares those bests from the same run.

Measured per peer: load time, time to first token of a first turn (``--user`` after
``--system``, rendered with the file's chat template: ~30 tokens), prefill tok/s of
``--prompt`` tokens and decode tok/s of ``--decode-tokens`` after 0, 1,024 and 4,096 cached
tokens (``--cached``; the history is a real prefill of the KJV text in chatapp/bench/texts),
and peak RSS (``ru_maxrss``) after all of it.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

from chatapp.bench.report import BenchReport, emit

TEXT = Path(__file__).resolve().parent / "texts" / "kjv-ruth-esther.txt"
SYSTEM = "You are a helpful assistant."
USER = "Name three rivers of France and say which is longest."
# chatapp-append: the fused step's K/V rows through update_and_fetch (the route before the
# in-place writes), a same-run baseline
GGUF_PEERS = ("chatapp", "chatapp-fast", "chatapp-append", "llama.cpp")


def add_model_arguments(p) -> None:
    g = p.add_argument_group("--model FILE.gguf")
    g.add_argument("--model", metavar="FILE.gguf",
                   help="run chatapp and llama.cpp on this GGUF file (peers: --peers; threads: --threads)")
    g.add_argument("--cached", default="0,1024,4096",
                   help="history lengths before the timed prefill and decode (default 0,1024,4096)")
    g.add_argument("--ttft-runs", type=int, default=5, help="first turns per peer run (default 5; median kept)")
    g.add_argument("--system", default=SYSTEM, help="system message of the first turn")
    g.add_argument("--user", default=USER, help="user message of the first turn")


def _ids(path: str, system: str, user: str) -> tuple[list[int], list[int]]:
    """(the first turn rendered and tokenised as chatapp does, the text's token ids), from the
    file's header only (no weights)."""
    from chatapp.model.gguf import open_gguf
    from chatapp.model.gguf_tokenizer import build_tokenizer
    from chatapp.prompt.conversation import Conversation
    from chatapp.prompt.formats import PromptFormat

    tok = build_tokenizer(open_gguf(path), Path(path).name)
    conv = Conversation.start(system)
    conv.add("user", user)
    turn = PromptFormat.for_tokenizer(tok).tokens(conv)
    text = tok.encode(TEXT.read_text(), add_special_tokens=False)
    return turn, text


def run_gguf(args) -> int:
    from chatapp.bench.common import loadavg
    from chatapp.bench.cpu_flagship import run_peer
    from chatapp.model.gguf_file import GGUFError

    log = lambda s: print(s, flush=True)  # noqa: E731
    path = Path(args.model).expanduser()
    if not path.is_file():
        raise SystemExit(f"--model: no file at {path}")
    try:
        turn, text = _ids(str(path), args.system, args.user)
    except GGUFError as e:
        raise SystemExit(f"--model: {e}") from None
    cached = sorted({int(c) for c in str(args.cached).split(",") if c.strip()})
    if not cached or cached[0] < 0 or args.prompt < 2 or args.decode_tokens < 2:
        raise SystemExit("--cached needs lengths >= 0, --prompt and --decode-tokens >= 2")
    if max(cached) + args.prompt > len(text):
        raise SystemExit(f"--cached + --prompt: the text has {len(text)} tokens")
    asked = [p.strip() for p in args.peers.split(",") if p.strip()]
    peers = [p for p in asked if p in GGUF_PEERS]
    if set(asked) - set(peers):
        log(f"# --model runs {', '.join(GGUF_PEERS)}; skipped: {', '.join(sorted(set(asked) - set(peers)))}")
    if "llama.cpp" in peers and importlib.util.find_spec("llama_cpp") is None:
        log("# llama.cpp: llama_cpp is not importable (pip install llama-cpp-python); skipped")
        peers.remove("llama.cpp")
    spec = {"model": str(path), "threads": args.threads, "system": args.system, "user": args.user,
            "turn_ids": turn, "ttft_runs": max(1, args.ttft_runs), "text_ids": text[: max(cached) + args.prompt],
            "cached": cached, "prompt": args.prompt, "decode": args.decode_tokens}
    load_start = loadavg()
    log(f"# {path.name}: first turn {len(turn)} tokens; load average {load_start}")
    with open(path, "rb") as fh:  # both peers find the file in the page cache
        while fh.read(1 << 24):
            pass
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for r in range(max(1, args.repeats)):
        for peer in peers if r % 2 == 0 else peers[::-1]:
            runs[peer].append(run_peer(peer, spec, log, module="chatapp.bench.cpu_gguf_peer", describe=summary))
    for peer in peers:
        if peer.startswith("chatapp") and runs[peer][0].get("turn_ids") != turn:
            log(f"# WARNING: {peer} rendered the first turn differently from the ids llama.cpp was given")
    return _report(args, path, runs, len(turn), load_start)


def summary(res: dict) -> str:
    """One line of a finished run, for the orchestrator's log."""
    pts = ", ".join(f"{p['cached']}: {p['prefill_tok_s']:.0f}/{p['decode_tok_s']:.0f}" for p in res["points"])
    return (f"load {res['load_s']:.2f} s, TTFT {statistics.median(res['ttft_ms']):.0f} ms, "
            f"prefill/decode tok/s at cached {pts}")


def _best(runs: list[dict]) -> dict:
    """Each measure's best over a peer's runs (highest rate, lowest time and RSS)."""
    pts = {}
    for r in runs:
        for p in r["points"]:
            b = pts.setdefault(p["cached"], dict(p))
            b["prefill_tok_s"] = max(b["prefill_tok_s"], p["prefill_tok_s"])
            b["decode_tok_s"] = max(b["decode_tok_s"], p["decode_tok_s"])
    return {"load_s": min(r["load_s"] for r in runs), "peak_rss": min(r["peak_rss"] for r in runs),
            "ttft_ms": min(statistics.median(r["ttft_ms"]) for r in runs), "points": pts}


def _report(args, path: Path, runs: dict, turn_tokens: int, load_start: str) -> int:
    from chatapp.bench.common import loadavg

    best = {p: _best(r) for p, r in runs.items() if r}
    ref = best.get("llama.cpp")
    rep = BenchReport(f"cpu: {path.name}, chatapp vs llama.cpp ({args.threads or 'all'} threads)",
                      ["peer", "measure", "value", "x llama.cpp"])

    def row(peer, measure, value, ref_value, higher_better=True):
        x = float("nan") if ref is None or peer == "llama.cpp" or not ref_value else (
            value / ref_value if higher_better else ref_value / value)
        rep.add(peer, measure, value, x)

    for peer, b in best.items():
        row(peer, "load s", b["load_s"], ref and ref["load_s"], higher_better=False)
        row(peer, f"TTFT ms ({turn_tokens}-token first turn)", b["ttft_ms"], ref and ref["ttft_ms"],
            higher_better=False)
        for n, p in sorted(b["points"].items()):
            rp = ref["points"].get(n) if ref else None
            row(peer, f"prefill tok/s ({args.prompt} after {n})", p["prefill_tok_s"], rp and rp["prefill_tok_s"])
            row(peer, f"decode tok/s (after {n + args.prompt})", p["decode_tok_s"], rp and rp["decode_tok_s"])
        row(peer, "peak RSS MiB", b["peak_rss"] / 2**20, ref and ref["peak_rss"] / 2**20, higher_better=False)
    end = loadavg()
    print(f"# x llama.cpp > 1: chatapp better (rates: ratio; times and RSS: llama.cpp / chatapp); best of "
          f"{args.repeats} alternating runs per peer; load average {load_start} at the start, {end} at the end")
    rep.meta.update(runs=runs, load_average_start=load_start, load_average_end=end, threads=args.threads,
                    prompt=args.prompt, decode_tokens=args.decode_tokens, repeats=args.repeats, model=str(path))
    emit(rep, args.json, None, None)
    return 0
