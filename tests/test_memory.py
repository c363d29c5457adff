"""MLX memory gauges in the turn statistics, and the [memory] limits."""

from __future__ import annotations

import mlx.core as mx
import pytest

from chatapp.config import ConfigError, load_config
from chatapp.engine.generate import GenerationSettings, run_turn
from chatapp.engine.memory import MemoryLimits, apply_limits, memory_total, read_gauges
from chatapp.engine.session import Session
from chatapp.engine.stats import TurnStats
from tests.conftest import tiny_llama


def tiny_session(**kw) -> Session:
    from chatapp.model.synthetic import byte_tokenizer

    return Session(tiny_llama(layers=2), byte_tokenizer(), generation=GenerationSettings(temp=0.0, max_tokens=20),
                   **kw)


def test_a_turn_records_plausible_gauges_and_their_trace():
    s = tiny_session(mode="prealloc")
    done = run_turn(s.send("x" * 700))  # two prefill chunks, then 20 decoded tokens
    g = done.stats.memory
    assert 0 < g.total == memory_total()
    assert 0 < g.active <= g.peak < g.total and g.cache >= 0
    assert g.kv_held == done.stats.cache.bytes_held > 0 and g.peak >= g.kv_held  # the KV is part of what MLX holds
    assert g.tokens == len(s.cached)
    trace = done.stats.memory_trace
    # a reading after the first prefill chunk, one every 8 decoded tokens, one at the end
    assert len(trace) == 1 + 3 + 1 and trace[-1] == g
    assert [r.tokens for r in trace] == sorted(r.tokens for r in trace)
    assert all(r.peak <= g.peak and r.active <= r.peak for r in trace)
    js = done.stats.to_json()
    assert js["memory"]["active"] == g.active and js["peak_memory"] >= g.peak
    for key in ("active_share", "cache_share", "peak_share", "kv_held_share"):
        assert 0 <= js["memory"][key] < 1
    assert js["memory"]["peak_share"] == pytest.approx(g.peak / g.total)
    assert len(js["memory_trace"]) == len(trace) and "memory_trace" not in done.stats.to_json(with_steps=False)


def test_the_peak_is_the_turns_own():
    s = tiny_session(mode="prealloc")
    big = mx.zeros((64, 1 << 20))  # 256 MiB held and freed before the turn
    mx.eval(big)
    del big
    done = run_turn(s.send("hello"))
    assert done.stats.memory.peak < 256 << 20


def test_gauges_off_reads_nothing():
    s = tiny_session(mode="prealloc")
    s.gauges = False
    done = run_turn(s.send("hello"))
    assert done.stats.memory_trace == [] and done.stats.memory.active == 0


def test_memory_summary_line():
    stats = TurnStats()
    stats.memory = read_gauges()
    assert " | MLX " in stats.short() and " peak" in stats.short()


def test_cache_limit_works_on_this_backend_and_memory_limit_is_said_to_throttle():
    old_cache = mx.set_cache_limit(1 << 30)
    old_memory = mx.get_memory_limit()
    try:
        notes = apply_limits(MemoryLimits(limit_mb=0, cache_limit_mb=0), "cpu")
        assert notes == ["memory.cache_limit_mb = 0: no buffer cache: freed buffers go back to the system at once"]
        a = mx.zeros((1 << 20,))
        mx.eval(a)
        del a
        assert mx.get_cache_memory() == 0
        notes = apply_limits(MemoryLimits(limit_mb=64, cache_limit_mb=-1), "cpu")
        assert mx.get_memory_limit() == 64 << 20
        assert len(notes) == 1 and "a throttle, not a cap" in notes[0]
        # ... and it does not refuse an allocation past it on the CPU
        b = mx.zeros((32 << 20,))  # 128 MiB
        mx.eval(b)
        assert mx.get_active_memory() >= 128 << 20
        del b
        assert apply_limits(MemoryLimits(), "cpu") == []  # the defaults change nothing
    finally:
        mx.set_cache_limit(old_cache)
        mx.set_memory_limit(old_memory)


def test_memory_settings_are_checked():
    cfg = load_config(overrides={"memory.limit_mb": "512", "memory.cache_limit_mb": "0"})
    assert (cfg.memory.limit_mb, cfg.memory.cache_limit_mb) == (512, 0)
    assert load_config().memory.cache_limit_mb == -1
    with pytest.raises(ConfigError, match="memory.cache_limit_mb: must be an integer >= -1"):
        load_config(overrides={"memory.cache_limit_mb": "-2"})
    with pytest.raises(ConfigError, match="data.prefix_cap_mb: must be an integer >= 0"):
        load_config(overrides={"data.prefix_cap_mb": "-1"})
