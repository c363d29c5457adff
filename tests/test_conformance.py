"""Conformance with mlx-lm itself, driven by its model registry.

For every architecture the installed mlx-lm ships (tests/tiny_archs.py builds a tiny random
model of each) and every chatapp cache mode: the logits over a sequence longer than any sliding
window or attention chunk in the tiny configs (prefill in two chunks, then single-token decode
steps) equal those of mlx-lm's own ``make_prompt_cache``, or the mode is refused when the caches
are made, with one line. The settings keep the evicting modes below their budget (eviction
changes what the model sees by design; test_cache.py covers it) while the quantising modes
really quantise. The table is printed (``pytest -s`` or on failure); a new architecture
shows up as a skipped row with the reason, and any mismatch or crash fails.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from cache import MODES, CacheConfigError, CacheSettings, make_caches
from tests.tiny_archs import SLIDING, build, registry

PREFILL = (7, 6)  # two prefill chunks, the second starting at an offset (masks with an offset)
DECODE = 7  # then single-token steps: 20 tokens in all, past every window of SLIDING
# Relative error allowed (max |diff| over max |logit|): full precision is the same arithmetic up
# to the order of operations; quantised keeps 8-bit K/V of the tokens it has flushed.
TOLERANCE = {"full": 1e-4, "quant": 5e-2}

SETTINGS = CacheSettings(sinks=2, window=4, evict_chunk=4, quant_start=4, max_kv_tokens=128, kv_group_size=32)


def settings_for(mode: str) -> CacheSettings:
    if mode == "window":  # budget sinks + window: keep it above the sequence so nothing is evicted
        return SETTINGS.with_(mode=mode, window=64)
    return SETTINGS.with_(mode=mode)


def tokens() -> list[int]:
    n = sum(PREFILL) + DECODE
    return [(7 * i + 3) % 120 + 1 for i in range(n)]


def run(model, caches) -> mx.array:
    """Logits at every position, fed as the chat feeds them: chunks, then one token at a time."""
    seq, outs, done = tokens(), [], 0
    for n in PREFILL:
        outs.append(model(mx.array([seq[done : done + n]]), cache=caches)[0])
        done += n
        mx.eval(outs[-1])
    while done < len(seq):
        outs.append(model(mx.array([seq[done : done + 1]]), cache=caches)[0])
        done += 1
        mx.eval(outs[-1])
    return mx.concatenate(outs, axis=0).astype(mx.float32)


def mlx_quant_error(model, ref: mx.array, scale: float) -> float:
    """The relative error of mlx-lm's own 8-bit KV quantisation (``QuantizedKVCache`` in the
    full-attention slots) on this model; 0 where mlx-lm's own cannot run it."""
    caches = [QuantizedKVCache(group_size=SETTINGS.kv_group_size, bits=SETTINGS.kv_bits) if type(c) is KVCache else c
              for c in make_prompt_cache(model)]
    try:
        return float(mx.abs(run(model, caches) - ref).max().item()) / scale
    except Exception:  # noqa: BLE001 - e.g. a model that hands fetched K/V to another cache's attention
        return 0.0


@dataclass
class Row:
    arch: str
    mode: str
    result: str  # "agree", "refused", "skipped", "MISMATCH", "CRASH"
    detail: str = ""


