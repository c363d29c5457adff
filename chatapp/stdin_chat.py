"""`chatapp --no-tui`: one turn per stdin line (or the -p prompt), replies on stdout, notes on stderr."""

from __future__ import annotations

import signal
import sys

from .errors import UserError


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - mlx-lm depends on transformers
        return
    hf_logging.set_verbosity_error()


def _print_notes(notes) -> None:
    """The store's notes (and errors), one line each on stderr."""
    from .textsafe import printable

    for n in notes:
        print(f"chatapp: {n.level}: {printable(n.text)}", file=sys.stderr)


def _first_notice_printer():
    """on_slow_warm_up for a terminal or a log: the first "compiling the CPU kernels" line only
    (the TUI renews it every few seconds; here that would be a line every 5 s)."""
    said = []

    def say(line: str) -> None:
        if not said:
            said.append(line)
            print(f"chatapp: note: {line}", file=sys.stderr, flush=True)

    return say


def _download_printer(stream=None):
    """progress for load_engine: a download's progress on stderr, one line rewritten in place on a
    terminal, a line per quarter in a log."""
    stream = stream or sys.stderr
    tty = stream.isatty()
    state = {"quarter": -1, "name": None}

    def show(p) -> None:
        if p.bytes_total <= 0:
            return
        text = (f"chatapp: downloading {p.filename}: {p.percent:3.0f}% "
                f"({p.bytes_done / 1e6:.0f} of {p.bytes_total / 1e6:.0f} MB)")
        done = p.bytes_done >= p.bytes_total
        if tty:
            stream.write("\r" + text + ("\n" if done else ""))
            stream.flush()
            return
        quarter = int(p.percent // 25)
        if quarter != state["quarter"] or p.filename != state["name"]:
            state.update(quarter=quarter, name=p.filename)
            print(text, file=stream, flush=True)

    return show


def _load_details(loaded) -> set[str]:
    """The load notes that describe rather than warn (the GGUF file and its tensor types, the CPU
    plan and its routes, the kernels' compile time): said with --verbose only, so a start is quiet.
    The plan's warnings and the memory notes are always said."""
    from .engine.setup import load_notices

    plan = getattr(loaded, "cpu_plan", None)
    keep = set(getattr(plan, "warnings", None) or []) | set(getattr(loaded, "memory_notes", None) or [])
    return set(load_notices(loaded)) - keep


def run_no_tui(args, config, blas) -> int:
    """One turn per stdin line (or the -p prompt), every message saved (see docs/persistence.md).

    Exit status: 0; 2 for a refused or empty -p prompt; 1 when some stdin message was refused;
    130 after Ctrl-C (a Ctrl-C during a reply only stops that reply when reading stdin);
    143 after SIGTERM (the reply stops, is saved as interrupted, the snapshot is written).
    """
    from .engine.events import TokenEvent, TurnDone
    from .engine.requests import Send
    from .store import read_lines, resolve_data_dir
    from .store.chat import ModelIdentity, open_chat
    from .store.statslog import StatsLog
    from .textsafe import printable

    if args.prompt is not None and not args.prompt.strip():
        raise UserError("the prompt is empty")  # before anything is loaded or written
    if args.verbose and blas is not None:
        print(f"chatapp: {blas.describe() if hasattr(blas, 'describe') else blas}", file=sys.stderr)
    from .engine.setup import load_engine, session_from_config

    loaded = load_engine(config, progress=_download_printer(), on_slow_warm_up=_first_notice_printer())
    _quiet_transformers()  # its "sequence longer than the model's maximum" warning: chatapp says it better
    session = session_from_config(config, loaded)
    if args.verbose and session.format_choice is not None:
        print(f"chatapp: {session.format_choice.line()}", file=sys.stderr)
    detail = set() if args.verbose else _load_details(loaded)
    for note in session.notices:
        if note not in detail:
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
    _print_notes(chat.take_notes())
    info = chat.resume_info
    if info is not None and info.from_snapshot and args.verbose:
        print(f"chatapp: {info.line()}", file=sys.stderr)
    pending_resume = info.to_json() if info is not None else None

    stats_log = StatsLog(None)
    state = {"replying": False, "cancelled": False, "term": False}

    def on_signal(signum, frame):
        if signum == signal.SIGTERM:
            state["term"] = True
        if state["replying"] and not state["cancelled"]:
            state["cancelled"] = True
            session.cancel()  # the reply stops at the next token; it is kept, marked interrupted
            return
        raise KeyboardInterrupt

    def show(ev) -> None:
        """Each event of the reply: its text on stdout; at the end the statistics row."""
        nonlocal pending_resume
        match ev:
            case TokenEvent(text=text) if text:
                out.write(safe(text))
                out.flush()
            case TurnDone(error=error) if error:
                state["replying"] = False  # the reply failed: its exception follows, no statistics row
            case TurnDone(stats=stats):
                state["replying"] = False
                out.write("\n")
                out.flush()
                extra = {"conversation_id": chat.conversation_id}
                if pending_resume is not None:
                    extra["resume"] = pending_resume
                stats_log.write(stats, **extra)
                pending_resume = None
                if args.verbose:
                    for n in stats.notices:
                        print(f"chatapp: note: {n}", file=sys.stderr)
                    if stats.prefix_tokens:
                        print(f"chatapp: {stats.prefix_line()}", file=sys.stderr)
                    print(f"chatapp: {stats.short()}", file=sys.stderr)
                    if stats.route and stats.route != "fused":
                        print(f"chatapp: decode route: {stats.route}, not the fused native step", file=sys.stderr)

    def turn(text: str) -> str:
        """Returns "ok", "cancelled" or "refused"."""
        def started() -> None:
            state["replying"], state["cancelled"] = True, False

        try:
            result = chat.turn(Send(text), show, _print_notes, started=started)
        finally:
            state["replying"] = False
        if result.refusal:
            print(f"chatapp: error: {result.refusal}", file=sys.stderr)
            return "refused"
        return "cancelled" if result.done is not None and result.done.stats.finish == "cancelled" else "ok"

    old_int = signal.signal(signal.SIGINT, on_signal)
    old_term = signal.signal(signal.SIGTERM, on_signal)
    try:
        stats_log = StatsLog(args.stats_json)
        if args.prompt is not None:
            result = turn(args.prompt)
            if state["term"]:
                return 143
            return {"ok": 0, "cancelled": 130, "refused": 2}[result]
        from cache import CacheConfigError

        from .slash_commands import (
            CommandError,
            apply_command,
            parse_line,
            validate_command,
        )

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
        stats_log.close()
        chat.close()  # a reply still streaming is kept as interrupted; the snapshot is saved
        _print_notes(chat.take_notes())
