"""A first start compiles the CPU kernels for most of a minute: the user is told while it runs
(CLI note, loading screen, model dialog) and after (a load note), and a warm start says nothing."""

from __future__ import annotations

import time

import pytest
from fused_llama import _no_leftover_kernels, clear_kernels, small_llama  # noqa: F401 - the autouse fixture

from chatapp.backend import warmup
from chatapp.backend.cpu import apply_fast_path
from chatapp.backend.warmup import announce_when_slow, compiled_line, compiling_line
from chatapp.engine.setup import load_notices


def test_a_slow_block_is_announced_then_renewed_with_the_time_so_far():
    lines = []
    with announce_when_slow(lines.append, after_s=0.05, every_s=0.05):
        time.sleep(0.3)
    assert len(lines) >= 3
    assert lines[0] == compiling_line() and "so far" not in lines[0]
    assert all("s so far" in line for line in lines[1:])
    n = len(lines)
    time.sleep(0.15)
    assert len(lines) == n  # the helper ended with the block


def test_a_quick_block_and_no_listener_say_nothing():
    lines = []
    with announce_when_slow(lines.append, after_s=1.0, every_s=1.0):
        pass
    assert lines == []
    with announce_when_slow(None, after_s=0.0):
        time.sleep(0.01)


def test_the_helper_ends_when_the_block_raises():
    lines = []
    with pytest.raises(RuntimeError), announce_when_slow(lines.append, after_s=0.01, every_s=0.01):
        time.sleep(0.05)
        raise RuntimeError("a load that fails")
    n = len(lines)
    time.sleep(0.05)
    assert n >= 1 and len(lines) == n


def test_the_fast_path_warm_up_reports_through_on_slow_warm_up(monkeypatch):
    """apply_fast_path's warm-up (the kernels and the fused step) runs inside the notice: with the
    threshold at 0 it is announced; without warm_up nothing is."""
    monkeypatch.setattr(warmup, "SLOW_WARM_UP_S", 0.0)
    lines = []
    plan = apply_fast_path(small_llama(), backend="cpu", warm_up=True, on_slow_warm_up=lines.append)
    assert plan.kernel_layers and plan.fused_decode.startswith("fused decode: one native call")
    assert lines and lines[0] == compiling_line()
    assert plan.warm_up_seconds > 0
    clear_kernels()
    quiet = []
    apply_fast_path(small_llama(), backend="cpu", warm_up=False, on_slow_warm_up=quiet.append)
    assert quiet == []


class _Loaded:
    def __init__(self, plan):
        self.cpu_plan = plan
        self.notes = []


def test_a_slow_warm_up_leaves_a_load_note_and_a_quick_one_none(monkeypatch):
    plan = apply_fast_path(small_llama(), backend="cpu", warm_up=False)
    plan.warm_up_seconds = 48.6
    assert compiled_line(48.6) in load_notices(_Loaded(plan))
    assert "49 s" in compiled_line(48.6)
    plan.warm_up_seconds = 0.4
    assert not any("CPU kernels ready" in n for n in load_notices(_Loaded(plan)))
