"""A long conversation, turn by turn, past the model's trained context: speed and KV held per cache mode.

A scripted chat grows until its conversation reaches ``--target-tokens`` (default 16,384; twice
SmolLM2's trained 8,192). Each turn is a user message of about ``--turn-tokens`` tokens (512) cut
from a public-domain text (chatapp/bench/texts: KJV Ruth and Esther, taken again from the start
when it runs out) plus an assistant reply of ``--reply-tokens`` greedy tokens (64; end-of-turn
banned, ``ignore_eos``, so every reply has the same length).

Each ``--modes`` entry (default prealloc,window,window-quant,scored-quant; any cache mode, or
``auto``) gets its own ``Session`` built as the app builds it (``engine.setup.load_engine`` and
``session_from_config``: the CPU fast path, the fused native steps where they apply, the
``[cache]`` settings from the flags below) on one loaded model. Each turn is sent as the app sends
it: ``Session.admit`` first (a message that would take a cache mode that keeps every token past
the trained context is refused there, and that mode's chat stops: the row says so; ``auto``
switches to its long policy and the row shows the switch), then ``Session.send``. The modes
advance one turn each, in an order that alternates every turn, then the next turn starts, so a
slow spell of the shared machine hits every mode alike; ``--pause`` seconds pass before each
turn, as a user typing would (the BLAS threads of the previous reply go idle).

Per turn and mode, from the Session's own ``TurnStats``: conversation tokens after the turn,
tokens held in the cache (``cache.usage.total_usage``: evicted ones are not held), the turn's new
tokens (prefilled: the cache reuses the rest), TTFT (ms, from ``reply()``'s start to the first
token: rendering, tokenising, prefill, first sample), prefill tok/s of the new tokens, decode
tok/s (the tokens after the first over their time), KV bytes held and allocated, and the route
that ran: ``fused`` when the model has the fused native step and
``backend.fused_support.cache_refusal`` accepts the caches, else ``mlx`` and why.

llama.cpp (``--peers chatapp,llama.cpp``, when llama-cpp-python is importable; one line says it
is skipped otherwise) runs in a process of its own (long_peer.py) on the same GGUF file at its
trained context (n_ctx from the file), its cache kept across turns: each turn it evaluates the
same new tokens the first chatapp mode prefilled (the turn's rendered user message, after that
mode's reply; llama.cpp's own greedy reply stays in its cache), then decodes ``--reply-tokens``.
Past n_ctx the row shows what it did (the error it raised); it takes no further turns.

Targets, printed under the table: window-quant's decode at the last turn within 10% of its decode
at the turn nearest 2,048 conversation tokens (flat); each mode's TTFT per new token at the last
turn within 1.5x of turn 2's (TTFT follows the new message, not the history); for a mode whose
cache stops growing (a budget), its TTFT per new token at the last turn within 1.15x of the first
turn that held as many tokens (flat from there: turn 2 to the budget the tokens each new message
attends to still grow, 1,233 to 4,265 in BENCHMARKS.md's run, and so does the prefill's attention);
window-quant decode >= 1.5x llama.cpp's at the last turn both ran (when llama.cpp ran).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from chatapp.bench.common import SMOLLM2_GGUF, loadavg, start_bench
from chatapp.bench.report import BenchReport, add_cache_arguments, cache_knobs, emit, line_plot, print_targets

TEXT = Path(__file__).resolve().parent / "texts" / "kjv-ruth-esther.txt"
DEFAULT_MODES = ("prealloc", "window", "window-quant", "scored-quant")
PEERS = ("chatapp", "llama.cpp")
FLAT = 0.9  # window-quant's decode at the last turn at least this share of its decode at ~2k
FLAT_AT = 2048  # the reference point of the flatness target (conversation tokens)
TTFT_GROWTH = 1.5  # TTFT per new token at the last turn within this factor of turn 2's
TTFT_FLAT = 1.15  # ... and of the first turn holding the budget (the prefill attends to as many tokens)
VS_LLAMA = 1.5  # window-quant decode at least this many times llama.cpp's
SYSTEM = "You are a helpful assistant. The user sends passages of a book; answer each briefly."
ASK = "Here is the next passage of the book:\n\n{text}\n\nWhat happens in this passage?"


def _modes(text: str) -> list[str]:
    from cache.settings import MODES

    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES + ("auto",)]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {', '.join(MODES + ('auto',))}")
    return out


def _peers(text: str) -> list[str]:
    out = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in out if p not in PEERS]
    if bad or "chatapp" not in out:
        raise argparse.ArgumentTypeError(f"--peers: chatapp plus optionally llama.cpp (got {text!r})")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(SMOLLM2_GGUF),
                   help="a GGUF file or model folder (default ../shared SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--target-tokens", type=int, default=16384,
                   help="run turns until the conversation reaches this many tokens (default 16384)")
    p.add_argument("--max-turns", type=int, default=0, help="stop after this many turns (default 0: no limit)")
    p.add_argument("--turn-tokens", type=int, default=512, help="tokens of each user message (default 512)")
    p.add_argument("--reply-tokens", type=int, default=64, help="greedy tokens of each reply (default 64)")
    p.add_argument("--modes", type=_modes, default=list(DEFAULT_MODES),
                   help=f"cache modes, one session each (default {','.join(DEFAULT_MODES)}; also auto)")
    p.add_argument("--peers", type=_peers, default=["chatapp"],
                   help="chatapp, or chatapp,llama.cpp (llama-cpp-python in a process of its own)")
    p.add_argument("--threads", type=int, default=0, help="threads for chatapp's kernels and llama.cpp (0: all)")
    p.add_argument("--pause", type=float, default=0.2,
                   help="seconds to wait before each turn, as a user typing would (default 0.2)")
    p.add_argument("--long-after", type=int, default=2048, help="cache.long_after of the auto mode (default 2048)")
    add_cache_arguments(p)


# ---- the script ---------------------------------------------------------------------------------
def user_messages(tokenizer, turn_tokens: int, n: int) -> list[str]:
    """``n`` messages of about ``turn_tokens`` tokens each, consecutive pieces of the text."""
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    out, at = [], 0
    for _ in range(n):
        if at + turn_tokens > len(ids):
            at = 0
        out.append(ASK.format(text=tokenizer.decode(ids[at : at + turn_tokens]).strip()))
        at += turn_tokens
    return out


def _turns_needed(args) -> int:
    n = -(-args.target_tokens // (args.turn_tokens + args.reply_tokens + 16))
    return min(n, args.max_turns) if args.max_turns else n


# ---- chatapp ------------------------------------------------------------------------------------
@dataclass
class Row:
    """One turn of one mode (or of llama.cpp)."""

    turn: int
    mode: str
    conversation: int = 0  # tokens of the whole conversation after the turn
    held: int = 0  # tokens held in the cache after the turn
    new: int = 0  # tokens prefilled this turn
    ttft_ms: float = float("nan")
    prefill_tok_s: float = float("nan")
    decode_tok_s: float = float("nan")
    kv_held: int = 0  # bytes
    kv_allocated: int = 0  # bytes
    route: str = ""
    note: str = ""

    @property
    def ran(self) -> bool:
        return self.ttft_ms == self.ttft_ms  # not NaN


def _config(args, mode: str):
    from chatapp.config import Config

    cfg = Config()
    cfg.model.id = args.model
    cfg.cpu.threads = args.threads
    cfg.sampling.temp = 0.0
    cfg.sampling.max_tokens = args.reply_tokens
    cfg.sampling.ignore_eos = True  # every reply the same length
    cfg.chat.system = SYSTEM
    cfg.cache.mode = mode
    cfg.cache.long_after = args.long_after
    for name, value in cache_knobs(args).items():
        setattr(cfg.cache, name, value)
    return cfg


def chatapp_turn(session, text: str, turn: int, label: str) -> tuple[Row, list[int]]:
    """Send one user message as the app does (admit, then send); the row and the tokens prefilled."""
    from cache.usage import total_usage
    from chatapp.engine.events import TurnDone
    from chatapp.engine.route import decode_route

    row = Row(turn, label)
    adm = session.admit(text)
    if not adm.send:
        row.note = adm.refusal
        return row, []
    done = None
    for ev in session.send(text):
        if isinstance(ev, TurnDone):
            done = ev
    st = done.stats
    usage = total_usage(session.caches)
    new_ids = session.cached[st.reused_tokens : st.prompt_tokens]  # cached: every token, evicted ones included
    row.conversation = st.prompt_tokens + st.generated_tokens
    row.held, row.new = usage.tokens, st.prefill_tokens
    row.ttft_ms, row.prefill_tok_s, row.decode_tok_s = st.ttft * 1000, st.prefill_tps, st.decode_tps
    row.kv_held, row.kv_allocated = usage.bytes_held, usage.bytes_allocated
    row.route = decode_route(session.model, session.caches)
    row.note = "; ".join(adm.notes + st.notices)
    return row, new_ids


# ---- llama.cpp ----------------------------------------------------------------------------------
class LlamaPeer:
    """long_peer.py in a process of its own: one JSON line per turn each way."""

    def __init__(self, args):
        from chatapp.bench.cpu_flagship import REPO

        spec = {"model": args.model, "threads": args.threads, "reply": args.reply_tokens}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        self._spec = f.name
        self.proc = subprocess.Popen([sys.executable, "-m", "chatapp.bench.long_peer", f.name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                         [str(REPO)] + [x for x in [os.environ.get("PYTHONPATH")] if x])})
        self.info = self._read()
        self.stopped = False

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer exited (code {self.proc.wait()})")
        return json.loads(line)

    def turn(self, ids: list[int], turn: int) -> Row:
        row = Row(turn, "llama.cpp", route=f"llama.cpp n_ctx {self.info['n_ctx']}")
        if self.stopped:
            row.note = "stopped at an earlier turn"
            return row
        try:
            self.proc.stdin.write(json.dumps(ids) + "\n")
            self.proc.stdin.flush()
            res = self._read()
        except (OSError, RuntimeError, ValueError) as e:  # the process died: say so, the chat goes on
            self.stopped = True
            row.note = f"llama.cpp peer failed: {e}"
            return row
        if "error" in res:
            self.stopped = True
            row.held = res.get("held", 0)
            row.note = (f"past n_ctx ({res.get('asked')} > {res.get('n_ctx')} tokens): {res['error']}"
                        if res.get("asked", 0) > res.get("n_ctx", 1 << 62) else res["error"])
            return row
        row.conversation = row.held = res["held"]
        row.new = len(ids)
        row.ttft_ms, row.prefill_tok_s, row.decode_tok_s = res["ttft_ms"], res["prefill_tok_s"], res["decode_tok_s"]
        return row

    def close(self) -> None:
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        os.unlink(self._spec)


def _llama_peer(args, log) -> LlamaPeer | None:
    if "llama.cpp" not in args.peers:
        return None
    if importlib.util.find_spec("llama_cpp") is None:
        log("# llama.cpp: llama_cpp is not importable (pip install llama-cpp-python); skipped")
        return None
    if not str(args.model).endswith(".gguf"):
        log("# llama.cpp: --model is not a GGUF file; skipped")
        return None
    try:
        return LlamaPeer(args)
    except (OSError, RuntimeError, ValueError) as e:
        log(f"# llama.cpp: the peer did not start ({e}); skipped")
        return None


# ---- the run ------------------------------------------------------------------------------------
def run_chat(args, log) -> tuple[list[Row], dict[str, Any]]:
    from chatapp.engine.setup import load_engine, session_from_config

    loaded = load_engine(_config(args, args.modes[0]))
    sessions = {m: session_from_config(_config(args, m), loaded) for m in args.modes}
    info = {"model": f"{loaded.model_id}: {loaded.n_layers} layers, {loaded.n_kv_heads} KV heads of "
                     f"{loaded.head_dim}, {loaded.dtype}",
            "trained_context": loaded.max_position_embeddings, "plan": loaded.cpu_plan.summary()}
    peer = _llama_peer(args, log)
    if peer is not None:
        info["llama.cpp"] = peer.info
    messages = user_messages(loaded.tokenizer, args.turn_tokens, _turns_needed(args))
    rows: list[Row] = []
    stopped: dict[str, str] = {}
    try:
        for t, text in enumerate(messages, start=1):
            order = args.modes if t % 2 else args.modes[::-1]
            new_ids: dict[str, list[int]] = {}
            for mode in order:
                if mode in stopped:
                    rows.append(Row(t, mode, note=f"stopped at turn {stopped[mode]}"))
                    continue
                time.sleep(args.pause)
                row, new_ids[mode] = chatapp_turn(sessions[mode], text, t, mode)
                rows.append(row)
                if not row.ran:
                    stopped[mode] = str(t)
                log(f"# turn {t} {mode}: {_line(row)}")
            if peer is not None:
                time.sleep(args.pause)
                # the tokens the first mode that ran this turn prefilled (the modes' replies may differ)
                ids = next((new_ids[m] for m in args.modes if new_ids.get(m)), [])
                row = peer.turn(ids, t)
                rows.append(row)
                log(f"# turn {t} llama.cpp: {_line(row)}")
            ran = [r for r in rows if r.turn == t and r.ran and r.mode != "llama.cpp"]
            if not ran or min(r.conversation for r in ran) >= args.target_tokens:
                break
    finally:
        if peer is not None:
            peer.close()
    return rows, info


def _line(r: Row) -> str:
    if not r.ran:
        return r.note
    return (f"conversation {r.conversation}, held {r.held}, new {r.new}, TTFT {r.ttft_ms:.0f} ms, "
            f"prefill {r.prefill_tok_s:.0f} tok/s, decode {r.decode_tok_s:.1f} tok/s, {r.route}")


# ---- targets and report -------------------------------------------------------------------------
def _mode_rows(rows: list[Row], mode: str) -> list[Row]:
    return [r for r in rows if r.mode == mode and r.ran]


def _near(rows: list[Row], tokens: int) -> Row | None:
    return min(rows, key=lambda r: abs(r.conversation - tokens)) if rows else None


def check_targets(rows: list[Row], modes: list[str]) -> list[dict[str, Any]]:
    out = []

    def add(name, passed, detail):
        out.append(dict(target=name, passed=passed, detail=detail))

    wq = _mode_rows(rows, "window-quant")
    ref = _near(wq[1:] or wq, FLAT_AT)  # turn 1 pays the first turn's warm-up
    if len(wq) > 1 and ref is not None and ref is not wq[-1]:
        r = wq[-1].decode_tok_s / ref.decode_tok_s
        add(f"window-quant decode flat: at {wq[-1].conversation} tokens >= {FLAT:.0%} of at {ref.conversation}",
            r >= FLAT, f"{wq[-1].decode_tok_s:.1f} / {ref.decode_tok_s:.1f} tok/s = {r:.2f}")
    elif "window-quant" not in modes:
        add("window-quant decode flat", None, "not measured: window-quant is not in --modes")
    else:
        add("window-quant decode flat", None, f"not measured: no turn after the one nearest {FLAT_AT} tokens "
            "(a longer --target-tokens)")
    for mode in modes:
        mr = _mode_rows(rows, mode)
        if len(mr) < 3 or not mr[1].new or not mr[-1].new:
            add(f"{mode}: TTFT follows the new message", None, "not measured: fewer than 3 turns ran")
            continue
        base = mr[1]  # turn 2: the first after the first turn's system prompt and warm-up
        per = [r.ttft_ms / r.new for r in (base, mr[-1])]
        g = per[1] / per[0]
        add(f"{mode}: TTFT per new token at {mr[-1].conversation} tokens within {TTFT_GROWTH}x of at "
            f"{base.conversation}", g <= TTFT_GROWTH,
            f"{mr[-1].ttft_ms:.0f} ms / {mr[-1].new} new vs {base.ttft_ms:.0f} ms / {base.new} new = {g:.2f}x "
            f"(history grew {mr[-1].conversation / max(1, base.conversation):.1f}x)")
        add_flat_ttft(add, mode, mr)
    lc = _mode_rows(rows, "llama.cpp")
    if not lc:
        add(f"window-quant decode >= {VS_LLAMA}x llama.cpp", None, "llama.cpp did not run")
    elif wq:
        last = max(r.turn for r in lc)
        a = next((r for r in wq if r.turn == last), None)
        b = next(r for r in lc if r.turn == last)
        if a is not None:
            r = a.decode_tok_s / b.decode_tok_s
            add(f"window-quant decode >= {VS_LLAMA}x llama.cpp at turn {last} ({a.conversation} tokens)",
                r >= VS_LLAMA, f"{a.decode_tok_s:.1f} / {b.decode_tok_s:.1f} tok/s = {r:.2f}x")
    return out


def add_flat_ttft(add, mode: str, mr: list[Row]) -> None:
    """The TTFT target once ``mode``'s cache holds as many tokens as it ever will (its budget):
    the last turn's TTFT per new token against the first such turn's, where a later turn ran."""
    full = next((r for r in mr[1:] if r.held >= mr[-1].held), None)
    name = f"{mode}: TTFT flat once the cache holds its budget"
    if full is None or full is mr[-1] or not full.new:
        add(name, None, f"not measured: the cache grew to the last turn ({mr[-1].held} held)")
        return
    g = (mr[-1].ttft_ms / mr[-1].new) / (full.ttft_ms / full.new)
    add(f"{name}: per new token at {mr[-1].conversation} tokens within {TTFT_FLAT}x of at {full.conversation}",
        g <= TTFT_FLAT, f"{mr[-1].ttft_ms:.0f} ms / {mr[-1].new} new vs {full.ttft_ms:.0f} ms / {full.new} new = "
        f"{g:.2f}x, {full.held} held at both (history grew {mr[-1].conversation / max(1, full.conversation):.1f}x)")


COLUMNS = ["turn", "mode", "conversation", "held", "new", "TTFT ms", "prefill tok/s", "decode tok/s",
           "KV held MiB", "KV alloc MiB", "route", "note"]


def build_report(args, rows: list[Row], info: dict, targets: list) -> BenchReport:
    rep = BenchReport(f"long: a {args.turn_tokens}+{args.reply_tokens}-token-per-turn chat to "
                      f"{args.target_tokens} tokens, per cache mode", COLUMNS)
    mib = 2**20
    for r in rows:
        if not r.ran:  # refused, stopped or failed: the note says which
            rep.add(r.turn, r.mode, "-", r.held or "-", "-", "-", "-", "-", "-", "-", r.route, r.note[:100])
            continue
        rep.add(r.turn, r.mode, r.conversation, r.held, r.new, round(r.ttft_ms, 1), round(r.prefill_tok_s, 1),
                round(r.decode_tok_s, 1), round(r.kv_held / mib, 2), round(r.kv_allocated / mib, 2), r.route,
                r.note[:100])
    rep.meta.update(info)
    rep.meta.update(modes=",".join(args.modes), turn_tokens=args.turn_tokens, reply_tokens=args.reply_tokens,
                    target_tokens=args.target_tokens, cache=cache_knobs(args), threads=args.threads,
                    pause_s=args.pause)
    rep.meta["targets"] = targets
    # every row in full (notes uncut); a turn that did not run has null rates (JSON has no NaN)
    rep.meta["turns"] = [{k: (None if v != v else v) for k, v in asdict(r).items()} for r in rows]
    return rep


def ttft_plot_path(path: str) -> Path:
    """The TTFT plot beside ``--plot``: cache.png -> cache-ttft.png."""
    p = Path(path)
    return p.with_name(f"{p.stem}-ttft{p.suffix or '.png'}")


def plot(path: str, args, rows: list[Row]) -> None:
    """Decode tok/s against conversation tokens per mode at ``path``; TTFT at ``<stem>-ttft.png``."""
    names = list(args.modes) + (["llama.cpp"] if any(r.mode == "llama.cpp" and r.ran for r in rows) else [])

    def series(field):
        return {m: ([r.conversation for r in _mode_rows(rows, m)], [getattr(r, field) for r in _mode_rows(rows, m)])
                for m in names if _mode_rows(rows, m)}

    line_plot(path, f"decode tok/s over a long chat ({Path(args.model).name})", "conversation tokens",
              "decode tok/s", series("decode_tok_s"))
    line_plot(ttft_plot_path(path),
              f"TTFT per turn ({args.turn_tokens}-token messages)", "conversation tokens", "TTFT ms",
              series("ttft_ms"))


def run(args) -> int:
    if args.turn_tokens < 1 or args.reply_tokens < 2 or args.target_tokens < 1:
        raise SystemExit("--turn-tokens and --target-tokens need >= 1, --reply-tokens >= 2")
    if not Path(args.model).expanduser().exists():
        raise SystemExit(f"--model: nothing at {args.model}")
    log = lambda s: print(s, flush=True)  # noqa: E731
    start_bench()
    load_start = loadavg()
    rows, info = run_chat(args, log)
    targets = check_targets(rows, args.modes)
    rep = build_report(args, rows, info, targets)
    rep.meta["load_average"] = f"{load_start} at the start, {loadavg()} at the end"
    emit(rep, args.json, lambda path: plot(path, args, rows), args.plot)
    if args.plot:
        print(f"# wrote {ttft_plot_path(args.plot)}")
    print_targets(targets)
    return 0
