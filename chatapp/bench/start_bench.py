"""Time from launch to the first reply: a first start on this CPU (kernels compiled) vs later ones.

Each run is the app itself in a process of its own, ``chatapp --no-tui -p "Hi" --max-tokens 1``,
timed from the launch to its exit (imports, model load, the CPU plan and its kernel warm-up, one
turn), with numba's disk cache (``NUMBA_CACHE_DIR``) pointed at:

- ``first start``: an empty folder, ``cpu.precompile = true`` (the app's default: the fused prefill
  kernel compiles in a second process meanwhile, backend/precompile.py);
- ``first start, one process``: an empty folder, ``cpu.precompile = false`` (as before stop 27);
- ``later start``: a folder a first run filled (untimed);
- ``later start to the input box`` and ``later start to the model ready``: the TUI itself (``chatapp -m
  MODEL``, headless) on that folder, from the launch to the chat screen painted with its input
  box focused (the model loads under it; messages typed meanwhile are queued), and to the model
  loaded and the session prepared: the app reports each and exits (ui/start_probe.py).

With llama-cpp-python importable, ``llama.cpp`` is the peer: a process that loads the same GGUF
and generates one token (it ships compiled: it has no first start). Variants alternate, the
order rotating each round; medians of ``--repeats``. ``--variants`` picks which runs are timed and
``--numba-cache`` which cache the later starts read (``inherit``: the environment's own, so a
``--variants "later start"`` run compiles nothing that was compiled before: the smoke test's way).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chatapp.bench.common import SMOLLM2_GGUF
from chatapp.bench.report import BenchReport, emit
from chatapp.ui import start_probe

TUI_VARIANTS = {"later start to the input box": "input", "later start to the model ready": "ready"}
VARIANTS = ("first start", "first start, one process", "later start", *TUI_VARIANTS)
_LLAMA = ("import sys\nfrom llama_cpp import Llama\n"
          "m = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)\n"
          "m.create_completion('Hi', max_tokens=1)\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(SMOLLM2_GGUF), help="a GGUF file or model folder (default SmolLM2 Q4_1)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per variant (default 2)")
    p.add_argument("--threads", type=int, default=0, help="kernel threads (0: one per core)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave the llama.cpp peer out")
    p.add_argument("--variants", type=_variants, default=list(VARIANTS),
                   help=f"comma list of the runs to time (default all: {', '.join(VARIANTS)})")
    p.add_argument("--numba-cache", metavar="DIR", default=None,
                   help="later starts use this numba cache ('inherit': this environment's own, NUMBA_CACHE_DIR "
                        "or numba's default beside the sources; default: a fresh one an untimed first run fills)")


def _variants(text: str) -> list[str]:
    """The comma list's variants; a name that holds a comma itself ("first start, one process")
    is one variant where its pieces stand together in the list."""
    pieces = [v.strip() for v in text.split(",") if v.strip()]
    out: list[str] = []
    while pieces:
        pair = ", ".join(pieces[:2])
        take = 2 if len(pieces) > 1 and pair in VARIANTS else 1
        out.append(pair if take == 2 else pieces[0])
        pieces = pieces[take:]
    bad = [v for v in out if v not in VARIANTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    return out


def _chatapp_run(args, tmp: Path, cache_dir: Path | None, precompile: bool) -> float:
    """One launch of the app to its exit; ``cache_dir`` None: the environment's own numba cache."""
    config = tmp / f"precompile-{precompile}.toml"
    config.write_text(f"[cpu]\nprecompile = {'true' if precompile else 'false'}\nthreads = {args.threads}\n")
    cmd = [sys.executable, "-m", "chatapp", "--no-tui", "--no-save", "--data-dir", str(tmp / "data"),
           "--config", str(config), "-m", args.model, "-p", "Hi", "--max-tokens", "1", "--temp", "0"]
    env = dict(os.environ) if cache_dir is None else dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"start bench: chatapp failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return seconds


def _tui_run(args, tmp: Path, cache_dir: Path | None, milestone: str) -> float:
    """One launch of the TUI to ``milestone`` (start_probe.MILESTONES), seconds as the app measured them."""
    config = tmp / "tui.toml"
    config.write_text(f"[cpu]\nthreads = {args.threads}\n")
    cmd = [sys.executable, "-m", "chatapp", "--no-save", "--data-dir", str(tmp / "data"), "--config", str(config),
           "-m", args.model]
    env = dict(os.environ, **{start_probe.ENV_AT: milestone, start_probe.ENV_T0: repr(time.time())})
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    for line in out.stderr.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == start_probe.LINE and parts[1] == milestone:
            return float(parts[2])
    raise SystemExit(f"start bench: the TUI never reached {milestone!r} ({out.returncode}): "
                     f"{out.stderr.strip()[-500:]}")


def _llama_run(args) -> float:
    threads = args.threads or os.cpu_count() or 1
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _LLAMA, args.model, str(threads)], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"start bench: llama.cpp failed: {out.stderr.strip()[-500:]}")
    return seconds


def run(args) -> int:
    if not Path(args.model).exists():
        raise SystemExit(f"start bench: no model at {args.model}")
    llama = not args.no_llama_cpp and importlib.util.find_spec("llama_cpp") is not None
    peers = list(args.variants) + (["llama.cpp"] if llama else [])
    times: dict[str, list[float]] = {p: [] for p in peers}
    with tempfile.TemporaryDirectory(prefix="chatapp-start-bench-") as name:
        tmp = Path(name)
        if args.numba_cache == "inherit":
            warm = None
        else:
            warm = Path(args.numba_cache) if args.numba_cache else tmp / "numba-warm"
        if any(p.startswith("later start") for p in peers):
            _chatapp_run(args, tmp, warm, precompile=True)  # fills the later starts' cache, untimed
        for r in range(args.repeats):
            order = peers[r % len(peers):] + peers[:r % len(peers)]
            for peer in order:
                if peer == "llama.cpp":
                    t = _llama_run(args)
                elif peer == "later start":
                    t = _chatapp_run(args, tmp, warm, precompile=True)
                elif peer in TUI_VARIANTS:
                    t = _tui_run(args, tmp, warm, TUI_VARIANTS[peer])
                else:
                    t = _chatapp_run(args, tmp, tmp / f"numba-cold-{r}-{len(times[peer])}-{peer[-7:]}",
                                     precompile=peer == "first start")
                times[peer].append(t)
                print(f"# round {r + 1}: {peer}: {t:.2f} s", flush=True)
    ref = "first start, one process" if "first start, one process" in peers else peers[0]
    base = statistics.median(times[ref])
    rep = BenchReport("start: launch to the first reply's exit (TUI rows: to the milestone), seconds (medians)",
                      ["run", "median s", "min s", f"x {ref}"])
    for peer in peers:
        med = statistics.median(times[peer])
        rep.add(peer, round(med, 2), round(min(times[peer]), 2), round(base / med, 2))
    rep.meta.update(model=args.model, repeats=args.repeats, threads=args.threads or os.cpu_count(),
                    cpus=os.cpu_count(), times=times,
                    method="each run its own process, launch to exit (imports, load, CPU plan and kernel "
                           "warm-up, one turn of 1 token); the TUI rows launch to the input box painted and focused, "
                           "or to the model ready, as the app reports them (ui/start_probe.py); NUMBA_CACHE_DIR "
                           "empty for first starts, filled for later ones; peers alternate, the order rotating "
                           "each round")
    emit(rep, args.json)
    return 0
