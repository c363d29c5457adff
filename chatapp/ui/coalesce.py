"""Updates merged to a steady rate: a streamed reply asks for a status-bar rebuild per token (tens to
hundreds a second); the bar is rebuilt at most once per interval, always with the newest figures.

The first request after a quiet interval runs at once (the first token's TTFT shows without
waiting); requests inside the interval only mark the update pending, and ``tick`` (a timer, far
more often than the interval) runs it once the interval has passed, so the last figures of a burst
are never lost. ``now`` runs it at once whatever the rate (a reply's end, a mode switch). Plain
Python with an injectable clock, so the rate is tested without Textual or a real clock
(toolong merges its per-line messages for the same reason: ``can_replace``).
"""

from __future__ import annotations

import time
from typing import Callable

STATUS_INTERVAL = 0.2  # seconds between status-bar rebuilds while a reply streams: five a second


class Coalescer:
    def __init__(self, update: Callable[[], None], interval: float = STATUS_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._update = update
        self.interval = interval
        self._clock = clock
        self._last: float | None = None  # when the update last ran
        self.pending = False  # asked for since it last ran
        self.runs = 0  # how many times it ran (tests, debugging)

    def request(self) -> None:
        """New figures: run the update now if the interval has passed since the last run, else later."""
        if self._last is None or self._clock() - self._last >= self.interval:
            self.now()
        else:
            self.pending = True

    def tick(self) -> None:
        """The timer: run a pending update once its interval has passed."""
        if self.pending and (self._last is None or self._clock() - self._last >= self.interval):
            self.now()

    def now(self) -> None:
        """Run the update at once (it counts as the interval's run)."""
        self.pending = False
        self._last = self._clock()
        self.runs += 1
        self._update()
