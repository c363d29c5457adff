"""Cache append cost per mode vs history length, and attention over a mixed cache.

No model: the caches are built straight from ``cache.CACHE_CLASSES`` and fed synthetic
bfloat16 K/V shaped [1, kv_heads, N, head_dim] (defaults: 4 heads, head_dim 512, 20 layers).
The window modes get a ``cache.rope.Repositioner`` over ``nn.RoPE(head_dim, base=10000)``.

Table 1, "cache append": for each N in ``--sizes`` and each mode, every layer's cache is filled
to N tokens with one big ``absorb`` (then ``.offset`` is read so lazy maintenance
runs, then everything held is evaluated), followed by one model-like step (append plus attention
through ``cache.attend``, as a model's decode step makes, so the caches learn that attention is
dispatched to them); the fill is not timed. Then ``--warmup`` untimed and
``--steps`` timed steps run. Every point is run ``--repeats`` times (fresh caches each time,
interleaved with the other modes and sizes so a slow spell of the machine is shared) and the
table shows the median of all timed steps, in ms (the JSON also has the 10th percentile,
``meta.p10_ms``, which other processes on a busy machine disturb much less). One step is exactly:

    for each layer: cache.update_and_fetch(k1, v1)     # a fresh [1, kv_heads, 1, head_dim] token
    mx.eval([cache.state for cache in caches])        # everything the caches now hold

so it includes the Python cost of every ``update_and_fetch`` call, any maintenance that the
append makes due (quantising a chunk, evicting and re-rotating keys: lazily run at the next
call, inside a later step), buffer growth, and the evaluation of the written buffers. For
``concat`` ``.state`` is the pair ``update_and_fetch`` returned. The tokens are generated and
evaluated before timing; each step's arrays are dropped before the next step, so a buffer that
nothing else holds can be updated in place. No attention is computed in this table.

The ``floor`` row is the bare in-place write the caches cannot beat: per layer a preallocated
[1, kv_heads, cap, head_dim] K buffer and V buffer, ``buf[..., i:i+1, :] = x`` for both, then
one ``mx.eval`` of all buffers, timed the same way. ``floor+views`` is the same write but
evaluates the ``[:, :, :held]`` slices of the buffers, as a cache's ``.state`` hands them out:
it is what the step above costs any cache that returns views, before its own Python overhead.

Table 2, "attention over a mixed cache": a ``window-quant`` cache (one per layer, ``--attn-layers``,
default 1, i.e. one decode query through one layer) holding T tokens,
mostly quantised (``--attn-window`` recent tokens and the sinks at full precision,
``max_kv_tokens`` = T + 512 so nothing is evicted), and one decode query per layer
[1, q_heads, 1, head_dim] (GQA). One step is the attention of every layer's query followed by
one ``mx.eval`` of the outputs (no append, so T stays fixed), by three routes:
(a) ``cache.attend(q, scale, mask=None)``: quantized_matmul on the quantised part, matmul on the
full part, one joint softmax (the dispatch route); (b) ``mx.fast.scaled_dot_product_attention``
on ``cache.content()``, which dequantises the whole history every step (the fallback route);
(c) a ``prealloc`` cache holding the same T tokens at full precision through the fused SDPA.
The ``max abs(a-b)`` column is the largest output difference between routes (a) and (b).

After the tables the targets are checked against the measured numbers and printed as PASS/FAIL.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

import cache
from cache.rope import Repositioner
from chatapp.bench.report import BenchReport, emit, int_list, line_plot, mode_list, print_targets

DTYPE = mx.bfloat16

# Targets, checked against the measured numbers after the tables (see BENCHMARKS.md).
FLAT_PREALLOC = 1.2  # prealloc at the largest N within this factor of the smallest N
CONCAT_SPEEDUP = 100.0  # prealloc at least this many times faster than concat at the largest N
FLOOR_RATIO = 1.5  # prealloc within this factor of the bare slice_update floor at every N
FLAT_WINDOW = 1.3  # window modes at the largest N within this factor of the budget size






def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=int_list, default=[512, 1024, 2048, 4096],
                   help="history lengths N (default 512,1024,2048,4096)")
    p.add_argument("--modes", type=mode_list, default=list(cache.MODES), help="cache modes (default: all)")
    p.add_argument("--layers", type=int, default=20, help="layers, one cache each (default 20)")
    p.add_argument("--steps", type=int, default=32, help="timed steps per point (default 32)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    p.add_argument("--repeats", type=int, default=3,
                   help="independent runs of every point, interleaved; their timed steps are pooled (default 3)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--q-heads", type=int, default=8, help="query heads for the attention table (default 8)")
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--window", type=int, default=1024, help="recent window of the window modes (default 1024)")
    p.add_argument("--budget", type=int, default=2048, help="window-quant max_kv_tokens (default 2048)")
    p.add_argument("--evict-chunk", type=int, default=256)
    p.add_argument("--quant-start", type=int, default=512)
    p.add_argument("--bits", type=int, default=8, help="kv_bits (default 8)")
    p.add_argument("--group-size", type=int, default=64, help="kv_group_size (default 64)")
    p.add_argument("--attn-sizes", type=int_list, default=[1024, 2048, 4096],
                   help="T for the attention table (default 1024,2048,4096)")
    p.add_argument("--attn-window", type=int, default=256,
                   help="recent window of the attention-table cache (default 256)")
    p.add_argument("--attn-layers", type=int, default=1, help="layers per attention step (default 1: one decode query)")
    p.add_argument("--no-attn", action="store_true", help="skip the attention table")


# ---- helpers ----------------------------------------------------------------------------------
def _settings(args, mode: str, **over) -> cache.CacheSettings:
    base = dict(
        mode=mode, sinks=args.sinks, window=args.window, evict_chunk=args.evict_chunk,
        max_kv_tokens=args.budget, quant_start=args.quant_start, kv_bits=args.bits,
        kv_group_size=args.group_size,
    )
    base.update(over)
    return cache.CacheSettings(**base)


def _repositioner(head_dim: int) -> Repositioner:
    return Repositioner(nn.RoPE(head_dim, traditional=False, base=10000))


def _rand(shape, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(DTYPE)


def _tokens(n_steps: int, layers: int, heads: int, dim: int, seed: int) -> list[list[tuple[mx.array, mx.array]]]:
    """Fresh [1, heads, 1, dim] K/V per step and layer, evaluated up front."""
    toks = [[(_rand((1, heads, 1, dim), seed + 2 * (s * layers + l)),
              _rand((1, heads, 1, dim), seed + 2 * (s * layers + l) + 1)) for l in range(layers)]
            for s in range(n_steps)]
    mx.eval(toks)
    return toks


def _time_steps(step: Callable[[Any], None], tokens, warmup: int) -> list[float]:
    """ms of each ``step(tokens[i])`` after the first ``warmup`` (which are run, not kept)."""
    times = []
    for i, tok in enumerate(tokens):
        t0 = time.perf_counter()
        step(tok)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt * 1e3)
    return times


def _release() -> None:
    gc.collect()
    mx.clear_cache()


# ---- table 1: append ---------------------------------------------------------------------------
def _filled_caches(args, mode: str, n: int, repos: Repositioner):
    settings = _settings(args, mode)
    cls = cache.CACHE_CLASSES[mode]
    caches = [cls(settings, repositioner=repos) for _ in range(args.layers)]
    shape = (1, args.kv_heads, n, args.head_dim)
    k, v = _rand(shape, 1000 + n), _rand(shape, 2000 + n)
    mx.eval(k, v)
    for c in caches:
        c.absorb(k, v)  # tokens taken outside a model step (as a restored or converted cache)
    # One model-like step (append + attention through the cache), as a model's first decode step
    # does: the caches then know attention is dispatched to them and, like under a real model,
    # stop building the dequantised history that only the non-dispatched route reads.
    one = (1, args.kv_heads, 1, args.head_dim)
    k1, q = _rand(one, 3000 + n), _rand(one, 4000 + n)
    for c in caches:
        c.update_and_fetch(k1, k1)
        if hasattr(c, "attend"):
            mx.eval(c.attend(q, scale=args.head_dim**-0.5, mask=None))
    for c in caches:
        c.offset  # settle: run the lazy maintenance (quantise / evict) the fill made due
    mx.eval([c.state for c in caches])
    return caches


def _cache_step(caches) -> Callable:
    def step(tok):
        for c, (k1, v1) in zip(caches, tok):
            c.update_and_fetch(k1, v1)
        mx.eval([c.state for c in caches])
        # the bench keeps nothing from this step, so the next write can reuse the buffers in place

    return step


def time_mode(args, mode: str, n: int, tokens, repos: Repositioner) -> list[float]:
    caches = _filled_caches(args, mode, n, repos)
    times = _time_steps(_cache_step(caches), tokens, args.warmup)
    del caches
    _release()
    return times


def time_floor(args, n: int, tokens, views: bool = False) -> list[float]:
    """The bare in-place write. ``views``: evaluate the [:, :, :held] slices (what a cache's
    ``.state`` hands out) instead of the whole buffers: the least any cache pays for this step."""
    cap = n + len(tokens)
    shape = (1, args.kv_heads, cap, args.head_dim)
    kb = [mx.zeros(shape, DTYPE) for _ in range(args.layers)]
    vb = [mx.zeros(shape, DTYPE) for _ in range(args.layers)]
    mx.eval(kb, vb)
    pos = [n]

    def step(tok):
        i = pos[0]
        for kbuf, vbuf, (k1, v1) in zip(kb, vb, tok):
            kbuf[..., i : i + 1, :] = k1
            vbuf[..., i : i + 1, :] = v1
        if views:
            mx.eval([[kbuf[:, :, : i + 1], vbuf[:, :, : i + 1]] for kbuf, vbuf in zip(kb, vb)])
        else:
            mx.eval(kb, vb)
        pos[0] = i + 1

    times = _time_steps(step, tokens, args.warmup)
    del kb, vb
    _release()
    return times


FLOORS = ("floor", "floor+views")


def _p10(xs: list[float]) -> float:
    """10th percentile (nearest rank): what a step costs when no other process gets in the way."""
    xs = sorted(xs)
    return xs[int(0.1 * (len(xs) - 1))]


def run_append(args) -> tuple[dict[str, list[float]], dict[str, list[float]], list[str]]:
    """Median and 10th-percentile ms per (row, N); every point runs ``repeats`` times,
    interleaved, and the timed steps are pooled."""
    repos = _repositioner(args.head_dim)
    names = list(args.modes) + list(FLOORS)
    pooled = {m: {n: [] for n in args.sizes} for m in names}
    for r in range(args.repeats):
        for n in args.sizes:
            tokens = _tokens(args.warmup + args.steps, args.layers, args.kv_heads, args.head_dim, seed=7 * n + r)
            for mode in args.modes:
                pooled[mode][n] += time_mode(args, mode, n, tokens, repos)
            pooled["floor"][n] += time_floor(args, n, tokens)
            pooled["floor+views"][n] += time_floor(args, n, tokens, views=True)
            del tokens
            _release()
    med = {m: [statistics.median(pooled[m][n]) for n in args.sizes] for m in names}
    p10 = {m: [_p10(pooled[m][n]) for n in args.sizes] for m in names}
    return med, p10, names


# ---- table 2: attention over a mixed cache -----------------------------------------------------
def _filled_one(cls, settings, n: int, layer_seed: int, args, repos):
    shape = (1, args.kv_heads, n, args.head_dim)
    c = cls(settings, repositioner=repos)
    c.update_and_fetch(_rand(shape, layer_seed), _rand(shape, layer_seed + 1))
    c.offset
    mx.eval(c.state)
    return c


def run_attention(args) -> list[dict[str, Any]]:
    repos = _repositioner(args.head_dim)
    scale = 1.0 / math.sqrt(args.head_dim)
    layers = args.attn_layers
    qs = [_rand((1, args.q_heads, 1, args.head_dim), 90000 + l) for l in range(layers)]
    mx.eval(qs)
    n_steps = args.warmup + args.steps
    rows = []
    for t in args.attn_sizes:
        wq = _settings(args, "window-quant", window=args.attn_window, max_kv_tokens=t + 512)
        mixed = [_filled_one(cache.WindowQuantKVCache, wq, t, 50000 + 2 * l + 7 * t, args, repos)
                 for l in range(layers)]
        usage = mixed[0].usage()

        def attend_step(_):
            mx.eval([c.attend(q, scale=scale, mask=None) for c, q in zip(mixed, qs)])

        def fallback_step(_):
            mx.eval([mx.fast.scaled_dot_product_attention(q, *c.content(), scale=scale, mask=None)
                     for c, q in zip(mixed, qs)])

        a, b = [], []
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits both
            a += _time_steps(attend_step, range(n_steps), args.warmup)
            b += _time_steps(fallback_step, range(n_steps), args.warmup)
        a, b = statistics.median(a), statistics.median(b)
        ca, cb = mixed[0].attend(qs[0], scale=scale, mask=None), mx.fast.scaled_dot_product_attention(
            qs[0], *mixed[0].content(), scale=scale, mask=None)
        err = mx.abs(ca.astype(mx.float32) - cb.astype(mx.float32)).max().item()
        del mixed, ca, cb
        _release()

        pre = _settings(args, "prealloc")
        full = [_filled_one(cache.PreallocKVCache, pre, t, 50000 + 2 * l + 7 * t, args, repos)
                for l in range(layers)]

        def prealloc_step(_):
            mx.eval([mx.fast.scaled_dot_product_attention(q, *c.content(), scale=scale, mask=None)
                     for c, q in zip(full, qs)])

        c_ms = statistics.median(
            [ms for _ in range(args.repeats) for ms in _time_steps(prealloc_step, range(n_steps), args.warmup)])
        del full
        _release()
        rows.append(dict(T=t, quant_tokens=usage.quant_tokens, full_tokens=usage.full_tokens,
                         attend_ms=a, dequant_sdpa_ms=b, prealloc_sdpa_ms=c_ms,
                         ratio_b_a=b / a, max_abs_diff=err))
    return rows


# ---- targets -----------------------------------------------------------------------------------
def check_targets(args, results: dict[str, list[float]]) -> list[dict[str, Any]]:
    sizes = args.sizes
    lo, hi = 0, len(sizes) - 1
    out = []

    def add(name, value, limit, ok, detail):
        out.append(dict(target=name, value=round(value, 3), limit=limit,
                        passed=None if ok is None else bool(ok), detail=detail))

    if "prealloc" in results and len(sizes) > 1:
        p = results["prealloc"]
        r = p[hi] / p[lo]
        add(f"prealloc flat: N={sizes[hi]} within {FLAT_PREALLOC}x of N={sizes[lo]}", r, FLAT_PREALLOC,
            r <= FLAT_PREALLOC, f"{p[hi]:.3f} ms / {p[lo]:.3f} ms = {r:.2f}x")
    if "prealloc" in results and "concat" in results:
        p, c = results["prealloc"][hi], results["concat"][hi]
        r = c / p
        add(f"prealloc >= {CONCAT_SPEEDUP:g}x faster than concat at N={sizes[hi]}", r, CONCAT_SPEEDUP,
            r >= CONCAT_SPEEDUP, f"{c:.3f} ms / {p:.3f} ms = {r:.1f}x")
    if "prealloc" in results:
        ratios = [p / f for p, f in zip(results["prealloc"], results["floor"])]
        w = max(range(len(ratios)), key=ratios.__getitem__)
        add(f"prealloc within {FLOOR_RATIO}x of the slice_update floor (worst N)", ratios[w], FLOOR_RATIO,
            ratios[w] <= FLOOR_RATIO,
            f"worst at N={sizes[w]}: {results['prealloc'][w]:.3f} ms / {results['floor'][w]:.3f} ms = "
            f"{ratios[w]:.2f}x; "
            + ", ".join(f"N={n}: {r:.2f}x" for n, r in zip(sizes, ratios)))
        views = [p / f for p, f in zip(results["prealloc"], results["floor+views"])]
        w = max(range(len(views)), key=views.__getitem__)
        add("prealloc vs floor+views (worst N), no target", views[w], None, None,
            ", ".join(f"N={n}: {r:.2f}x" for n, r in zip(sizes, views)))
    for mode in ("window", "window-quant"):
        if mode not in results:
            continue
        budget = _settings(args, mode).budget
        ref = next((i for i, n in enumerate(sizes) if n >= budget), None)
        if ref is None or ref == hi:
            continue
        t = results[mode]
        r = t[hi] / t[ref]
        add(f"{mode} flat past its budget ({budget}): N={sizes[hi]} within {FLAT_WINDOW}x of N={sizes[ref]}",
            r, FLAT_WINDOW, r <= FLAT_WINDOW, f"{t[hi]:.3f} ms / {t[ref]:.3f} ms = {r:.2f}x")
    return out


# ---- entry point -------------------------------------------------------------------------------
def build_reports(args, results, names, attn_rows, targets) -> tuple[BenchReport, BenchReport | None]:
    rep = BenchReport("cache append: median ms per step", ["mode"] + [f"N={n}" for n in args.sizes])
    for m in names:
        rep.add(m, *[round(x, 4) for x in results[m]])
    rep.meta.update(
        step=f"{args.layers} layers x update_and_fetch([1,{args.kv_heads},1,{args.head_dim}] K and V), "
             "then one mx.eval of every cache's .state",
        shape=f"K/V [1, {args.kv_heads}, N, {args.head_dim}] bfloat16",
        layers=args.layers, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
        settings=f"sinks={args.sinks} window={args.window} evict_chunk={args.evict_chunk} "
                 f"max_kv_tokens={args.budget} quant_start={args.quant_start} kv_bits={args.bits} "
                 f"kv_group_size={args.group_size}",
        device=str(mx.default_device()), mlx=mx.__version__,
    )
    rep.meta["targets"] = targets
    att = None
    if attn_rows:
        cols = ["T", "quant tokens", "full tokens", "(a) attend ms", "(b) dequant+SDPA ms",
                "(c) prealloc SDPA ms", "b/a", "max abs(a-b)"]
        att = BenchReport("attention over a mixed cache: median ms per step", cols)
        for r in attn_rows:
            att.add(r["T"], r["quant_tokens"], r["full_tokens"], round(r["attend_ms"], 4),
                    round(r["dequant_sdpa_ms"], 4), round(r["prealloc_sdpa_ms"], 4),
                    round(r["ratio_b_a"], 2), float(f"{r['max_abs_diff']:.3g}"))
        att.meta.update(
            step=f"{args.attn_layers} layer(s) x attention of one query [1,{args.q_heads},1,{args.head_dim}] "
                 f"over {args.kv_heads} KV heads, then one mx.eval (no append)",
            cache=f"window-quant sinks={args.sinks} window={args.attn_window} max_kv_tokens=T+512 "
                  f"kv_bits={args.bits} kv_group_size={args.group_size}",
        )
        rep.meta["attention"] = {"name": att.name, "columns": att.columns, "rows": att.rows, "meta": dict(att.meta)}
    return rep, att


def _cache_fingerprint() -> str:
    """sha1 of the cache library's sources, so a result names the code it measured."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha1()
    for f in sorted(Path(cache.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def run(args) -> int:
    if args.no_attn:
        args.attn_sizes = []
    load_before = _load()
    results, p10, names = run_append(args)
    attn_rows = run_attention(args) if args.attn_sizes else []
    targets = check_targets(args, results)
    rep, att = build_reports(args, results, names, attn_rows, targets)
    rep.meta["load"] = f"1-min load average {load_before} before, {_load()} after ({os.cpu_count()} CPUs)"
    rep.meta["cache_src"] = _cache_fingerprint()
    rep.meta["p10_ms"] = {m: [round(x, 4) for x in p10[m]] for m in names}

    def plot(path):
        line_plot(path, f"KV cache append: {args.layers} layers, K/V [1,{args.kv_heads},N,{args.head_dim}] bf16",
                  "history length N (tokens)", "median ms per step (log)",
                  {m: (args.sizes, results[m]) for m in names}, logx=True, logy=True)

    emit(rep, args.json, plot, args.plot)
    if att is not None:
        print()
        emit(att, None)
    print_targets(targets)
    return 0
