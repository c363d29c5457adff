"""Status updates at a steady rate (ui/coalesce.py): the coalescer on a fake clock, and the app's
status bar rebuilt a few times a second while a reply of hundreds of tokens streams."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from chatapp.ui.coalesce import Coalescer


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(interval: float = 0.2):
    clock, seen = FakeClock(), []
    c = Coalescer(lambda: seen.append(clock.t), interval, clock)
    return c, clock, seen


def test_the_first_request_runs_at_once_and_a_burst_runs_once_more_at_the_interval():
    c, clock, seen = make()
    c.request()
    assert seen == [0.0]  # the first token's figures show without waiting
    for _ in range(100):  # a burst of tokens inside the interval
        clock.t += 0.001
        c.request()
        c.tick()
    assert seen == [0.0] and c.pending
    clock.t = 0.2
    c.tick()
    assert seen == [0.0, 0.2] and not c.pending  # the newest figures of the burst, once
    c.tick()
    clock.t = 1.0
    c.tick()
    assert seen == [0.0, 0.2]  # nothing pending: the timer alone runs nothing


def test_now_runs_at_once_and_restarts_the_interval():
    c, clock, seen = make()
    c.request()
    clock.t = 0.05
    c.request()
    c.now()  # the reply ended: its final figures now
    assert seen == [0.0, 0.05] and not c.pending
    clock.t = 0.1
    c.request()  # inside the interval that now() started
    assert seen == [0.0, 0.05] and c.pending


@given(st.lists(st.floats(min_value=0.0, max_value=0.05), min_size=1, max_size=400))
def test_runs_are_spaced_by_the_interval_and_the_last_request_is_never_lost(gaps):
    """Requests at any times, a timer every 10 ms: no two runs closer than the interval, and one run
    at or after the last request (so the bar ends on the newest figures)."""
    c, clock, seen = make(0.2)
    next_tick = 0.0
    for gap in gaps:
        clock.t += gap
        while next_tick <= clock.t:
            saved, clock.t = clock.t, next_tick
            c.tick()
            clock.t = saved
            next_tick += 0.01
        c.request()
    last_request = clock.t
    for _ in range(30):  # the timer keeps running after the burst
        clock.t += 0.01
        c.tick()
    assert all(b - a >= 0.2 - 1e-9 for a, b in zip(seen, seen[1:]))
    assert seen[-1] >= last_request and not c.pending
    assert len(seen) <= 1 + (last_request + 0.2) / 0.2 + 1


def test_the_status_bar_is_rebuilt_a_few_times_a_second_while_a_reply_streams(stories4_path):
    """Pilot: a reply of hundreds of tokens rebuilds the status bar at the coalescer's rate, not
    once per token, and the bar ends on the finished turn's figures."""
    import time

    import pytest

    pytest.importorskip("textual")
    from test_ui import async_test, make_app, ready, type_and_send, wait_until

    from chatapp.ui.widgets import StatusBar

    @async_test
    async def run():
        app = make_app(stories4_path, **{"sampling.max_tokens": 400, "sampling.ignore_eos": True})
        async with app.run_test() as pilot:
            await ready(pilot)
            bar = app.query_one(StatusBar)
            rebuilds: list[float] = []
            real_set_items = bar.set_items

            def counting(items):
                rebuilds.append(time.monotonic())
                real_set_items(items)

            bar.set_items = counting
            await type_and_send(pilot, "Once upon a time", wait=False)
            await wait_until(pilot, lambda: "TokenEvent" in app.engine.event_log, what="the first token")
            first = time.monotonic()
            await wait_until(pilot, lambda: len(app.engine.history) == 1 and not app.engine.busy, what="the reply")
            last = time.monotonic()
            tokens = app.engine.event_log.count("TokenEvent")
            assert app.engine.last_stats.generated_tokens == 400 and tokens >= 400
            streaming = [t for t in rebuilds if first <= t <= last]
            # At most one per interval (plus the reply's end and the Idle after it), whatever the machine's speed.
            interval = app.engine.status_rate.interval
            assert len(streaming) <= (last - first) / interval + 4, (len(streaming), last - first)
            assert len(streaming) < tokens / 4
            # The bar ends on the finished turn (its cache holds the prompt and all 400 tokens).
            held = app.engine.last_stats.cache.tokens
            assert held >= 400 and f"cache {held:,}/" in bar.plain and not app.engine.status_rate.pending

    run()
