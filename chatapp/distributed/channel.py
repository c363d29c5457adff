"""The control channel between the ranks: MLX collectives, the shared cancel flag and the watchdog.

See :mod:`chatapp.distributed.job` for the protocol."""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
from typing import Callable

PROTOCOL = 1
TICK_SECONDS = 0.25  # rank 0's heartbeat while it waits for input
DEFAULT_TIMEOUT = 120.0  # seconds a command may go without progress before the watchdog stops
TIMEOUT_ENV = "CHATAPP_DIST_TIMEOUT"

# header ops
# header ops
OP_NOOP, OP_QUIT, OP_CMD = 1, 2, 3
_ERR_BYTES = 480  # room for one error line per rank in the start-up report


class DistributedError(Exception):
    """The job cannot go on (a rank lost or hung, ranks diverged); ``str()`` is one line."""



def peer_error(e: BaseException) -> bool:
    """A failure of the communication backend (a peer died), as opposed to a bug."""
    text = str(e)
    return isinstance(e, RuntimeError) and (
        text.startswith(("[ring]", "[jaccl]", "[nccl]", "[mpi]", "[distributed]"))
        or "connection" in text.lower() or "peer" in text.lower()
    )




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
