"""Compile the fused prefill kernel in a second process while this one compiles the decode step.

numba compiles under one lock per process, so a first start on a CPU compiled the fused routes
one after the other: SmolLM2 with numerics fast, 2 cores, ~21 s for ``prefill_step`` and as much
for the decode step and the MLX-route kernels (40 s in all; 61 s before stop 27's kernel cuts).
The prefill kernel's types depend only on the dtypes of the weights' scales and of the K/V cache
and on the numerics (never on shapes, bits or group sizes: those are values), so a child process
can compile it on a tiny random Llama of the same dtypes and leave it in numba's disk cache, from
which this process then loads it in well under a second. The child runs only when that cache
holds no ``prefill_step`` for this CPU (a first start, or a new numba or source) and the process
may use a second core. It is a speed-up only: if it fails, this process compiles the kernel
itself, as before.

The child then runs a few dozen tokens through each evicting policy's caches, so that the cache
maintenance kernels (kernels/kv_rows.py: flushing rows into the quantised middle, evicting,
turning kept keys, a scored cache's votes) land in the disk cache too. Left to the session, they
compiled where it first quantised and first evicted: on a cold cache bench long's window-quant and
scored-quant turns 3 and 8 waited +1.9 and +2.2 s for their first token.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass

# the tiny model the child compiles on: the kernels' smallest legal widths (multiples of 64)
_TINY = dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             intermediate_size=256, vocab_size=64, rms_norm_eps=1e-5, rope_theta=10000.0)
# the policies whose maintenance the child runs (scored without quantising shares scored-quant's
# kernels), on settings small enough that a few dozen tokens flush, evict and re-rotate (groups of
# 32 divide every head_dim the fused route serves; the kernels' types do not depend on it)
MAINTAINED = ("window", "window-quant", "scored-quant")
_SMALL = dict(sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16, kv_group_size=32)


@dataclass(frozen=True)
class PrefillTypes:
    """What fixes prefill_step's signature: the MLX dtype of the weights' scales (and biases),
    the K/V buffers' dtype and the numerics (fast adds the int8 activations' arrays)."""

    scales_dtype: str  # "float16", "bfloat16", "float32"
    kv_dtype: str  # resolved: "float16" or "float32"
    numerics: str  # resolved: "exact" or "fast"


def prefill_types(layer, numerics: str, kv_dtype: str) -> PrefillTypes:
    """The PrefillTypes of a model whose kernel layers are like ``layer``, under the settings."""
    from .fused_settings import resolve_kv_dtype, resolve_numerics

    return PrefillTypes(str(layer["scales"].dtype).rsplit(".", 1)[-1], resolve_kv_dtype(kv_dtype),
                        resolve_numerics(numerics))


def kernel_cached(kernel) -> bool:
    """Whether numba's disk cache holds ``kernel`` (a cached njit function) compiled for this
    CPU (any signature) and for the source as it is: its index (numba drops a stale one) has an
    entry with this machine's codegen key. Unknown (a numba internal that moved) counts as
    cached: nothing is compiled ahead then."""
    try:
        magic = kernel.targetctx.codegen().magic_tuple()
        return any(key[1] == magic for key in kernel._cache._cache_file._load_index())
    except Exception:  # noqa: BLE001 - numba internals: any change means "do not compile ahead"
        return True


def prefill_cached() -> bool:
    """Whether numba's disk cache holds a ``prefill_step`` for this CPU and source."""
    from chatapp.kernels.prefill_step import prefill_step

    return kernel_cached(prefill_step)


def maintenance_cached() -> bool:
    """Whether numba's disk cache holds the cache maintenance kernels (one stands for all:
    run_policies compiles them together)."""
    from chatapp.kernels.kv_rows import flush_rows, rotate_rows

    return kernel_cached(flush_rows) and kernel_cached(rotate_rows)


def start_prefill_compile(types: PrefillTypes) -> subprocess.Popen | None:
    """Start the child that compiles prefill_step for ``types``, or None where it would not help
    (the kernel already cached, one core, or the child cannot start)."""
    from chatapp.kernels.pool import usable_cores

    if usable_cores() < 2 or prefill_cached():
        return None
    try:
        return subprocess.Popen([sys.executable, "-m", "chatapp.backend.precompile", json.dumps(asdict(types))],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                close_fds=True)
    except OSError:
        return None


def wait_for(child: subprocess.Popen | None, timeout_s: float = 600.0) -> bool:
    """Wait for the child; True when it compiled (exit 0). A child that hangs is killed."""
    if child is None:
        return False
    try:
        return child.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return False


def compile_prefill(types: PrefillTypes) -> None:
    """Run one prefill chunk of a tiny random Llama of ``types`` through the fused route (what
    the child does): numba compiles prefill_step and writes it to its disk cache."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import llama

    from cache import CacheSettings, PreallocKVCache
    from chatapp.kernels.pool import set_threads

    from .fused_decode import FusedDecoder

    model = llama.Model(llama.ModelArgs.from_dict({"model_type": "llama", **_TINY}))
    nn.quantize(model, group_size=32, bits=4)
    dtype = getattr(mx, types.scales_dtype)
    for _, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):  # the fused routes read these as stored
            m.scales, m.biases = m.scales.astype(dtype), m.biases.astype(dtype)
    mx.eval(model.parameters())
    set_threads(1)  # one kernel thread: the parent's decode compile has the other core
    # the plain quantised layers (no CPU routes): FusedDecoder reads their packed views as the
    # routes would hand them over
    dec = FusedDecoder(model, types.numerics, types.kv_dtype)
    caches = [PreallocKVCache(CacheSettings()) for _ in dec.layers]
    dec.prefill(mx.array([0, 0]), caches)
    run_policies(model, dec)


def run_policies(model, dec) -> None:
    """Prefill 64 tokens in evict_chunk steps, then decode 16, through each MAINTAINED policy's
    caches for ``dec``'s layers (the first of ``model``'s, or all) on the fused route: every
    maintenance kernel a session reaches runs once. A model whose layers take no such cache
    (CacheConfigError) has nothing to run."""
    import mlx.core as mx

    from cache import CacheConfigError, CacheSettings
    from cache.factory import make_caches

    # the decoder's host row operations count what they did for --verbose: not these runs
    tallies = [(ops, dict(ops.done), dict(ops.declined)) for ops in {id(o): o for o in dec._row_ops}.values()]
    try:
        for mode in MAINTAINED:
            settings = CacheSettings(mode=mode, **_SMALL)
            try:
                caches = make_caches(model, settings)[:len(dec.layers)]
            except CacheConfigError:
                return
            for start in range(0, 64, settings.evict_chunk):
                dec.prefill(mx.array(list(range(start, start + settings.evict_chunk))), caches)
            for t in range(16):
                dec.step(t, caches)
            del caches
    finally:
        for ops, done, declined in tallies:
            ops.done, ops.declined = done, declined
        mx.clear_cache()


def main(argv: list[str]) -> int:
    compile_prefill(PrefillTypes(**json.loads(argv[0])))
    return 0


if __name__ == "__main__":  # pragma: no cover - run as the child
    sys.exit(main(sys.argv[1:]))
