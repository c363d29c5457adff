"""The fused prefill kernel compiled in a second process on a first start (backend/precompile.py):
the child leaves it in numba's disk cache and the app's own prefill then loads it, compiling
nothing; where it is cached already, or there is one core, no child starts."""

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
    plan = apply_fast_path(small_llama(), backend="cpu", warm_up=True)
    assert plan.fused_decode.startswith("fused decode: one native call"), plan.fused_decode
    (types, child), = started
    print("types", types)
    print("child", None if child is None else child.returncode)
    print("compiled here", sum(prefill_step.stats.cache_misses.values()))
    print("loaded", sum(prefill_step.stats.cache_hits.values()))
    print("cached now", precompile.prefill_cached())
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
