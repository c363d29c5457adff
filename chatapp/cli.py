"""The command line: `chatapp` (TUI), `chatapp --no-tui` (scriptable), `chatapp bench NAME`.

Nothing here imports MLX at module level: an optimised BLAS must be loaded into the process
before ``mlx.core`` is (see chatapp/backend/blas.py), so the CLI reads its settings first.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cache.settings import KNOBS

from .config import CHAT_FORMATS, DENSE_WEIGHT_MODES, KERNEL_MODES, ConfigError, load_config
from .errors import SetupError, UserError
from .sessions_cli import sessions_main
from .stdin_chat import run_no_tui

# flag dest -> dotted config key
FLAG_KEYS = {
    "model": "model.id",
    "dtype": "model.dtype",
    "system": "chat.system",
    "raw": "chat.raw",
    "chat_format": "chat.format",
    "chat_template": "chat.template",
    "temp": "sampling.temp",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "min_p": "sampling.min_p",
    "max_tokens": "sampling.max_tokens",
    "ignore_eos": "sampling.ignore_eos",
    "seed": "sampling.seed",
    **{knob.dest: knob.key for knob in KNOBS},  # --cache-mode, --window...: cache.mode, cache.window...
    "blas": "cpu.blas",
    "dense_weights": "cpu.dense_weights",
    "kernels": "cpu.kernels",
    "threads": "cpu.threads",
    "data_dir": "data.dir",
}


# Written out rather than read from chatapp.bench / chatapp.sessions_cli: the parser is built at
# every start, and importing those costs time (tests/test_default_model.py checks the lists match).
SESSION_COMMANDS = ("list", "search", "export", "rename", "delete", "prefixes")
BENCH_NAMES = ("cache", "turns", "decode", "quality", "cpu", "resume", "prefix", "start", "distributed",
               "numerics", "recall", "long")
COMMANDS_EPILOG = f"""commands:
  sessions    saved conversations and the shared-prefix KV store: chatapp sessions {{{','.join(SESSION_COMMANDS)}}}
  bench       benchmarks (tables, JSON, plots): chatapp bench {{{','.join(BENCH_NAMES)}}}

`chatapp sessions --help` and `chatapp bench --help` say more."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chatapp",
        usage="chatapp [options]\n       chatapp sessions COMMAND [options]\n       chatapp bench NAME [options]",
        description="Chat with a local LLM on MLX; stays fast when the conversation gets long.",
        epilog=COMMANDS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", "-m", help="Hugging Face repo id, local folder or .gguf file (default from config: "
                   "SmolLM2-135M-Instruct, 98 MB, downloaded on first use)")
    p.add_argument("--gguf-file", metavar="NAME",
                   help="the GGUF file to use from a repo or folder of several (same as --model REPO:NAME)")
    p.add_argument("--config", metavar="FILE", help="a config.toml that overrides the user file")
    p.add_argument("--no-tui", action="store_true", help="no terminal UI: read stdin or -p, write replies to stdout")
    p.add_argument("-p", "--prompt", help="one turn with this text (with --no-tui)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--raw", action="store_true", default=None, help="send text with no chat template at all")
    p.add_argument("--chat-format", metavar="NAME",
                   help=f"prompt format: {', '.join(CHAT_FORMATS)} (default auto: see README, Prompt formats)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template file to use instead")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--ignore-eos", action="store_true", default=None,
                   help="never sample end-of-sequence: generate max-tokens tokens (benchmarks, tests)")
    g.add_argument("--seed", type=int, help="-1 for random")
    _add_cache_flags(p.add_argument_group("KV cache"))
    o = p.add_argument_group("output")
    o.add_argument("--stats-json", metavar="FILE", help="append one JSON object per turn with every statistic")
    o.add_argument("--verbose", "-v", action="store_true", help="a short statistics line per turn on stderr")
    o.add_argument("--show-config", action="store_true",
                   help="print the effective configuration and where each value came from")
    x = p.add_argument_group("CPU backend")
    x.add_argument("--blas", help="auto, off, or a path to a BLAS library exporting cblas_*")
    x.add_argument("--dense-weights", choices=DENSE_WEIGHT_MODES)
    x.add_argument("--kernels", choices=KERNEL_MODES,
                   help="chatapp's CPU kernels on the packed weights (default auto)")
    x.add_argument("--threads", type=int, help="kernel threads (0: one per core)")
    p.add_argument("--data-dir", help="where conversations and snapshots are stored")
    p.add_argument("--resume", nargs="?", const="latest", metavar="ID",
                   help="continue a saved conversation (the latest when no ID): see `chatapp sessions list`")
    p.add_argument("--no-save", action="store_true", help="keep this conversation in memory only")
    p.add_argument("--distributed", choices=["tensor", "pipeline"],
                   help="shard the model over the ranks of an `mlx.launch` job (detected automatically when launched)")
    return p