def conform(name: str) -> list[Row]:
    arch = build(name)
    if arch.model is None:
        return [Row(name, "*", "skipped", arch.skipped)]
    model = arch.model
    try:
        ref = run(model, make_prompt_cache(model))
    except Exception as e:  # noqa: BLE001 - mlx-lm's own run failing on the tiny config
        return [Row(name, "*", "skipped", f"mlx-lm's own cache: {type(e).__name__}: {str(e)[:80]}")]
    scale = max(float(mx.abs(ref).max().item()), 1e-6)
    own_quant = None  # measured when a quantised mode needs it
    rows = []
    for mode in MODES:
        settings = settings_for(mode)
        try:
            caches = make_caches(model, settings)
        except CacheConfigError as e:
            line = str(e)
            rows.append(Row(name, mode, "refused" if "\n" not in line and line else "CRASH", line))
            continue
        except Exception as e:  # noqa: BLE001 - a raw exception at start is a failure, not a refusal
            rows.append(Row(name, mode, "CRASH", f"at start: {type(e).__name__}: {str(e)[:100]}"))
            continue
        try:
            got = run(model, caches)
        except Exception as e:  # noqa: BLE001 - the row records it
            first = str(e).splitlines()[0][:120] if str(e) else ""
            rows.append(Row(name, mode, "CRASH", f"{type(e).__name__}: {first}"))
            continue
        err = float(mx.abs(got - ref).max().item()) / scale
        tol = TOLERANCE["full"]
        if settings.quantizes:  # no worse than twice mlx-lm's own 8-bit KV (MoE routing amplifies it)
            tol = TOLERANCE["quant"]
            if err > tol:
                own_quant = mlx_quant_error(model, ref, scale) if own_quant is None else own_quant
                tol = max(tol, 2 * own_quant)
        ok = err <= tol and got.shape == ref.shape
        rows.append(Row(name, mode, "agree" if ok else "MISMATCH", f"rel err {err:.2g} (tol {tol:g})"))
    return rows


def table(rows: list[Row]) -> str:
    by_arch: dict[str, list[Row]] = {}
    for r in rows:
        by_arch.setdefault(r.arch, []).append(r)
    lines = [f"{'architecture':<24} " + " ".join(f"{m:<12}" for m in MODES)]
    for arch, rs in by_arch.items():
        if rs[0].mode == "*":
            lines.append(f"{arch:<24} skipped: {rs[0].detail}")
            continue
        cells = {r.mode: r.result for r in rs}
        lines.append(f"{arch:<24} " + " ".join(f"{cells.get(m, '-'):<12}" for m in MODES))
    counts = Counter()
    for arch, rs in by_arch.items():
        results = {r.result for r in rs}
        if "skipped" in results:
            counts["skipped"] += 1
        elif results & {"MISMATCH", "CRASH"}:
            counts["failing"] += 1
        elif results == {"agree"}:
            counts["every mode agrees"] += 1
        else:
            counts["agree or refused"] += 1
    lines.append("architectures: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" (of {len(by_arch)})")
    modes = Counter(r.result for r in rows if r.mode != "*")
    lines.append("modes: " + ", ".join(f"{k} {v}" for k, v in sorted(modes.items())))
    details = [f"  {r.arch} / {r.mode}: {r.result}: {r.detail}" for r in rows
               if r.result in ("refused", "MISMATCH", "CRASH")]
    return "\n".join(lines + ["details:"] + details)


@pytest.fixture
def cpu_attention_kernels():
    """The attention kernels the CPU backend installs process-wide (apply_fast_path), where numba
    is: every architecture's attention meets them in the app, so it meets them here (values
    narrower than keys, multi-head latent attention, once crashed the decode kernel)."""
    try:
        import numba  # noqa: F401

        from chatapp.backend.cpu_attention import install_prefill_attention
        from chatapp.backend.decode_attention import install_decode_attention
    except ImportError:
        yield
        return
    from cache import set_decode_kernels, set_prefill_kernel

    install_prefill_attention("cpu")
    install_decode_attention(True)
    yield
    set_decode_kernels(None, None)
    set_prefill_kernel(None)


@pytest.mark.slow
def test_every_mlx_lm_architecture_agrees_with_mlx_lm_or_is_refused(cpu_attention_kernels):
    t0 = time.perf_counter()
    rows = [r for name in registry() for r in conform(name)]
    report = table(rows)
    print(f"\n{report}\n({time.perf_counter() - t0:.1f} s)")
    bad = [r for r in rows if r.result in ("MISMATCH", "CRASH")]
    assert not bad, "\n".join(f"{r.arch} / {r.mode}: {r.result}: {r.detail}" for r in bad)
    # the modes are really exercised: some architectures run every mode, none is refused everywhere
    assert any(r.result == "agree" and r.mode == "window-quant" for r in rows)


def test_the_sequence_passes_every_window_of_the_tiny_configs():
    assert len(tokens()) > SLIDING + 4 and PREFILL[0] < SLIDING < sum(PREFILL)


if __name__ == "__main__":
    import sys

    names = sys.argv[1:] or registry()
    t0 = time.perf_counter()
    print(table([r for name in names for r in conform(name)]))
    print(f"{time.perf_counter() - t0:.1f} s")
