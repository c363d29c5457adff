"""Shared output for benchmarks: an aligned table on stdout, JSON, and a PNG plot."""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass
class BenchReport:
    """A benchmark's results: rows of named columns plus free-form metadata."""

    name: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(f"row has {len(values)} values, table has {len(self.columns)} columns")
        self.rows.append(list(values))

    def table(self) -> str:
        cells = [self.columns] + [[_fmt(v) for v in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = []
        for n, r in enumerate(cells):
            lines.append(" | ".join(c.rjust(w) for c, w in zip(r, widths)))
            if n == 0:
                lines.append("-+-".join("-" * w for w in widths))
        return "\n".join(lines)

    def markdown(self) -> str:
        out = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        out += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in self.rows]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "bench": self.name,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "columns": self.columns,
            "rows": self.rows,
            "meta": self.meta,
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, default=str) + "\n")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.4f}"
    return str(v)


def line_plot(
    path: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    logx: bool = False,
    logy: bool = False,
) -> None:
    """Draw named (x, y) series into a PNG. matplotlib is imported lazily (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def emit(report: BenchReport, json_path: str | None, plot: callable | None = None,
         plot_path: str | None = None) -> None:
    """Print the table, then write JSON and the plot when asked."""
    print(f"## {report.name}")
    for k, v in report.meta.items():
        if not isinstance(v, (dict, list)):
            print(f"# {k}: {v}")
    print(report.table())
    if json_path:
        report.write_json(json_path)
        print(f"# wrote {json_path}")
    if plot_path and plot is not None:
        plot(plot_path)
        print(f"# wrote {plot_path}")


# ---- argparse types shared by the benchmarks ----------------------------------------------------
def print_targets(targets: list[dict]) -> None:
    """The benches' closing lines: PASS / FAIL (INFO where ``passed`` is None) per target."""
    print()
    print("## targets")
    for t in targets:
        verdict = "INFO" if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        print(f"{verdict}  {t['target']}: {t['detail']}")


def int_list(text: str, minimum: int = 1) -> list[int]:
    """Comma-separated integers of at least ``minimum``, e.g. "512,1024"."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or any(x < minimum for x in out):
        what = "positive integers" if minimum == 1 else f"integers >= {minimum}"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return out


def mode_list(text: str) -> list[str]:
    """Comma-separated cache modes, e.g. "prealloc,window"."""
    from cache.settings import MODES

    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    return out


# ---- the cache flags of the benches that build CacheSettings from the command line ------------------
def _bench_knobs():
    """The number knobs of CacheSettings (cache.settings.KNOBS: the one declaration of each)."""
    from cache.settings import SETTINGS_KNOBS

    return tuple(k for k in SETTINGS_KNOBS if k.type is int)


def add_cache_arguments(p: argparse.ArgumentParser, **defaults: int) -> None:
    """A flag per number knob of CacheSettings (``--window --sinks --max-kv-tokens ...``, as the
    app's own flags), defaulting to the app's ``[cache]`` settings unless a bench passes its own
    (``max_kv_tokens=2048``); :func:`cache_knobs` reads them back."""
    for k in _bench_knobs():
        default = defaults.get(k.name, k.default)
        p.add_argument(k.option, dest=k.name, type=int, default=default,
                       help=f"{k.name} (default {default}): {k.flag_help}")


def cache_knobs(args) -> dict[str, int]:
    """The values of :func:`add_cache_arguments`'s flags, as CacheSettings keywords."""
    return {k.name: getattr(args, k.name) for k in _bench_knobs()}