def _add_cache_flags(group: argparse._ArgumentGroup) -> None:
    """A flag per cache knob (cache.settings.KNOBS), in their order. A text knob's flag takes its
    choices; a number's takes any integer, so a bad one is the config's one-line error, not usage."""
    for knob in KNOBS:
        if knob.type is str:
            group.add_argument(knob.option, choices=knob.choices, help=knob.flag_help)
        else:
            group.add_argument(knob.option, type=int, help=knob.flag_help)


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
        if argv and argv[0] == "sessions":
            return sessions_main(argv[1:])
        args = build_parser().parse_args(argv)
        config = load_config(args.config, overrides_from(args))
        if args.gguf_file:
            from .model.gguf_source import with_gguf_file

            config.model.id = with_gguf_file(config.model.id, args.gguf_file)
        if args.show_config:
            print(config.describe_text())
            _print_cpu_backend(config)
            print(f"# {describe_format(config)}")
            return 0
        if args.resume is not None:
            args.resume_id = _resume_target(args, config)
        blas = _preload_blas(config.cpu.blas)
        if args.distributed or _launched_distributed():
            from .distributed.job import run_distributed

            return run_distributed(args, config, blas)
        if args.no_tui or args.prompt is not None:
            return run_no_tui(args, config, blas)
        from .ui.app import run_tui

        return run_tui(config, blas=blas, verbose=args.verbose,
                       resume=getattr(args, "resume_id", None), save=not args.no_save)
    except ConfigError as e:
        print(f"chatapp: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except SetupError as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chatapp: interrupted", file=sys.stderr)
        return 130


def describe_format(config) -> str:
    """The prompt format the model would get and why, from its files when they are on disk
    (nothing is loaded or downloaded)."""
    from .model.hub import local_model_path
    from .prompt.choice import FormatRequest, RepoFacts, choose_format

    request = FormatRequest.from_config(config)
    spec = _default_model_file(config.model.id)
    gguf = _describe_gguf(spec)
    if gguf is not None:
        lines, facts = gguf
        return "\n# ".join(lines + [choose_format(request, facts).line()])
    found = local_model_path(spec)
    if found is None and request.format == "auto" and not request.template and not request.raw:
        return (f"prompt format: chosen when {spec} is downloaded (auto: its chat template, else what its id "
                "and files tell)")
    facts = RepoFacts.from_folder(found[1], found[0]) if found else RepoFacts(spec, {}, False, False)
    return choose_format(request, facts).line()


def _default_model_file(spec: str) -> str:
    """The default model's cached file for ``spec`` when it names that model and it is cached, else ``spec``."""
    from .model.default_model import cached_default_model, is_default_model

    found = cached_default_model() if is_default_model(spec) else None
    return str(found) if found is not None else spec


def _describe_gguf(spec: str):
    """(lines about the GGUF file, its RepoFacts) when ``spec`` names one on disk, else None; a file
    that cannot be used says why in its lines. Reads the header only: no MLX, no tensors."""
    from .model.gguf import config_from_header, describe, open_gguf
    from .model.gguf_file import GGUFError
    from .model.gguf_source import local_gguf
    from .prompt.choice import CHATML_TOKENS, RepoFacts

    path = local_gguf(spec)
    if path is None:
        return None
    try:
        header = open_gguf(path)
    except GGUFError as e:
        return [f"GGUF file: {path}: cannot be used: {e}"], RepoFacts(spec, {}, False, False)
    tokens = set(header.get("tokenizer.ggml.tokens") or [])
    facts = RepoFacts(spec, config_from_header(header), bool(header.get("tokenizer.chat_template")),
                      all(t in tokens for t in CHATML_TOKENS))
    return describe(header), facts


def _print_cpu_backend(config) -> None:
    """The CPU backend's detected BLAS, kernels and route rules (on Linux, where MLX runs on
    the CPU unless a GPU build is installed)."""
    if not sys.platform.startswith("linux"):
        return
    from .backend.describe import cpu_backend_lines

    print("# CPU backend (detected now; the model's own routes show with --verbose and in the TUI's notes)")
    for line in cpu_backend_lines(config.cpu):
        print(f"# {line}")


def _launched_distributed() -> bool:
    """True inside an `mlx.launch` job with more than one rank (read from its environment)."""
    try:
        from .distributed.launch import launched
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


def _resume_target(args, config) -> int:
    """The conversation --resume names; unless --model was given, continue with its model.

    Read before any model is loaded, writing nothing."""
    from .store import NotFound, StoreError, resolve_data_dir
    from .store.db import model_spec_of

    try:
        cid, spec = model_spec_of(resolve_data_dir(config), args.resume)
    except NotFound as e:
        raise UserError(str(e)) from None
    except StoreError as e:
        raise UserError(f"cannot resume: {e}") from None
    if spec and config.source("model.id") != "command line":
        config.model.id = spec
        config.sources["model.id"] = f"conversation {cid}"
    return cid
