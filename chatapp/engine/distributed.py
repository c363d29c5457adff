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

Stdin commands (rank 0, ``--no-tui``; :func:`parse_line` and :func:`apply_command` are meant to
be shared with the single-process loop so both behave the same)::

    /mode MODE [key=value ...]   switch the cache mode now (auto, concat, prealloc, quantized,
                                 window, window-quant); keys: window, sinks, evict_chunk,
                                 kv_bits, kv_group_size, max_kv_tokens, quant_start, chunk_size
    /set key=value [...]         change sampling: temp, top_p, top_k, min_p, max_tokens, seed
                                 (-1 = random), repetition_penalty
    /quit  (or /exit)            end the conversation; needed under mlx.launch, which never
                                 passes the end of its stdin on to the ranks
    //text                       a message that starts with "/" (the first "/" is dropped)

This module imports nothing from MLX at import time: the CLI calls :func:`launched` before an
optimised BLAS is loaded, and that must happen before ``mlx.core`` is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import queue
import random
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from .modelconfig import config_value

__all__ = [
    "CACHE_KEYS",
    "Command",
    "CommandError",
    "DistributedError",
    "EXIT_PEER_LOST",
    "SAMPLING_KEYS",
    "ShardError",
    "TICK_SECONDS",
    "apply_command",
    "check_heads",
    "check_shardable",
    "launched",
    "load_shard",
    "parse_line",
    "run_distributed",
    "world_from_env",
]

PROTOCOL = 1
TICK_SECONDS = 0.25  # rank 0's heartbeat while it waits for input
DEFAULT_TIMEOUT = 120.0  # seconds a command may go without progress before the watchdog stops
TIMEOUT_ENV = "CHATAPP_DIST_TIMEOUT"
EXIT_PEER_LOST = 3  # a rank was lost, hung, or the ranks diverged
EXIT_USER = 2
EXIT_CANCELLED = 130

# header ops
OP_NOOP, OP_QUIT, OP_CMD = 1, 2, 3
_ERR_BYTES = 480  # room for one error line per rank in the start-up report

CACHE_KEYS = ("window", "sinks", "evict_chunk", "kv_bits", "kv_group_size", "max_kv_tokens",
              "quant_start", "chunk_size")
SAMPLING_KEYS = ("temp", "top_p", "top_k", "min_p", "max_tokens", "seed", "repetition_penalty")
MODE_NAMES = ("auto", "concat", "prealloc", "quantized", "window", "window-quant", "scored")


# =============================================================================================
# Was this process started as a rank of a distributed job?  (no MLX here)


def world_from_env(env: dict[str, str] | None = None) -> tuple[int, int, str] | None:
    """(rank, size, backend) as the launcher told this process, or None outside a launched job.

    Read from the variables the launchers set: ``mlx.launch --backend ring`` exports
    ``MLX_RANK`` and ``MLX_HOSTFILE`` (a file holding a JSON list with one entry per rank; it is
    empty for a single host without ``-n``), ``--backend jaccl`` ``MLX_RANK`` and
    ``MLX_IBV_DEVICES`` (a JSON file, one row per rank), ``--backend nccl`` ``MLX_RANK`` and
    ``MLX_WORLD_SIZE``, and ``mpirun`` (``--backend mpi``) ``OMPI_COMM_WORLD_SIZE`` /
    ``PMI_SIZE`` with the matching rank variable.
    """
    env = os.environ if env is None else env

    def as_int(v: str | None) -> int | None:
        try:
            return int(v) if v is not None and v.strip() != "" else None
        except ValueError:
            return None

    def json_rows(path: str | None) -> int | None:
        if not path:
            return None
        try:
            text = Path(path).read_text(encoding="utf-8").strip()
        except OSError:
            return None
        if not text:
            return 1
        try:
            data = json.loads(text)
        except ValueError:
            return None
        return len(data) if isinstance(data, list) else None

    rank = as_int(env.get("MLX_RANK"))
    if rank is not None:
        if env.get("MLX_WORLD_SIZE"):
            size = as_int(env.get("MLX_WORLD_SIZE"))
            return (rank, size, "nccl") if size else None
        if env.get("MLX_IBV_DEVICES"):
            size = json_rows(env.get("MLX_IBV_DEVICES"))
            return (rank, size, "jaccl") if size else None
        if env.get("MLX_HOSTFILE"):
            size = json_rows(env.get("MLX_HOSTFILE"))
            return (rank, size, "ring") if size else None
    for size_var, rank_var in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK")):
        size = as_int(env.get(size_var))
        if size is not None:
            return (as_int(env.get(rank_var)) or 0, size, "mpi")
    return None


