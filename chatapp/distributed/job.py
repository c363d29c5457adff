"""One conversation sharded over the ranks of an MLX distributed job (``mlx.launch``).

Every rank loads its shard of the model (tensor parallelism with mlx-lm's ``model.shard``, or
pipeline parallelism with ``model.model.pipeline`` where mlx-lm implements it) and runs the same
:class:`~chatapp.engine.session.Session`. Rank 0 owns the user side: it reads stdin (or ``-p``),
prints the replies, the statistics and the transcript. The other ranks follow: rank 0
broadcasts every command (a turn's text, a cache mode switch, a sampling change, quit) with MLX's
own collectives, and every rank runs the same Session operation on the same tokens, so the
caches are trimmed, evicted and converted in step. There is no transport of our own: all
traffic is ``mx.distributed`` collectives over the group MLX set up (ring over TCP, MPI, ...).

The control protocol (all messages are collectives, so every rank takes part in each one):

* a header ``all_sum`` of an int64 ``[op, length, seq]``: rank 0 contributes the values, the
  others zeros; then, when ``length > 0``, an ``all_sum`` of the uint8 payload (JSON), again
  with zeros from the followers. ``seq`` counts messages, so a rank that fell out of step is
  caught at once.
* while rank 0 waits for input it sends a NOOP every :data:`TICK_SECONDS`: it is the heartbeat
  (a dead rank is noticed while idle) and lets the followers sleep between ticks instead of
  spinning inside a pending collective (the ring backend polls, burning a core while it waits).
* after every command each rank contributes ``[tokens cached, token checksum, conversation
  checksum, mode, cache bytes held, bytes allocated, cache tokens]`` to an ``all_gather``:
  rank 0 gets the per-rank cache use for its statistics, and all ranks check that they still
  agree (same tokens, same conversation, same mode) or stop together.
* each prefill chunk and each decoded token, the cancel flag is ``all_sum``-ed (a 1-element
  collective), so Ctrl-C on any rank stops the reply on every rank at the same token.

Sampling: with tensor parallelism the sharded layers all-reduce their outputs, and the ring
all-reduce hands every rank bit-identical results, so the logits (computed from the same hidden
state by the same unsharded head) are identical on all ranks and greedy decoding agrees. For
``temp > 0`` rank 0 chooses the seed of each turn (the configured ``sampling.seed``, or a fresh
random one when it is -1) and sends it with the turn; every rank seeds MLX's generator with it
before decoding, so the samples agree too, without a per-token broadcast. The per-command
checksum would catch any divergence.

Failure handling: a rank that dies closes its sockets and the ring backend fails the pending
collective on the others ("[ring] connection to a peer was lost"); ``mlx.launch`` also sends
SIGTERM to the other ranks when one exits non-zero. A rank that hangs (stopped, or a network
that drops packets silently) leaves the others waiting inside a collective, which has no
timeout: a watchdog thread stops the rank when a command makes no progress for
``CHATAPP_DIST_TIMEOUT`` seconds (default 120; 0 turns it off). In each case rank 0 prints one
line saying what happened and what of the conversation it kept (everything up to the last
complete message: the replies already printed), then exits with :data:`EXIT_PEER_LOST`.

This package imports nothing from MLX at import time: the CLI calls :func:`launched` before an
optimised BLAS is loaded, and that must happen before ``mlx.core`` is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from cache.settings import CacheConfigError
from chatapp.distributed.channel import (
    DEFAULT_TIMEOUT,
    OP_CMD,
    OP_NOOP,
    OP_QUIT,
    PROTOCOL,
    TICK_SECONDS,
    TIMEOUT_ENV,
    Channel,
    DistributedError,
    SharedCancel,
    Watchdog,
    peer_error,
)
from chatapp.distributed.shard import ShardError, ShardInfo, load_shard, precheck_heads
from chatapp.errors import SetupError
from chatapp.model.modelfiles import ModelLoadError
from chatapp.slash_commands import (
    Command,
    CommandError,
    apply_command,
    parse_line,
    validate_command,
)
from chatapp.store.statslog import StatsLog

EXIT_PEER_LOST = 3  # a rank was lost, hung, or the ranks diverged
EXIT_USER = 2
EXIT_CANCELLED = 130


def _token_checksum(tokens: list[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 2_305_843_009_213_693_951  # 2**61 - 1
    return h


def _conversation_checksum(conv) -> int:
    h = hashlib.sha256()
    for m in conv.messages:
        h.update(f"{m.role}\0{m.content}\0{int(bool(m.interrupted))}\1".encode())
    return int.from_bytes(h.digest()[:7], "big")


@dataclass
class RankState:
    rows: list[list[int]]

    COLUMNS = ("cached", "token_sum", "conv_sum", "mode", "bytes_held", "bytes_allocated", "tokens")

    def column(self, name: str) -> list[int]:
        i = self.COLUMNS.index(name)
        return [r[i] for r in self.rows]


class DistributedJob:
    """The same loop on every rank; rank 0 also reads input and writes output."""

    def __init__(self, args, config, blas, group, out: TextIO | None = None, err: TextIO | None = None,
                 stdin: TextIO | None = None):
        self.args = args
        self.config = config
        self.blas = blas
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.stdin = stdin or sys.stdin
        self.prefix = "chatapp" if self.rank == 0 else f"chatapp[rank {self.rank}]"
        timeout = _env_float(TIMEOUT_ENV, DEFAULT_TIMEOUT)
        self.watchdog = Watchdog(timeout, self._on_stall, self._on_signal)
        self.channel = Channel(group, self.watchdog)
        self.session = None
        self.chat = None  # a PersistentChat that saves nothing: the turn driver every front end shares
        self.info: ShardInfo | None = None
        self.stats_log = None  # rank 0's --stats-json (chatapp.store.statslog.StatsLog)
        self.turn_no = 0
        self.partial = False  # rank 0 has printed part of a reply
        self.sigints = 0
        self.safe: Callable[[str], str] = lambda text: text
        self.seed_setting: int | None = config.sampling.seed  # rank 0: the user's seed (None = random)
        self._abort_lock = threading.Lock()
        self._exit: Callable[[int], None] = os._exit  # a rank must stop even if a thread is stuck
        self.final_code: int | None = None  # set once every rank knows how the run ends

    # ---- ending --------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.err, flush=True)

    def kept(self) -> str:
        if self.session is None:
            return "no conversation had started"
        # A reply cut off by the failure is kept in memory marked interrupted (the turn driver
        # does that); it was not printed whole, so it is not counted.
        msgs = [m for m in self.session.conversation.messages if m.role != "system" and not m.interrupted]
        replies = sum(1 for m in msgs if m.role == "assistant")
        return (f"kept the conversation up to the last complete message ({len(msgs)} messages, "
                f"{replies} complete {'reply' if replies == 1 else 'replies'}, all printed above)")

    def abort(self, reason: str, code: int = EXIT_PEER_LOST) -> None:
        """Stop this rank now: one clear line (and, on rank 0, what was kept), then exit."""
        with self._abort_lock:
            try:
                if self.rank == 0:
                    if self.partial:
                        self.out.write("\n")
                    self.out.flush()
                    where = f" during turn {self.turn_no}" if self.turn_no else ""
                    dropped = "; the unfinished reply was not kept" if self.partial else ""
                    self.say(f"error: distributed run stopped{where}: {reason}; {self.kept()}{dropped}")
                    if self.stats_log is not None:
                        self.stats_log.flush()
                else:
                    self.say(f"error: stopping: {reason}")
                self.err.flush()
            finally:
                self._exit(code)

    def _on_stall(self, message: str) -> None:
        self.abort(message)

    def _on_signal(self, signum: int) -> None:
        if self.final_code is not None and signum != signal.SIGINT:
            # The run is over on every rank (mlx.launch stops the others when one exits non-zero).
            self._exit(self.final_code)
            return
        if signum == signal.SIGINT:
            self.sigints += 1
            if self.session is not None and self.sigints == 1:
                self.session.cancel()  # stops the reply on every rank at the same token
                return
            self.abort("interrupted", EXIT_CANCELLED)
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        self.abort(f"received {name} (mlx.launch stops every rank when one of them exits: see the other "
                   "ranks' messages)", 128 + signum)

    # ---- start-up ------------------------------------------------------------------------------
    def start(self) -> int | None:
        """Agree on the settings, load every shard, build the sessions; an exit code on failure."""
        hello: dict[str, Any] = {"protocol": PROTOCOL}
        if self.rank == 0:
            if self.args.prompt is not None and not self.args.prompt.strip():
                hello["error"] = "the prompt is empty"
            hello["strategy"] = self.args.distributed
            hello["config"] = {k: v for k, v in self.config.to_dict().items() if k != "cpu"}
            self.channel.send_json(OP_CMD, hello)
        else:
            _, payload = self.channel.message()
            hello = json.loads(payload)
            if hello.get("protocol") != PROTOCOL:
                # Its peers cannot be trusted to speak the rest of the protocol: stop right here.
                self.abort(f"rank 0 speaks protocol {hello.get('protocol')}, this rank {PROTOCOL}: run the same "
                           "chatapp version on every host", EXIT_USER)
        if hello.get("error"):
            self.final_code = EXIT_USER
            if self.rank == 0:
                self.say(f"error: {hello['error']}")
            return EXIT_USER
        if self.rank != 0:
            self.config = _config_from(hello["config"], self.config)

        error = ""
        try:
            if hello.get("strategy") == "tensor":
                precheck_heads(self.config.model.id, self.size)  # before the slow imports and the load
            from chatapp.engine.setup import session_from_config

            loaded, self.info = load_shard(self.config, self.group, hello.get("strategy"))
            # Ctrl-C on any rank stops the reply on every rank at the same token.
            self.session = session_from_config(self.config, loaded, cancel=SharedCancel(self.channel))
        except ShardError as e:
            error = str(e)
        except (SetupError, ModelLoadError, CacheConfigError) as e:
            error = str(e)
        lines = self.channel.gather_text(error)
        if not any(lines):
            return None
        self.final_code = EXIT_USER  # every rank knows: a SIGTERM from here on changes nothing
        if self.rank == 0:
            if lines[0]:
                self.say(f"error: {lines[0]}")
            for r, line in enumerate(lines[1:], start=1):
                if line and line != lines[0]:
                    self.say(f"error: rank {r}: {line}")
        return EXIT_USER

    # ---- commands ------------------------------------------------------------------------------
    def _sync(self) -> RankState:
        from cache import MODES

        s = self.session
        view = s.cache_view()
        mode = MODES.index(s.mode) if s.mode in MODES else -1
        row = [len(s.cached), _token_checksum(s.cached), _conversation_checksum(s.conversation), mode,
               view.bytes_held, view.bytes_allocated, view.tokens]
        state = RankState(self.channel.gather(row))
        for col in ("cached", "token_sum", "conv_sum", "mode"):
            values = state.column(col)
            if len(set(values)) > 1:
                raise DistributedError(f"the ranks diverged ({col} differs: {values})")
        return state

    def execute(self, cmd: Command, seed: int | None) -> tuple[Any, RankState]:
        """Run one command on this rank; returns (what rank 0 shows, the synced state)."""
        from chatapp.engine.requests import Send

        s = self.session
        shown = None
        if cmd.kind == "send":
            self.turn_no += 1
            s.set_generation(seed=seed)
            # Every rank runs the message as rank 0 validated it (no admission: the ranks must
            # not diverge); only rank 0 prints.
            result = self._chat().turn(Send(cmd.text), self._show, lambda notes: None, admit=False)
            shown = result.done
        else:
            try:
                shown = apply_command(s, cmd)
            except CacheConfigError as e:  # validated on rank 0 first; every rank fails the same way
                shown = e
        return shown, self._sync()

    def _chat(self):
        """The session in a PersistentChat with no store: nothing is saved (a distributed run keeps
        its conversation in memory), but the turns run through the one turn driver."""
        from chatapp.store.chat import ModelIdentity, PersistentChat

        if self.chat is None or self.chat.session is not self.session:
            self.chat = PersistentChat(self.session, ModelIdentity(self.session.model_id, self.config.model.id, ""))
        return self.chat

    def _show(self, ev) -> None:
        from chatapp.engine.events import TokenEvent, TurnDone

        if self.rank != 0:
            return
        match ev:
            case TokenEvent(text=text) if text:
                self.out.write(self.safe(text))
                self.out.flush()
                self.partial = True
            case TurnDone(error=""):  # a failed reply's exception is reported after it
                self.out.write("\n")
                self.out.flush()
                self.partial = False

    # ---- loops -----------------------------------------------------------------------------------
    def _quit(self, code: int) -> int:
        """Rank 0 ends the run: QUIT, then a barrier, so every rank knows it is done before rank 0
        exits (mlx.launch sends SIGTERM to the others as soon as rank 0 exits non-zero)."""
        self.channel.message(OP_QUIT)
        self.final_code = code
        self.channel.any(False)
        return code

    def follow(self) -> int:
        while True:
            self.watchdog.busy("waiting for rank 0")
            op, payload = self.channel.message()
            if op == OP_NOOP:
                self.watchdog.idle()
                time.sleep(TICK_SECONDS * 0.9)
                continue
            if op == OP_QUIT:
                self.final_code = 0
                self.channel.any(False)  # the last barrier: see _quit
                return 0
            msg = json.loads(payload)
            self.watchdog.busy(f"in {msg['cmd']['kind']}")
            self.execute(Command.from_json(msg["cmd"]), msg.get("seed"))

    def lead(self) -> int:
        from chatapp.engine.events import TurnDone
        from chatapp.textsafe import printable

        args = self.args
        s = self.session
        if args.verbose and self.blas is not None:
            self.say(f"{self.blas.describe() if hasattr(self.blas, 'describe') else self.blas}")
        for note in s.notices:
            self.say(f"note: {note}")
        self.safe = printable if self.out.isatty() else (lambda t: t)
        self.stats_log = StatsLog(args.stats_json)
        lines = _Lines(None if args.prompt is None else [args.prompt], self.stdin)
        first = True
        try:
            while True:
                line = lines.get(TICK_SECONDS)
                if line is _Lines.WAIT:
                    self.watchdog.busy("in a heartbeat")
                    self.channel.message(OP_NOOP)
                    self.watchdog.idle()
                    continue
                if line is _Lines.EOF:
                    return self._quit(0)
                try:
                    # -p TEXT is sent as it is (as the single-process CLI does); stdin lines may be commands
                    cmd = Command("send", text=line) if args.prompt is not None else parse_line(line)
                    if cmd is None:
                        continue  # empty and whitespace-only messages are ignored
                    if cmd.kind == "quit":
                        return self._quit(0)
                    validate_command(s, cmd)
                except CommandError as e:
                    self.say(f"error: {e}")
                    continue
                if cmd.kind == "send" and args.prompt is None:
                    if not first:
                        self.out.write("\n")
                    first = False
                seed = None
                if cmd.kind == "send":
                    seed = self.seed_setting
                    if seed is None and s.generation.temp > 0:
                        seed = random.randrange(2**31)  # sent with the turn: every rank samples alike
                elif cmd.kind == "set" and "seed" in cmd.changes:
                    self.seed_setting = None if cmd.changes["seed"] == -1 else cmd.changes["seed"]
                self.watchdog.busy(f"in {cmd.kind}")
                self.channel.send_json(OP_CMD, {"cmd": cmd.to_json(), "seed": seed})
                shown, state = self.execute(cmd, seed)
                self.watchdog.idle()
                if isinstance(shown, TurnDone):
                    self._report(shown, state)
                    if shown.stats.finish == "cancelled":
                        s.cancel_token.clear()
                        return self._quit(EXIT_CANCELLED)
                elif isinstance(shown, str):
                    self.say(shown)
                elif shown is not None:
                    self.say(f"error: {shown}")
        finally:
            if self.stats_log is not None:
                self.stats_log.close()
                self.stats_log = None

    def _report(self, done, state: RankState) -> None:
        from chatapp.engine.stats import fmt_bytes

        held = state.column("bytes_held")
        allocated = state.column("bytes_allocated")
        extra = {
            "per_rank_bytes": held,
            "distributed": {
                "ranks": self.size,
                "strategy": self.info.strategy if self.info else None,
                "per_rank_bytes": held,
                "per_rank_bytes_allocated": allocated,
                "total_bytes": sum(held),
                "total_bytes_allocated": sum(allocated),
                "kv_heads": self.info.n_kv_heads if self.info else None,
                "kv_heads_per_rank": self.info.local_kv_heads if self.info else None,
            },
        }
        if self.stats_log is not None:
            self.stats_log.write(done.stats, **extra)
        if self.args.verbose:
            for n in done.stats.notices:
                self.say(f"note: {n}")
            ranks = " + ".join(fmt_bytes(b) for b in held)
            self.say(f"{done.stats.short()} | {self.size} ranks ({extra['distributed']['strategy']}): "
                     f"cache {ranks} = {fmt_bytes(sum(held))}")

    def run(self) -> int:
        self.watchdog.watch_signals((signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
        self.watchdog.start()
        try:
            code = self.start()
            if code is None:
                code = self.lead() if self.rank == 0 else self.follow()
            if code or self.rank != 0:
                # Every rank knows the outcome. Leave now rather than through the interpreter's
                # shutdown, during which a SIGTERM from mlx.launch (sent as soon as a rank exits
                # non-zero) would no longer be ours to handle and would kill this rank.
                self.out.flush()
                self.err.flush()
                self._exit(code)
            return code
        except DistributedError as e:
            self.abort(str(e))
        except BrokenPipeError:
            self.abort("the output pipe closed")
        except RuntimeError as e:
            if not peer_error(e):
                raise
            lost = "rank 0" if self.rank else "another rank"
            self.abort(f"lost the connection to {lost} ({str(e).splitlines()[0]})")
        finally:
            self.watchdog.stop()
        return EXIT_PEER_LOST  # not reached: abort exits


class _Lines:
    """Rank 0's input: the -p prompt, or stdin lines read on a thread (so it can heartbeat)."""

    EOF = object()
    WAIT = object()

    def __init__(self, fixed: list[str] | None, stream: TextIO):
        self.q: queue.Queue = queue.Queue()
        if fixed is not None:
            for line in fixed:
                self.q.put(line)
            self.q.put(self.EOF)
        else:
            threading.Thread(target=self._read, args=(stream,), name="chatapp-stdin", daemon=True).start()

    def _read(self, stream: TextIO) -> None:
        try:
            for line in stream:
                self.q.put(line.rstrip("\n"))
        finally:
            self.q.put(self.EOF)

    def get(self, timeout: float):
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return self.WAIT


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        return default


def _config_from(values: dict, local):
    """Rank 0's settings (every section but [cpu], which stays this host's own)."""
    from chatapp.config import SECTIONS, Config

    sections = {}
    for name, cls in SECTIONS.items():
        if name == "cpu" or name not in values:
            sections[name] = getattr(local, name)
        else:
            sections[name] = cls(**values[name])
    return Config(**sections, sources=dict(local.sources))


def run_distributed(args, config, blas) -> int:
    """The CLI's entry point inside an ``mlx.launch`` job (or with ``--distributed``)."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        how = "--distributed needs" if getattr(args, "distributed", None) else "a distributed run needs"
        print(f"chatapp: error: {how} a job of 2 or more ranks; start it with mlx.launch, e.g. "
              "`mlx.launch --backend ring -n 2 -- chatapp --no-tui ...` (see docs/distributed.md)",
              file=sys.stderr)
        return EXIT_USER
    if group.rank() == 0 and args.prompt is None and not args.no_tui:
        print("chatapp: note: the terminal UI is not available in a distributed run; reading stdin "
              "(--no-tui)", file=sys.stderr)
    return DistributedJob(args, config, blas, group).run()
