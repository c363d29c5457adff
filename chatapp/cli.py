"""The command line: `chatapp` (TUI), `chatapp --no-tui` (scriptable), `chatapp bench NAME`.

Nothing here imports MLX at module level: an optimised BLAS must be loaded into the process
before ``mlx.core`` is (see chatapp/backend/blas.py), so the CLI reads its settings first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, TextIO

from .config import ConfigError, load_config

CACHE_MODES = ["auto", "concat", "prealloc", "quantized", "window", "window-quant"]

# flag dest -> dotted config key
FLAG_KEYS = {
    "model": "model.id",
    "dtype": "model.dtype",
    "system": "chat.system",
    "raw": "chat.raw",
    "temp": "sampling.temp",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "max_tokens": "sampling.max_tokens",
    "seed": "sampling.seed",
    "cache_mode": "cache.mode",
    "window": "cache.window",
    "sinks": "cache.sinks",
    "kv_bits": "cache.kv_bits",
    "kv_group_size": "cache.kv_group_size",
    "max_kv_tokens": "cache.max_kv_tokens",
    "chunk_size": "cache.chunk_size",
    "evict_chunk": "cache.evict_chunk",
    "quant_start": "cache.quant_start",
    "long_after": "cache.long_after",
    "blas": "cpu.blas",
    "dense_weights": "cpu.dense_weights",
    "data_dir": "data.dir",
}


class UserError(Exception):
    """A mistake the user can fix; printed as one line, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chatapp",
        description="Chat with a local LLM on MLX; stays fast when the conversation gets long.",
        epilog="Benchmarks: chatapp bench {cache,turns,decode,quality,cpu} --help",
    )
    p.add_argument("--model", "-m", help="Hugging Face repo id or local folder (default from config)")
    p.add_argument("--config", metavar="FILE", help="a config.toml that overrides the user file")
    p.add_argument("--no-tui", action="store_true", help="no terminal UI: read stdin or -p, write replies to stdout")
    p.add_argument("-p", "--prompt", help="one turn with this text (with --no-tui)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--raw", action="store_true", default=None, help="send text with no chat template at all")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--seed", type=int, help="-1 for random")
    c = p.add_argument_group("KV cache")
    c.add_argument("--cache-mode", choices=CACHE_MODES)
    c.add_argument("--window", type=int, help="recent tokens kept at full precision (window modes)")
    c.add_argument("--sinks", type=int, help="attention-sink tokens kept at the start (window modes)")
    c.add_argument("--kv-bits", type=int, help="4 or 8")
    c.add_argument("--kv-group-size", type=int, help="32, 64 or 128")
    c.add_argument("--max-kv-tokens", type=int, help="token budget of window-quant")
    c.add_argument("--chunk-size", type=int, help="preallocation step (multiple of 256)")
    c.add_argument("--evict-chunk", type=int, help="tokens evicted or quantised at a time")
    c.add_argument("--quant-start", type=int, help="quantized mode: full precision until this many tokens")
    c.add_argument("--long-after", type=int, help="auto mode: switch to the long-history policy after this many tokens")
    o = p.add_argument_group("output")
    o.add_argument("--stats-json", metavar="FILE", help="append one JSON object per turn with every statistic")
    o.add_argument("--verbose", "-v", action="store_true", help="a short statistics line per turn on stderr")
    o.add_argument("--show-config", action="store_true", help="print the effective configuration and where each value came from")
    x = p.add_argument_group("CPU backend")
    x.add_argument("--blas", help="auto, off, or a path to a BLAS library exporting cblas_*")
    x.add_argument("--dense-weights", choices=["auto", "on", "off"])
    p.add_argument("--data-dir", help="where conversations and snapshots are stored")
    p.add_argument("--distributed", choices=["tensor", "pipeline"],
                   help="shard the model over the ranks of an `mlx.launch` job (detected automatically when launched)")
    return p


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bench":
            _preload_blas_from_env()
            from .bench import main as bench_main

            return bench_main(argv[1:])
        args = build_parser().parse_args(argv)
        config = load_config(args.config, overrides_from(args))
        if args.show_config:
            print(config.describe_text())
            return 0
        blas = _preload_blas(config.cpu.blas)
        if args.distributed or _launched_distributed():
            from .engine.distributed import run_distributed

            return run_distributed(args, config, blas)
        if args.no_tui or args.prompt is not None:
            return run_no_tui(args, config, blas)
        from .ui.app import run_tui

        return run_tui(config, blas=blas, verbose=args.verbose)
    except ConfigError as e:
        print(f"chatapp: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # SetupError (imported lazily: it pulls in MLX)
        if type(e).__name__ != "SetupError":
            raise
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chatapp: interrupted", file=sys.stderr)
        return 130


def _launched_distributed() -> bool:
    """True inside an `mlx.launch` job with more than one rank (read from its environment)."""
    try:
        from .engine.distributed import launched
    except ImportError:
        return False
    return launched()


def _preload_blas(setting: str):
    try:
        from .backend.blas import preload_blas
    except ImportError:  # pragma: no cover - backend package always ships
        return None
    return preload_blas(setting)


def _preload_blas_from_env():
    return _preload_blas(os.environ.get("CHATAPP_BLAS", "auto"))


def run_no_tui(args, config, blas) -> int:
    from .engine.generate import TokenEvent, TurnDone
    from .textsafe import printable

    if args.verbose and blas is not None:
        print(f"chatapp: BLAS: {blas.describe() if hasattr(blas, 'describe') else blas}", file=sys.stderr)
    from .engine.setup import load_engine, session_from_config

    loaded = load_engine(config)
    session = session_from_config(config, loaded)
    for note in session.notices:
        print(f"chatapp: note: {note}", file=sys.stderr)
    out = sys.stdout
    safe = printable if out.isatty() else (lambda s: s)
    stats_file: TextIO | None = open(args.stats_json, "a", encoding="utf-8") if args.stats_json else None

    interrupted = {"n": 0}

    def on_signal(signum, frame):
        interrupted["n"] += 1
        session.cancel()
        if interrupted["n"] > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def turn(text: str) -> bool:
        for ev in session.send(text):
            if isinstance(ev, TokenEvent) and ev.text:
                out.write(safe(ev.text))
                out.flush()
            elif isinstance(ev, TurnDone):
                out.write("\n")
                out.flush()
                if stats_file:
                    stats_file.write(json.dumps(ev.stats.to_json()) + "\n")
                    stats_file.flush()
                if args.verbose:
                    for n in ev.stats.notices:
                        print(f"chatapp: note: {n}", file=sys.stderr)
                    print(f"chatapp: {ev.stats.short()}", file=sys.stderr)
                return ev.stats.finish != "cancelled"
        return True

    try:
        if args.prompt is not None:
            if not args.prompt.strip():
                raise UserError("the prompt is empty")
            return 0 if turn(args.prompt) else 130
        first = True
        for line in sys.stdin:
            line = line.rstrip("\n")
            if not line.strip():
                continue  # empty and whitespace-only messages are ignored
            if not first:
                out.write("\n")
            first = False
            if not turn(line):
                return 130
        return 0
    finally:
        if stats_file:
            stats_file.close()
