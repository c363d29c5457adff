"""The fused prefill kernel compiled in a second process on a first start (backend/precompile.py):
the child leaves it in numba's disk cache and the app's own prefill then loads it, compiling
nothing; where it is cached already, or there is one core, no child starts. The cache
maintenance kernels compile ahead too (in the child, or in the warm-up where numba's cache lacks
them), so that no turn of a session waits for them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chatapp.backend import precompile
from chatapp.backend.precompile import PrefillTypes, start_prefill_compile, wait_for
from chatapp.kernels import pool
from chatapp.kernels.pool import usable_cores

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with an empty numba cache: the app's warm-up on the small fused
# Llama, recording the child it starts; then whether this process compiled prefill_step itself.
_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from chatapp.backend import precompile
    started = []
    real = precompile.start_prefill_compile
    def recording(types):
        child = real(types)
        started.append((types, child))
        return child
    precompile.start_prefill_compile = recording
    from fused_llama import small_llama
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.kernels.prefill_step import prefill_step
    plan_model = small_llama()
    plan = apply_fast_path(plan_model, backend="cpu", warm_up=True)
    assert plan.fused_decode.startswith("fused decode: one native call"), plan.fused_decode
    (types, child), = started
    print("types", types)
    print("child", None if child is None else child.returncode)
    print("compiled here", sum(prefill_step.stats.cache_misses.values()))
    print("loaded", sum(prefill_step.stats.cache_hits.values()))
    print("cached now", precompile.prefill_cached())
    # a session on policies whose first flush, eviction and votes compile nothing (other settings
    # than run_policies' own: 4-bit middle, larger window and chunks)
    import mlx.core as mx
    from numba.core.registry import CPUDispatcher
    from cache import CacheSettings
    from cache.factory import make_caches
    from chatapp.kernels import kv_rows, softmax_lanes
    kernels = [f for m in (kv_rows, softmax_lanes) for f in vars(m).values() if isinstance(f, CPUDispatcher)]
    def compiled():
        return sum(sum(f.stats.cache_misses.values()) for f in kernels)
    before = compiled()
    model = plan_model
    dec = model._chatapp_fused
    for mode in ("window", "window-quant", "scored-quant"):
        caches = make_caches(model, CacheSettings(mode=mode, sinks=4, window=32, evict_chunk=16, max_kv_tokens=96,
                                                  quant_start=32, kv_bits=4, kv_group_size=32))
        for start in range(0, 128, 16):
            dec.prefill(mx.array(list(range(start, start + 16))), caches)
        for t in range(24):
            dec.step(t, caches)
        assert sum(caches[0].evicted_by.values()) > 0, mode
    print("session compiled", compiled() - before)
""")


@pytest.mark.skipif(usable_cores() < 2, reason="the child only starts with a second core")
def test_a_first_start_compiles_the_prefill_in_a_child_and_loads_it(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(tests=str(ROOT / "tests"))], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = {k: v for k, v in (line.rsplit(" ", 1) for line in out.stdout.splitlines())}
    assert lines["child"] == "0", out.stdout  # the child ran and compiled
    assert lines["compiled here"] == "0" and int(lines["loaded"]) >= 1, out.stdout
    assert lines["cached now"] == "True"
    assert lines["session compiled"] == "0", out.stdout


def test_no_child_where_the_kernel_is_cached_or_on_one_core(monkeypatch):
    types = PrefillTypes("float16", "float16", "fast")
    monkeypatch.setattr(precompile, "prefill_cached", lambda: True)
    assert start_prefill_compile(types) is None
    monkeypatch.setattr(precompile, "prefill_cached", lambda: False)
    monkeypatch.setattr(pool, "usable_cores", lambda: 1)
    assert start_prefill_compile(types) is None
    assert wait_for(None) is False


def test_a_child_that_fails_or_hangs_is_only_a_lost_speed_up():
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert wait_for(failing) is False
    hanging = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert wait_for(hanging, timeout_s=0.2) is False and hanging.returncode is not None


@pytest.mark.parametrize("cached", [False, True])
def test_the_warm_up_runs_the_policies_maintenance_where_numba_lacks_it(cached, monkeypatch):
    """Where numba's disk cache lacks the maintenance kernels, install_fused_decode runs the
    evicting policies through a few dozen tokens (precompile.run_policies), and that run reaches
    every native maintenance operation a session uses; where they are cached, it does not run."""
    from chatapp.backend import fused_install
    from chatapp.backend.kv_native import NativeRowOps
    from tests.fused_llama import small_llama

    done: dict[str, int] = {}
    real = NativeRowOps._count

    def counting(self, name, ok):
        if ok:
            done[name] = done.get(name, 0) + 1
        return real(self, name, ok)

    monkeypatch.setattr(NativeRowOps, "_count", counting)
    monkeypatch.setattr(fused_install, "maintenance_cached", lambda: cached)
    model = small_llama()
    fused_install.install_fused_decode(model, warm_up=True, kv_dtype="float16")
    ops = model._chatapp_fused.row_ops
    assert not ops.done and not ops.declined  # what --verbose reports: the session's own, none yet
    if cached:
        assert not done
        return
    for op in ("flush", "remove", "remove_front", "rotate", "select", "votes"):
        assert done.get(op, 0) > 0, (op, done)
