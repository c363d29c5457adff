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

from .config import CACHE_MODES, CHAT_FORMATS, ConfigError, load_config


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
    "kernels": "cpu.kernels",
    "threads": "cpu.threads",
    "data_dir": "data.dir",
}


class UserError(Exception):
    """A mistake the user can fix; printed as one line, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chatapp",
        description="Chat with a local LLM on MLX; stays fast when the conversation gets long.",
        epilog="Saved conversations: chatapp sessions {list,export,rename,delete,prefixes} --help. "
        "Benchmarks: chatapp bench {cache,turns,decode,quality,cpu,resume,prefix} --help",
    )
    p.add_argument("--model", "-m", help="Hugging Face repo id, local folder or .gguf file (default from config)")
    p.add_argument("--gguf-file", metavar="NAME", help="the GGUF file to use from a repo or folder of several (same as --model REPO:NAME)")
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
    x.add_argument("--kernels", choices=["auto", "off"], help="chatapp's CPU kernels on the packed weights (default auto)")
    x.add_argument("--threads", type=int, help="kernel threads (0: one per core)")
    p.add_argument("--data-dir", help="where conversations and snapshots are stored")
    p.add_argument("--resume", nargs="?", const="latest", metavar="ID",
                   help="continue a saved conversation (the latest when no ID): see `chatapp sessions list`")
    p.add_argument("--no-save", action="store_true", help="keep this conversation in memory only")
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
        if argv and argv[0] == "sessions":
            return sessions_main(argv[1:])
        args = build_parser().parse_args(argv)
        config = load_config(args.config, overrides_from(args))
        if args.gguf_file:
            from .engine.gguf_source import with_gguf_file

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
            from .engine.distributed import run_distributed

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
    except Exception as e:  # SetupError (imported lazily: it pulls in MLX)
        if type(e).__name__ != "SetupError":
            raise
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("chatapp: interrupted", file=sys.stderr)
        return 130


def describe_format(config) -> str:
    """The prompt format the model would get and why, from its files when they are on disk
    (nothing is loaded or downloaded)."""
    from .engine.formatchoice import FormatRequest, RepoFacts, choose_format
    from .engine.hub import local_model_path

    request = FormatRequest.from_config(config)
    spec = config.model.id
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


def _describe_gguf(spec: str):
    """(lines about the GGUF file, its RepoFacts) when ``spec`` names one on disk, else None; a file
    that cannot be used says why in its lines. Reads the header only: no MLX, no tensors."""
    from .engine.formatchoice import CHATML_TOKENS, RepoFacts
    from .engine.gguf_source import local_gguf
    from .model.gguf import config_from_header, describe, open_gguf
    from .model.gguf_file import GGUFError

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


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - mlx-lm depends on transformers
        return
    hf_logging.set_verbosity_error()


def _print_notes(chat, printable) -> None:
    for n in chat.take_notes():
        print(f"chatapp: {n.level}: {printable(n.text)}", file=sys.stderr)


def run_no_tui(args, config, blas) -> int:
    """One turn per stdin line (or the -p prompt), every message saved (see docs/persistence.md).

    Exit status: 0; 2 for a refused or empty -p prompt; 1 when some stdin message was refused;
    130 after Ctrl-C (a Ctrl-C during a reply only stops that reply when reading stdin);
    143 after SIGTERM (the reply stops, is saved as interrupted, the snapshot is written).
    """
    from .engine.generate import TokenEvent, TurnDone
    from .store import read_lines, resolve_data_dir
    from .store.chat import ModelIdentity, open_chat
    from .textsafe import printable

    if args.prompt is not None and not args.prompt.strip():
        raise UserError("the prompt is empty")  # before anything is loaded or written
    if args.verbose and blas is not None:
        print(f"chatapp: {blas.describe() if hasattr(blas, 'describe') else blas}", file=sys.stderr)
    from .engine.setup import load_engine, session_from_config

    loaded = load_engine(config)
    _quiet_transformers()  # its "sequence longer than the model's maximum" warning: chatapp says it better
    session = session_from_config(config, loaded)
    if args.verbose and session.format_choice is not None:
        print(f"chatapp: {session.format_choice.line()}", file=sys.stderr)
    for note in session.notices:
        print(f"chatapp: note: {note}", file=sys.stderr)
    out = sys.stdout
    safe = printable if out.isatty() else (lambda s: s)
    err_safe = printable

    # Nothing is written to the data directory before the model has loaded: a bad model,
    # folder or network leaves no trace there.
    resume_id = getattr(args, "resume_id", None)
    chat = open_chat(session, ModelIdentity.from_loaded(loaded, config.model.id), resolve_data_dir(config),
                     save=not args.no_save, resume=resume_id, snapshot_cap_mb=config.data.snapshot_cap_mb,
                     prefix_cap_mb=config.data.prefix_cap_mb)
    _print_notes(chat, err_safe)
    info = chat.resume_info
    if info is not None and info.from_snapshot and args.verbose:
        print(f"chatapp: {info.line()}", file=sys.stderr)
    pending_resume = info.to_json() if info is not None else None

    stats_file: TextIO | None = None
    state = {"replying": False, "cancelled": False, "term": False}

    def on_signal(signum, frame):
        if signum == signal.SIGTERM:
            state["term"] = True
        if state["replying"] and not state["cancelled"]:
            state["cancelled"] = True
            session.cancel()  # the reply stops at the next token; it is kept, marked interrupted
            return
        raise KeyboardInterrupt

    def turn(text: str) -> str:
        """Returns "ok", "cancelled" or "refused"."""
        nonlocal pending_resume
        prepared = chat.prepare(text)
        for n in prepared.notes:
            print(f"chatapp: note: {err_safe(n)}", file=sys.stderr)
        if not prepared.send:
            print(f"chatapp: error: {prepared.refusal}", file=sys.stderr)
            return "refused"
        state["replying"], state["cancelled"] = True, False
        finish = "ok"
        try:
            for ev in chat.send(prepared.text):
                if isinstance(ev, TokenEvent) and ev.text:
                    out.write(safe(ev.text))
                    out.flush()
                elif isinstance(ev, TurnDone):
                    state["replying"] = False
                    out.write("\n")
                    out.flush()
                    if stats_file:
                        row = ev.stats.to_json()
                        row["conversation_id"] = chat.conversation_id
                        if pending_resume is not None:
                            row["resume"] = pending_resume
                        stats_file.write(json.dumps(row) + "\n")
                        stats_file.flush()
                    pending_resume = None
                    if args.verbose:
                        for n in ev.stats.notices:
                            print(f"chatapp: note: {n}", file=sys.stderr)
                        if ev.stats.prefix_tokens:
                            print(f"chatapp: {ev.stats.prefix_line()}", file=sys.stderr)
                        print(f"chatapp: {ev.stats.short()}", file=sys.stderr)
                    finish = "cancelled" if ev.stats.finish == "cancelled" else "ok"
                    break
        finally:
            state["replying"] = False
        _print_notes(chat, err_safe)
        chat.after_turn()  # idle now: the snapshot for --resume, the first turn's prompt for the prefix store
        _print_notes(chat, err_safe)
        return finish

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    try:
        stats_file = open(args.stats_json, "a", encoding="utf-8") if args.stats_json else None
        if args.prompt is not None:
            result = turn(args.prompt)
            if state["term"]:
                return 143
            return {"ok": 0, "cancelled": 130, "refused": 2}[result]
        from cache import CacheConfigError

        from .engine.distributed import CommandError, apply_command, parse_line, validate_command

        first, refused = True, False
        for line in read_lines(sys.stdin.buffer):
            # Lines starting with "/" are commands (/mode MODE [key=value...], /set key=value...,
            # /quit; "//text" sends "/text"); the same syntax drives distributed runs.
            try:
                cmd = parse_line(line)
                if cmd is None:
                    continue  # empty and whitespace-only messages are ignored
                if cmd.kind == "quit":
                    break
                validate_command(session, cmd)
                if cmd.kind != "send":
                    print(f"chatapp: {apply_command(session, cmd)}", file=sys.stderr)
                    continue
            except (CommandError, CacheConfigError) as e:
                print(f"chatapp: error: {err_safe(str(e))}", file=sys.stderr)
                continue
            if not first:
                out.write("\n")
            first = False
            result = turn(cmd.text)
            refused = refused or result == "refused"
            if state["term"]:
                return 143
        return 1 if refused else 0
    except KeyboardInterrupt:
        return 143 if state["term"] else 130
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)
        if stats_file:
            stats_file.close()
        chat.close()  # a reply still streaming is kept as interrupted; the snapshot is saved
        _print_notes(chat, err_safe)


# ---- chatapp sessions ... ------------------------------------------------------------------------


def build_sessions_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chatapp sessions", description="Saved conversations.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data-dir", help="where conversations and snapshots are stored")
    common.add_argument("--config", metavar="FILE", help="a config.toml that overrides the user file")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("list", parents=[common], help="list saved conversations, the latest first")
    ls.add_argument("--json", action="store_true", help="one JSON array instead of a table")
    ex = sub.add_parser("export", parents=[common], help="write one conversation as Markdown or JSON")
    ex.add_argument("id", help="conversation id, or 'latest'")
    ex.add_argument("--format", choices=["markdown", "json"], default="markdown")
    ex.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    rn = sub.add_parser("rename", parents=[common], help="give a conversation a new name")
    rn.add_argument("id", help="conversation id, or 'latest'")
    rn.add_argument("name", nargs="+", help="the new name")
    rm = sub.add_parser("delete", parents=[common], help="delete a conversation and its snapshot")
    rm.add_argument("id", help="conversation id, or 'latest'")
    px = sub.add_parser("prefixes", parents=[common], help="list (or --clear) the shared-prefix KV store")
    px.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    px.add_argument("--clear", action="store_true", help="remove every stored prefix")
    return p


def sessions_main(argv: list[str]) -> int:
    """`chatapp sessions list|export|rename|delete|prefixes`: no model, no MLX."""
    import time

    from .store import NotFound, StoreBusy, StoreError, export, resolve_data_dir
    from .store.db import ChatStore
    from .textsafe import printable

    args = build_sessions_parser().parse_args(argv)
    overrides = {"data.dir": args.data_dir} if args.data_dir else {}
    config = load_config(args.config, overrides)
    data_dir = resolve_data_dir(config)
    try:
        if args.command == "prefixes":
            return _prefixes_command(data_dir, config.data.prefix_cap_mb, clear=args.clear, as_json=args.json)
        with ChatStore.open(data_dir, write=False) as store:
            if args.command == "list":
                convs = store.list_conversations()
                if args.json:
                    print(json.dumps([c.to_json() for c in convs], ensure_ascii=False, indent=2))
                elif not convs:
                    print(f"no saved conversations in {data_dir}")
                else:
                    rows = [("ID", "UPDATED", "MSGS", "SNAPSHOT", "MODEL", "TITLE")]
                    for c in convs:
                        snap = f"{c.snapshot_bytes / (1 << 20):.1f} MiB" if c.snapshot_bytes else "-"
                        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
                        rows.append((str(c.id), when, str(c.messages), snap, printable(c.model_id),
                                     printable(c.title.replace("\n", " "))))
                    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
                    for r in rows:
                        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
                return 0
            cid = store.resolve(args.id)
            if args.command == "export":
                text = export(store, cid, args.format)
                if args.output:
                    with open(args.output, "w", encoding="utf-8", newline="") as f:
                        f.write(text)
                else:
                    sys.stdout.write(printable(text) if sys.stdout.isatty() else text)
                    sys.stdout.flush()
                return 0
        # rename / delete change the store: they need the data directory's lock
        with ChatStore.open(data_dir, write=True) as store:
            if args.command == "rename":
                store.rename(cid, " ".join(args.name))
                print(f"renamed conversation {cid}")
            else:
                store.delete(cid)
                print(f"deleted conversation {cid}")
        return 0
    except StoreBusy as e:
        print(f"chatapp: error: {e}: try again when it has exited", file=sys.stderr)
        return 1
    except (NotFound, StoreError) as e:
        print(f"chatapp: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"chatapp: error: {data_dir}: {e.strerror or e}", file=sys.stderr)
        return 2


def _prefixes_command(data_dir, cap_mb: int, clear: bool, as_json: bool) -> int:
    """`chatapp sessions prefixes [--clear] [--json]`: what the shared-prefix KV store holds.
    ``--clear`` takes the data directory's lock (StoreBusy and OSError go to sessions_main's handlers)."""
    import time

    from .store.lock import DataDirLock
    from .store.paths import prefix_dir
    from .store.prefixes import BlockInfo, PrefixStore, stored_prefixes
    from .textsafe import printable

    store = PrefixStore(prefix_dir(data_dir), cap_mb << 20, writable=False)
    if clear:
        if not store.dir.is_dir():
            print(f"no prefix store in {data_dir}")
            return 0
        with DataDirLock.acquire(data_dir):
            n, size = store.clear()
        print(f"removed {n} prefix blocks ({size / (1 << 20):.1f} MiB) from {store.dir}")
        return 0
    blocks = store.blocks()
    infos = [b for b in blocks if isinstance(b, BlockInfo)]
    unreadable = len(blocks) - len(infos)
    prefixes = stored_prefixes(infos)
    total = sum(b.size for b in infos)
    if as_json:
        print(json.dumps({"dir": str(store.dir), "cap_bytes": store.cap_bytes, "bytes": total, "blocks": len(infos),
                          "unreadable_blocks": unreadable, "prefixes": [p.to_json() for p in prefixes]}, indent=2))
        return 0
    if not blocks:
        print(f"no stored prefixes in {store.dir}")
        return 0
    rows = [("ID", "LAST USED", "TOKENS", "BLOCKS", "MiB", "FORMAT", "MODEL")]
    for p in prefixes:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(p.last_used))
        rows.append((p.id[:12] + ("" if p.complete else " (unreachable)"), when, str(p.tokens), str(p.blocks),
                     f"{p.bytes / (1 << 20):.1f}", printable(p.prompt_format), printable(p.model_id)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    print(f"{len(infos)} blocks, {total / (1 << 20):.1f} MiB of {cap_mb} MiB (data.prefix_cap_mb)"
          + (f"; {unreadable} unreadable (removed when next met)" if unreadable else ""))
    return 0
