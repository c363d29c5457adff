"""The start bench's probe: the TUI says when it reached a milestone of its start, and exits.

``chatapp bench start`` (bench/start_bench.py) launches the TUI in a process of its own with
``CHATAPP_EXIT_AT`` set to one of MILESTONES and ``CHATAPP_T0`` to the launch's ``time.time()``:

- ``input``: the chat screen is painted with the input box focused (what a user waits for
  before typing; the model goes on loading under it);
- ``ready``: the model is loaded and the session prepared (a message would be answered now).

The app then writes ``chatapp-start <milestone> <seconds since launch>`` to stderr and leaves at
once (``os._exit``: the timing must not wait for the engine thread). Unset, nothing happens.
"""

from __future__ import annotations

import os
import sys
import time

ENV_AT = "CHATAPP_EXIT_AT"
ENV_T0 = "CHATAPP_T0"
MILESTONES = ("input", "ready")
LINE = "chatapp-start"


def active() -> bool:
    """Whether this process is a start bench's probe (then the TUI runs headless)."""
    return os.environ.get(ENV_AT) in MILESTONES


def reached(milestone: str) -> None:
    """Report ``milestone`` and exit when it is the one the bench waits for."""
    if os.environ.get(ENV_AT) != milestone:
        return
    seconds = time.time() - float(os.environ.get(ENV_T0, "nan"))
    sys.stderr.write(f"{LINE} {milestone} {seconds:.3f}\n")
    sys.stderr.flush()
    os._exit(0)
