"""`chatapp bench NAME`: benchmarks that print a table, write JSON and draw a plot.

Each benchmark module exposes `add_arguments(parser)` and `run(args) -> int`; register it in
BENCHES below. Performance claims live here, never in timed unit tests.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from chatapp.errors import SetupError
from chatapp.model.modelfiles import ModelLoadError  # MLX-free: safe before the BLAS preload

BENCHES = {
    "cache": "chatapp.bench.cache_bench",
    "turns": "chatapp.bench.turns_bench",
    "decode": "chatapp.bench.decode_bench",
    "quality": "chatapp.bench.quality_bench",
    "cpu": "chatapp.bench.cpu_bench",
    "resume": "chatapp.bench.resume_bench",
    "prefix": "chatapp.bench.prefix_bench",
    "start": "chatapp.bench.start_bench",
    "distributed": "chatapp.bench.distributed_bench",
    "numerics": "chatapp.bench.numerics_bench",
    "recall": "chatapp.bench.recall_bench",
    "long": "chatapp.bench.long_bench",
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="chatapp bench", description="chatapp benchmarks")
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    modules = {}
    for name, modname in BENCHES.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            continue  # not built yet
        modules[name] = mod
        p = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        p.add_argument("--json", metavar="FILE", help="write results as JSON")
        p.add_argument("--plot", metavar="FILE", help="draw a PNG plot")
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return modules[args.bench].run(args)
    except (ModelLoadError, SetupError) as e:  # a model that does not load is one line, as in the app (exit 2)
        print(f"chatapp bench {args.bench}: error: {e}", file=sys.stderr)
        return 2