def launched(env: dict[str, str] | None = None) -> bool:
    """True inside a launched distributed job with more than one rank (imports no MLX)."""
    world = world_from_env(env)
    return world is not None and world[1] > 1


# =============================================================================================
# Stdin commands (no MLX here either)


class CommandError(ValueError):
    """A stdin command that cannot be run; ``str()`` is one line for the user."""


@dataclass
class Command:
    kind: str  # "send", "mode", "set", "quit"
    text: str = ""
    mode: str = ""
    changes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "text": self.text, "mode": self.mode, "changes": self.changes}

    @classmethod
    def from_json(cls, d: dict) -> "Command":
        return cls(d["kind"], d.get("text", ""), d.get("mode", ""), dict(d.get("changes") or {}))


def _number(key: str, raw: str, integer: bool) -> int | float:
    try:
        return int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise CommandError(f"{key}: must be {kind} (got {raw!r})") from None


def _pairs(words: list[str], allowed: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for w in words:
        key, eq, value = w.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key or not value:
            raise CommandError(f"{what}: expected key=value, got {w!r}")
        if key not in allowed:
            raise CommandError(f"{what}: unknown setting {key!r} (choose from {', '.join(allowed)})")
        out[key] = value.strip()
    return out


def _check_sampling(changes: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, raw in changes.items():
        integer = key in ("top_k", "max_tokens", "seed")
        v = _number(key, raw, integer)
        ok = {
            "temp": v >= 0,
            "top_p": 0 < v <= 1,
            "top_k": v >= 0,
            "min_p": 0 <= v < 1,
            "max_tokens": v >= 1,
            "seed": v >= -1,
            "repetition_penalty": v >= 1.0,
        }[key]
        if not ok:
            rule = {
                "temp": ">= 0", "top_p": "> 0 and <= 1", "top_k": ">= 0", "min_p": ">= 0 and < 1",
                "max_tokens": ">= 1", "seed": ">= 0, or -1 for random", "repetition_penalty": ">= 1.0",
            }[key]
            raise CommandError(f"{key}: must be {rule} (got {raw})")
        out[key] = v
    return out


def parse_line(line: str) -> Command | None:
    """One stdin line as a command; None for a blank line. Raises CommandError.

    ``/mode MODE [key=value ...]``, ``/set key=value ...``, ``//text`` (a message starting with
    "/"); anything else is a message to send.
    """
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    if line.startswith("//"):
        return Command("send", text=line[1:])
    if not line.startswith("/"):
        return Command("send", text=line)
    words = line[1:].split()
    name, args = (words[0].lower(), words[1:]) if words else ("", [])
    if name == "mode":
        if not args:
            raise CommandError(f"/mode: name a mode ({', '.join(MODE_NAMES)})")
        mode = args[0].lower()
        if mode not in MODE_NAMES:
            raise CommandError(f"/mode: unknown cache mode {args[0]!r} (choose from {', '.join(MODE_NAMES)})")
        raw = _pairs(args[1:], CACHE_KEYS, "/mode")
        changes = {k: _number(k, v, True) for k, v in raw.items()}
        return Command("mode", mode=mode, changes=changes)
    if name in ("quit", "exit"):
        if args:
            raise CommandError(f"/{name} takes no arguments")
        return Command("quit")
    if name == "set":
        if not args:
            raise CommandError(f"/set: give key=value ({', '.join(SAMPLING_KEYS)})")
        return Command("set", changes=_check_sampling(_pairs(args, SAMPLING_KEYS, "/set")))
    raise CommandError(f"unknown command /{name} (commands: /mode, /set, /quit; start a message with // "
                       "to send one that begins with '/')")


def validate_command(session, cmd: Command) -> None:
    """Refuse, before anything changes, a command this session cannot run (CommandError)."""
    if cmd.kind == "mode":
        from cache import CacheConfigError, check_settings

        target = "prealloc" if cmd.mode == "auto" else cmd.mode
        try:
            settings = session.base_settings.with_(mode=target, **cmd.changes)
            settings, _ = settings.fitted(session.geometry.max_positions)
            check_settings(settings, session.geometry)
        except CacheConfigError as e:
            raise CommandError(f"/mode {cmd.mode}: {e}") from None
        except TypeError as e:  # a key CacheSettings does not have
            raise CommandError(f"/mode {cmd.mode}: {e}") from None


def apply_command(session, cmd: Command) -> str:
    """Run a ``mode`` or ``set`` command on ``session``; returns the line to show the user.

    (``send`` commands are turns: the caller runs ``session.send(cmd.text)``.)
    """
    if cmd.kind == "mode":
        report = session.switch_mode(cmd.mode, **cmd.changes)
        return report.line()
    if cmd.kind == "set":
        changes = dict(cmd.changes)
        if "seed" in changes and changes["seed"] == -1:
            changes["seed"] = None
        session.generation = dataclasses.replace(session.generation, **changes)
        shown = ", ".join(f"{k}={cmd.changes[k]}" for k in cmd.changes)
        return f"sampling: {shown}"
    raise ValueError(f"apply_command does not run {cmd.kind!r} commands")


# =============================================================================================
# Errors


class DistributedError(Exception):
    """The job cannot go on (a rank lost or hung, ranks diverged); ``str()`` is one line."""


class ShardError(Exception):
    """The model cannot be sharded the way asked; ``str()`` is one line for the user."""


def _peer_error(e: BaseException) -> bool:
    """A failure of the communication backend (a peer died), as opposed to a bug."""
    text = str(e)
    return isinstance(e, RuntimeError) and (
        text.startswith(("[ring]", "[jaccl]", "[nccl]", "[mpi]", "[distributed]"))
        or "connection" in text.lower() or "peer" in text.lower()
    )


# =============================================================================================
# Sharding


_PIPELINE_TYPES_HINT = "deepseek_v2/v3, glm4_moe, qwen2, qwen3_moe, qwen3_next, ministral3, ..."




def _supports_pipeline(model) -> bool:
    return hasattr(model, "model") and hasattr(model.model, "pipeline")


def check_heads(config: dict, size: int, where: str = "the model", model=None) -> None:
    """Tensor parallelism splits the attention heads: both head counts must divide by ``size``.

    (mlx-lm's ``shard()`` divides them with ``//`` and would silently run a wrong model.)
    """
    heads = config_value(config, "num_attention_heads", "n_heads")
    kv = config_value(config, "num_key_value_heads", "n_kv_heads") or heads
    if heads is None and model is not None:
        attn = getattr(model.layers[0], "self_attn", None)
        heads = getattr(attn, "n_heads", None)
        kv = getattr(attn, "n_kv_heads", None) or heads
    if heads is not None and (int(heads) % size or int(kv) % size):
        fits = [n for n in range(2, int(kv) + 1) if int(heads) % n == 0 and int(kv) % n == 0]
        hint = f"use {' or '.join(map(str, fits))} ranks" if fits else "it cannot be split by heads at all"
        raise ShardError(
            f"cannot shard {where} over {size} ranks: tensor parallelism splits the attention heads, "
            f"and its {heads} query heads and {kv} KV heads must both divide by {size} ({hint})")


def check_shardable(model, config: dict, size: int, strategy: str, where: str = "the model") -> None:
    """Refuse, with one line, a model that cannot be split over ``size`` ranks this way."""
    model_type = config.get("model_type", "?")
    if strategy == "tensor":
        if not hasattr(model, "shard"):
            alt = ("; it can be pipelined: use --distributed pipeline" if _supports_pipeline(model)
                   else "; it cannot be pipelined either")
            raise ShardError(f"cannot shard {where} with tensor parallelism: mlx-lm's {model_type} "
                             f"model has no shard(){alt}")
        check_heads(config, size, where, model)
    elif strategy == "pipeline":
        if not _supports_pipeline(model):
            alt = ("use --distributed tensor" if hasattr(model, "shard")
                   else "it has no shard() for tensor parallelism either")
            raise ShardError(
                f"cannot pipeline {where}: mlx-lm implements pipeline parallelism only for some "
                f"architectures ({_PIPELINE_TYPES_HINT}), not {model_type}; {alt}")
        n_layers = len(model.model.layers)
        if n_layers < size:
            raise ShardError(f"cannot pipeline {where} over {size} ranks: it has only {n_layers} layers")
    else:
        raise ShardError(f"unknown sharding {strategy!r}: use tensor or pipeline")


def precheck_heads(spec: str, size: int) -> None:
    """Tensor parallelism on a local folder: refuse heads that do not divide, from config.json alone."""
    path = Path(str(spec)).expanduser()
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a repo id, or no readable config: the full check runs after loading
    if not isinstance(config, dict) or config_value(config, "num_attention_heads", "n_heads") is None:
        return
    check_heads(config, size, str(spec))


def default_strategy(model) -> str:
    """What a launched job uses without --distributed: tensor where possible (as sharded_load)."""
    if hasattr(model, "shard"):
        return "tensor"
    if _supports_pipeline(model):
        return "pipeline"
    return "tensor"  # check_shardable then says why it cannot


def _apply_shard(model, group, strategy: str, where: str):
    try:
        if strategy == "tensor":
            model.shard(group)
            return model
        model.model.pipeline(group)
        return _PipelineStage(model)
    except (ValueError, RuntimeError) as e:
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ShardError(f"cannot shard {where} over {group.size()} ranks ({strategy}): {first}") from None


@functools.lru_cache(maxsize=None)
def _pipeline_stage_class():
    import mlx.core as mx
    import mlx.nn as nn

    class _Tail:
        """The last local cache as mlx-lm's pipeline code sees it.

        mlx-lm's pipelined models make the rank's ``send`` a dependency of the last cache with
        ``cache[-1].keys = mx.depends(cache[-1].keys, h)``, so that evaluating the cache also
        sends. chatapp's caches keep their buffers privately (no ``keys`` attribute): this thin
        proxy takes the dependency instead, and :class:`_PipelineStage` evaluates it with the
        step. Everything else is the real cache.
        """

        def __init__(self, cache):
            object.__setattr__(self, "_cache", cache)
            object.__setattr__(self, "dep", None)

        @property
        def keys(self):
            return mx.zeros((1,))

        def __getattr__(self, name):
            return getattr(object.__getattribute__(self, "_cache"), name)

        def __setattr__(self, name, value):
            if name == "keys":  # mlx-lm's pipeline hook: keep the send as a dependency
                object.__setattr__(self, "dep", value)
            else:
                setattr(object.__getattribute__(self, "_cache"), name, value)

    class PipelineStage(nn.Module):
        """A pipelined mlx-lm model whose send is evaluated with every forward step."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        @property
        def layers(self):
            return self.inner.layers

        @property
        def args(self):
            return getattr(self.inner, "args", None)

        def __call__(self, inputs, cache=None, **kwargs):
            if not cache:
                return self.inner(inputs, cache=cache, **kwargs)
            tail = _Tail(cache[-1])
            out = self.inner(inputs, cache=[*cache[:-1], tail], **kwargs)
            if tail.dep is not None:
                mx.async_eval(tail.dep)  # schedule this rank's send now, even if only the cache is read
            return out

    return PipelineStage


def _PipelineStage(model):
    return _pipeline_stage_class()(model)


@dataclass
class ShardInfo:
    strategy: str
    rank: int
    size: int
    n_heads: int | None
    n_kv_heads: int | None  # of the whole model
    local_kv_heads: int | None  # held by this rank's cache
    local_layers: int


def load_shard(config, group, strategy: str | None):
    """Load this rank's shard of ``config.model.id``; returns (LoadedModel, ShardInfo).

    An mlx-lm folder (local, or a Hugging Face repo downloaded by chatapp's loader) is loaded
    lazily, sharded, and only then evaluated and cast, so each rank materialises only its own
    share of the weights (as mlx-lm's ``sharded_load`` does; it is not used itself because it
    needs a ``model.safetensors.index.json`` for pipelines and does not cast to chatapp's dtype).
    A legacy-npz folder goes through chatapp's loader whole, then is sharded.
    Raises ShardError or ModelLoadError with one line.
    """
    import mlx.core as mx

    from .device import DTYPES, cast_floating, checkpoint_float_dtype, dtype_name, pick_backend
    from .loader import (
        LoadedModel,
        ModelLoadError,
        available_memory_bytes,
        estimate_weight_bytes,
        find_weight_files,
        format_bytes,
        load_model,
        resolve_model_path,
        weights_fingerprint,
    )

    size = group.size()
    spec = config.model.id
    path, model_id = resolve_model_path(str(spec))
    where = str(spec) if Path(str(spec)).expanduser().is_dir() else f"{model_id} ({path})"
    fmt, files = find_weight_files(path)

    if fmt == "legacy-npz" and files:
        loaded = load_model(str(spec), dtype=config.model.dtype)
        strategy = strategy or default_strategy(loaded.model)
        check_shardable(loaded.model, loaded.config, size, strategy, where)
        model = _apply_shard(loaded.model, group, strategy, where)
        mx.eval(model.parameters())
        loaded.model = model
        lm_config = loaded.config
    else:
        missing = []
        if not (path / "config.json").is_file():
            missing.append("config.json")
        if not files:
            missing.append("weights (model*.safetensors)")
        if missing:
            raise ModelLoadError(f"{where} is missing {', '.join(missing)}")
        dtype = config.model.dtype
        target = pick_backend().activation_dtype if dtype == "auto" else DTYPES.get(dtype)
        try:
            from mlx_lm.utils import load_model as lm_load_model
            from mlx_lm.utils import load_tokenizer

            model, lm_config = lm_load_model(path, lazy=True)
            tokenizer = load_tokenizer(path, eos_token_ids=lm_config.get("eos_token_id"))
        except Exception as err:  # mlx-lm raises many kinds; the user needs one line
            first = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
            raise ModelLoadError(f"could not load {where}: {type(err).__name__}: {first}") from err
        strategy = strategy or default_strategy(model)
        check_shardable(model, lm_config, size, strategy, where)
        have = available_memory_bytes()
        need = estimate_weight_bytes(files, target) // size  # a lower bound: some tensors are replicated
        if have is not None and need > have:
            raise ModelLoadError(f"not enough memory for this rank's share of {where}: at least "
                                 f"{format_bytes(need)} but only {format_bytes(have)} is available")
        model = _apply_shard(model, group, strategy, where)
        final = target or checkpoint_float_dtype(model)
        cast_floating(model, final)  # evaluates: only this rank's share
        model.eval()
        max_pos = config_value(lm_config, "max_position_embeddings")
        loaded = LoadedModel(
            model=model, tokenizer=tokenizer, config=lm_config, model_id=model_id, path=path, format=fmt,
            dtype=dtype_name(final), weights_fingerprint=weights_fingerprint(files),
            has_chat_template=bool(getattr(tokenizer, "has_chat_template", False)),
            max_position_embeddings=int(max_pos) if max_pos is not None else None,
            n_kv_heads=None, head_dim=None, n_layers=None,
        )
    heads = config_value(lm_config, "num_attention_heads", "n_heads")
    kv = config_value(lm_config, "num_key_value_heads", "n_kv_heads") or heads
    layers = loaded.model.layers
    attn = getattr(layers[0], "self_attn", None) if len(layers) else None
    local_kv = getattr(attn, "n_kv_heads", None)
    loaded.n_kv_heads = local_kv
    loaded.n_layers = len(layers)
    loaded.head_dim = getattr(attn, "head_dim", None) or config_value(lm_config, "head_dim")
    info = ShardInfo(strategy, group.rank(), size, heads, kv, local_kv, len(layers))
    return loaded, info


# =============================================================================================
# Control channel, shared cancel flag, watchdog


class Watchdog:
    """Stops the process when a command makes no progress for ``timeout`` seconds.

    ``busy()`` / ``idle()`` bracket the work done in lock-step with the other ranks; ``beat()``
    marks progress (every collective that completes). A collective waiting on a hung peer never
    returns, so the check runs on its own thread and calls ``on_timeout(message)``, which must
    end the process. It also watches a signal wake-up pipe (see :meth:`watch_signals`), because
    a Python signal handler cannot run while the main thread is blocked inside a collective.
    """

    def __init__(self, timeout: float | None, on_timeout: Callable[[str], None],
                 on_signal: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 poll: float = 0.2):
        self.timeout = timeout if timeout and timeout > 0 else None
        self.on_timeout = on_timeout
        self.on_signal = on_signal
        self.clock = clock
        self.poll = poll
        self.what = ""
        self._busy = False
        self._last = clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r: int | None = None
        self._thread: threading.Thread | None = None

    def busy(self, what: str) -> None:
        with self._lock:
            self._busy, self.what, self._last = True, what, self.clock()

    def idle(self) -> None:
        with self._lock:
            self._busy = False

    def beat(self) -> None:
        self._last = self.clock()

    def stalled(self) -> float | None:
        """Seconds without progress if that is past the timeout while busy, else None."""
        with self._lock:
            if not self._busy or self.timeout is None:
                return None
            quiet = self.clock() - self._last
            return quiet if quiet > self.timeout else None

    def watch_signals(self, signals: tuple[int, ...]) -> None:
        """Route ``signals`` to ``on_signal`` on the watchdog thread (main thread only)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        for s in signals:
            signal.signal(s, lambda signum, frame: None)  # the wake-up fd carries it
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wake_r = r

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="chatapp-dist-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake_r is not None:
                ready, _, _ = select.select([self._wake_r], [], [], self.poll)
                if ready:
                    for b in os.read(self._wake_r, 64):
                        if self.on_signal is not None:
                            self.on_signal(b)
            else:
                self._stop.wait(self.poll)
            quiet = self.stalled()
            if quiet is not None:
                self.on_timeout(f"no progress for {quiet:.0f} s {self.what} (a rank hung or the network "
                                f"stalls; {TIMEOUT_ENV} sets the limit)")
                return


class Channel:
    """Rank 0 -> all messages and small all-rank exchanges, as MLX collectives."""

    def __init__(self, group, watchdog: Watchdog | None = None):
        import mlx.core as mx
        import numpy as np

        self._mx, self._np = mx, np
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.seq = 0
        self.watchdog = watchdog

    def _run(self, arr):
        mx = self._mx
        out = mx.distributed.all_sum(arr, group=self.group, stream=mx.cpu)
        mx.eval(out)
        if self.watchdog:
            self.watchdog.beat()
        return out

    def message(self, op: int = 0, payload: bytes = b"") -> tuple[int, bytes]:
        """Rank 0 sends (op, payload); every rank returns it."""
        mx, np = self._mx, self._np
        self.seq += 1
        if self.rank == 0:
            header = mx.array([op, len(payload), self.seq], dtype=mx.int64)
        else:
            header = mx.zeros((3,), dtype=mx.int64)
        op, n, seq = (int(v) for v in self._run(header).tolist())
        if seq != self.seq:
            raise DistributedError(f"ranks fell out of step (message {seq} from rank 0, expected {self.seq})")
        if n:
            if self.rank == 0:
                data = mx.array(np.frombuffer(payload, dtype=np.uint8))
            else:
                data = mx.zeros((n,), dtype=mx.uint8)
            payload = bytes(np.array(self._run(data), copy=False).tobytes())
        return op, payload

    def send_json(self, op: int, obj) -> None:
        self.message(op, json.dumps(obj).encode())

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        mx = self._mx
        return int(self._run(mx.array([1 if flag else 0], dtype=mx.int32)).item()) > 0

    def gather(self, row: list[int]):
        """Each rank's row of int64 values, on every rank (a list of lists)."""
        mx = self._mx
        out = mx.distributed.all_gather(mx.array([row], dtype=mx.int64), group=self.group, stream=mx.cpu)
        mx.eval(out)
        if self.watchdog:
            self.watchdog.beat()
        return [[int(v) for v in r] for r in out.tolist()]

    def gather_text(self, text: str) -> list[str]:
        """One short line from each rank, on every rank."""
        mx, np = self._mx, self._np
        raw = text.encode("utf-8")[:_ERR_BYTES]
        buf = np.zeros((1, _ERR_BYTES), dtype=np.uint8)
        buf[0, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        out = mx.distributed.all_gather(mx.array(buf), group=self.group, stream=mx.cpu)
        mx.eval(out)
        rows = np.array(out)
        return [bytes(r).rstrip(b"\0").decode("utf-8", errors="replace") for r in rows]


class SharedCancel:
    """Session's cancel flag made collective: every check ``all_sum``-s the local flags.

    Session checks its flag at the same points on every rank (after each prefill chunk and
    before each decode step), so the collectives pair up, and a Ctrl-C on any rank stops the
    reply on all of them at the same token.
    """

    def __init__(self, channel: Channel):
        self.channel = channel
        self.local = threading.Event()

    def set(self) -> None:
        self.local.set()

    def clear(self) -> None:
        self.local.clear()

    def is_set(self) -> bool:
        return self.channel.any(self.local.is_set())


# =============================================================================================
# The job


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
        self.info: ShardInfo | None = None
        self.stats_file: TextIO | None = None
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
        msgs = [m for m in self.session.conversation.messages if m.role != "system"]
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
                    if self.stats_file:
                        self.stats_file.flush()
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
            from .setup import session_from_config

            loaded, self.info = load_shard(self.config, self.group, hello.get("strategy"))
            self.session = session_from_config(self.config, loaded)
            self.session._cancel = SharedCancel(self.channel)
        except ShardError as e:
            error = str(e)
        except Exception as e:
            if type(e).__name__ not in ("SetupError", "ModelLoadError", "CacheConfigError"):
                raise
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
        from .generate import TokenEvent, TurnDone

        s = self.session
        shown = None
        if cmd.kind == "send":
            self.turn_no += 1
            s.generation = dataclasses.replace(s.generation, seed=seed)
            done = None
            for ev in s.send(cmd.text):
                if self.rank == 0 and isinstance(ev, TokenEvent) and ev.text:
                    self.out.write(self.safe(ev.text))
                    self.out.flush()
                    self.partial = True
                elif isinstance(ev, TurnDone):
                    done = ev
                    if self.rank == 0:
                        self.out.write("\n")
                        self.out.flush()
                        self.partial = False
            shown = done
        else:
            try:
                shown = apply_command(s, cmd)
            except Exception as e:  # validated on rank 0 first; every rank fails the same way
                if type(e).__name__ != "CacheConfigError":
                    raise
                shown = e
        return shown, self._sync()

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
        from ..textsafe import printable
        from .generate import TurnDone

        args = self.args
        s = self.session
        if args.verbose and self.blas is not None:
            self.say(f"{self.blas.describe() if hasattr(self.blas, 'describe') else self.blas}")
        for note in s.notices:
            self.say(f"note: {note}")
        self.safe = printable if self.out.isatty() else (lambda t: t)
        if args.stats_json:
            self.stats_file = open(args.stats_json, "a", encoding="utf-8")
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
                        s._cancel.clear()
                        return self._quit(EXIT_CANCELLED)
                elif isinstance(shown, str):
                    self.say(shown)
                elif shown is not None:
                    self.say(f"error: {shown}")
        finally:
            if self.stats_file:
                self.stats_file.close()
                self.stats_file = None

    def _report(self, done, state: RankState) -> None:
        from .stats import fmt_bytes

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
        if self.stats_file:
            d = done.stats.to_json()
            d.update(extra)
            self.stats_file.write(json.dumps(d) + "\n")
            self.stats_file.flush()
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
            if not _peer_error(e):
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
    from ..config import SECTIONS, Config

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

