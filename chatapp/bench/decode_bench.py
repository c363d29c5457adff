"""Decode tokens/sec per cache mode at long contexts, side by side with mlx-lm on the same model.

Method. Prefilling thousands of tokens through realistic shapes is far too slow on this CPU, so
every peer starts from caches filled with the same synthetic K/V: for each context C and layer
one float32 random-normal K and V array [1, kv_heads, C, head_dim] (the model's own KV geometry)
is generated once and written with one ``update_and_fetch`` into

* chatapp's caches (``cache.make_caches`` for each ``--modes`` entry; ``.offset`` is then read,
  so the lazy maintenance a fill makes due (quantising, evicting and re-positioning) runs), and
* mlx-lm's own ``make_prompt_cache(model)`` (its ``KVCache``).

Then ``--tokens`` + 1 greedy tokens are decoded from one start token:

* chatapp: one model step gives the first logits, then the Session's own decode loop
  (``Session.decode`` over ``generate.decode_tokens``: sampler, ``mx.async_eval`` pipelining,
  detokeniser, stop matcher, step statistics) runs with the filled caches (EOS and stop strings
  off, so every run decodes the same number of tokens);
* mlx-lm: ``mlx_lm.stream_generate(model, tokenizer, [start], prompt_cache=filled KVCache)``
  (generate_step's pipelining plus the same detokeniser; EOS off).

Both report one interval per token after the first (time between two tokens reaching Python);
a run's tok/s is 1000 / its median interval. Every repeat visits every context and every peer,
in forward then reverse order on alternate repeats (prealloc right next to mlx-lm), so the slow
phases of a shared machine spread over all points alike. A point's tok/s is the median over its
runs; the ratio column is paired: the median over repeats of (run tok/s / mlx-lm run tok/s in
the same repeat and context), which cancels the machine's slow and fast phases; the targets use
it (flatness likewise pairs each window run with the same mode's run at the reference context
in the same repeat). The JSON keeps every run. Window modes use budgets below the largest
context (``--window``, ``--max-kv-tokens``) so they hold a fixed number of tokens past them.
Settings are *not* fitted to a model's trained context here: this is a speed benchmark
(stories260K's 512 positions matter for quality, see ``chatapp bench quality``).

Memory. After the timed repeats, one more run per context and peer measures the allocator
(``mx.get_active_memory`` / ``get_cache_memory`` / ``get_peak_memory``, read after every token):
``peak MiB`` is the highest active memory during the run above what was held before it (the run
fills a new cache with the synthetic K/V, so the cache's own copy of it is included); ``active
B/tok`` and ``cache B/tok`` are how much active memory and MLX's buffer cache grew per decoded
token (the median over the run's tokens, each read once its step has finished). For that run the cache limit is raised
to the memory limit, so no freed buffer goes back to the system and the cache growth counts every buffer the
allocator could not reuse: active + cache growth is the bytes newly allocated per decoded token.
A cache that concatenates (``concat``) frees its whole K/V and allocates a larger one every step,
so its cache grows by about the whole history each token; a preallocated one writes in place.

Gauges. ``prealloc, gauges off`` is prealloc with the Session's memory gauges off
(``Session(gauges=False)``); it runs in every repeat next to prealloc, and the paired ratio
(gauges on / off) shows what is visible of their cost. The cost itself is measured directly
(``gauge_cost_us``: one reading, timed over 20,000) and set against the median prealloc step:
the target is under 0.1% of a step.

Models (``--models``, comma list): a model folder (loaded with ``load_model``: float32
activations on CPU), ``llama2-7b-geometry`` (a random-weight 4-bit Llama built at bench time:
Llama-2-7B attention geometry, 32 heads of 128 (MHA), hidden 4096, intermediate 11008, vocab
32000, ``--big-layers`` layers; decoded ``--big-tokens`` tokens, ``--big-repeats`` times, since a
token costs ~0.5 s here; defaults 4 tokens x 4 repeats), or ``tiny`` (a small random head_dim-64 model, for tests).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

from cache.settings import MODES
from chatapp.bench.report import BenchReport, add_cache_arguments, cache_knobs, emit, int_list, line_plot, mode_list

DEFAULT_MODEL = str(Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K-4bit")
BIG = "llama2-7b-geometry"
TINY = "tiny"
MLX_LM = "mlx-lm"
NO_GAUGES = "prealloc, gauges off"

PREALLOC_RATIO = 0.95  # chatapp prealloc tok/s / mlx-lm tok/s, at every context
GAUGES_SHARE = 0.001  # the memory gauges' cost per token, as a share of a prealloc decode step
FLAT_RATIO = 0.90  # window modes: tok/s past the budget / tok/s at the budget (paired per repeat)






def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=f"{DEFAULT_MODEL},{BIG}",
                   help=f"comma list of model folders, {BIG!r} and/or {TINY!r} "
                        f"(default: stories260K-4bit and {BIG})")
    p.add_argument("--contexts", type=int_list, default=[128, 256, 512, 1024, 2048, 4096],
                   help="context lengths filled before decoding (default 128,256,512,1024,2048,4096)")
    p.add_argument("--modes", type=mode_list, default=list(MODES), help="chatapp cache modes (default: all)")
    p.add_argument("--tokens", type=int, default=32, help="timed decode steps per run (default 32)")
    p.add_argument("--repeats", type=int, default=9, help="runs per peer and context (default 9)")
    p.add_argument("--big-tokens", type=int, default=4, help=f"--tokens for {BIG} (default 4)")
    p.add_argument("--big-repeats", type=int, default=4, help=f"--repeats for {BIG} (default 4)")
    p.add_argument("--big-layers", type=int, default=2, help=f"layers of {BIG} (default 2)")
    add_cache_arguments(p, max_kv_tokens=2048)  # a window-quant budget the 4,096 context runs past
    p.add_argument("--seed", type=int, default=0)


# ---- models ------------------------------------------------------------------------------------
def load_peer_model(spec: str, big_layers: int = 2, seed: int = 0) -> dict[str, Any]:
    """(name, model, tokenizer, description) for a ``--models`` entry."""
    from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

    if spec in (BIG, "7b"):
        shape = LlamaShape(hidden_size=4096, num_hidden_layers=big_layers, num_attention_heads=32,
                           num_key_value_heads=32, head_dim=128, intermediate_size=11008, vocab_size=32000,
                           max_position_embeddings=4096)
        t0 = time.perf_counter()
        model, _ = build_random_llama(shape, seed=seed, quantize_bits=4)
        desc = (f"random 4-bit Llama, Llama-2-7B attention geometry (32 heads x 128, MHA, hidden 4096, "
                f"intermediate 11008, vocab 32000), {big_layers} layers; built in {time.perf_counter() - t0:.0f} s")
        return dict(name=BIG, model=model, tokenizer=byte_tokenizer(32000), desc=desc, big=True)
    if spec == TINY:
        shape = LlamaShape(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, intermediate_size=512, vocab_size=512)
        model, _ = build_random_llama(shape, seed=seed, quantize_bits=4)
        return dict(name=TINY, model=model, tokenizer=byte_tokenizer(512), big=False,
                    desc="random 4-bit Llama: 2 layers, 4 heads / 2 KV heads of 64, hidden 256, vocab 512")
    from chatapp.model.loader import load_model

    lm = load_model(spec)
    desc = f"{lm.n_layers} layers, {lm.n_kv_heads} KV heads of {lm.head_dim}, {lm.dtype} activations"
    return dict(name=Path(spec).name, model=lm.model, tokenizer=lm.tokenizer, desc=desc, big=False)


# ---- one measurement ---------------------------------------------------------------------------
def settings_for(args, mode: str):
    from cache import CacheSettings

    return CacheSettings(mode=mode, **cache_knobs(args))


def synthetic_kv(geom, context: int, seed: int) -> list[tuple[Any, Any]]:
    """Per layer: float32 random-normal K and V, [1, kv_heads, context, head_dim], evaluated."""
    import mlx.core as mx

    shape = (1, geom.n_kv_heads, context, geom.head_dim)
    out = []
    for layer in range(geom.n_layers):
        key = mx.random.key(seed * 1_000_003 + context * 101 + layer)
        k1, k2 = mx.random.split(key)
        out.append((mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2)))
    mx.eval(out)
    return out


def _fill(caches, kv) -> None:
    import mlx.core as mx

    for c, (k, v) in zip(caches, kv):
        c.update_and_fetch(k, v)
    for c in caches:
        c.offset  # run the lazy maintenance (quantise / evict) the fill made due
    mx.eval([c.state for c in caches])


def decode_chatapp(model, tokenizer, settings, kv, start: int, n: int, gauges: bool = True,
                   on_token=None) -> tuple[list[float], int]:
    """Step intervals (ms) of the Session's decode loop over caches filled with ``kv``;
    ``gauges``: the Session reads MLX's memory gauges as in the app; ``on_token()`` runs after
    every token."""

    from cache import make_caches
    from chatapp.engine.events import TurnDone
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session
    from chatapp.engine.stats import TurnStats

    # No end tokens: the loop runs its fixed length. The speed bench uses the settings as given
    # (Session would fit window budgets to the model's trained context), on caches filled with
    # the shared synthetic K/V.
    session = Session(model, tokenizer, cache_settings=settings, mode=settings.mode, raw=True,
                      generation=GenerationSettings(temp=0.0, max_tokens=n + 1), gauges=gauges, eos_ids=set())
    caches = make_caches(model, settings, session.geometry)
    _fill(caches, kv)
    held = caches[0].offset
    session.adopt(caches, [start] * held, settings)
    stats = TurnStats(mode=settings.mode)
    t0 = time.perf_counter()
    logits = session.prefill([start])
    done = None
    for ev in session.decode(logits, stats, t0):
        if isinstance(ev, TurnDone):
            done = ev
        elif on_token is not None:
            on_token()
    if done.stats.generated_tokens != n + 1:
        raise RuntimeError(f"chatapp decoded {done.stats.generated_tokens} tokens, expected {n + 1}")
    return [s.ms for s in stats.steps], held


def decode_mlx_lm(model, tokenizer, kv, start: int, n: int, on_token=None) -> list[float]:
    """Step intervals (ms) of mlx_lm.stream_generate over its own KVCache filled with ``kv``."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    pc = make_prompt_cache(model)
    _fill(pc, kv)
    saved = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()
    try:
        stamps = []
        for _ in stream_generate(model, tokenizer, mx.array([start]), max_tokens=n + 1, prompt_cache=pc):
            stamps.append(time.perf_counter())
            if on_token is not None:
                on_token()
    finally:
        tokenizer.eos_token_ids = saved
    if len(stamps) != n + 1:
        raise RuntimeError(f"mlx-lm decoded {len(stamps)} tokens, expected {n + 1}")
    return [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]


def decode_peer(model, tokenizer, args, peer: str, kv, start: int, n: int, on_token=None) -> tuple[list[float], int]:
    """One run of ``peer`` (mlx-lm, a cache mode, or prealloc with the gauges off): step ms, tokens held."""
    if peer == MLX_LM:
        return decode_mlx_lm(model, tokenizer, kv, start, n, on_token), kv[0][0].shape[2]
    mode = "prealloc" if peer == NO_GAUGES else peer
    return decode_chatapp(model, tokenizer, settings_for(args, mode), kv, start, n, gauges=peer != NO_GAUGES,
                          on_token=on_token)


def memory_run(model, tokenizer, args, peer: str, kv, start: int, n: int) -> dict[str, float]:
    """The allocator during one run of ``peer``: peak above the memory held before it, and the growth
    of active memory and of the buffer cache per decoded token, with the cache limit raised so that
    every buffer that could not be reused shows (see the module docstring)."""
    import mlx.core as mx

    readings: list[tuple[int, int]] = []

    def read() -> None:
        mx.synchronize()  # the next step is in flight (pipelining): let it land so readings are alike
        readings.append((mx.get_active_memory(), mx.get_cache_memory()))

    limit = mx.set_cache_limit(mx.get_memory_limit())
    try:
        _release()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        decode_peer(model, tokenizer, args, peer, kv, start, n, on_token=read)
        peak = mx.get_peak_memory()
    finally:
        mx.set_cache_limit(limit)
        _release()
    # Median of the per-token growth: one step that frees something the fill left behind does not
    # swing it, and the first token (which allocates the step's buffers once) is left out.
    pairs = list(zip(readings, readings[1:])) or [(readings[0], readings[0])]
    return dict(peak_mib=(peak - before) / (1 << 20),
                active_per_token=statistics.median(b[0] - a[0] for a, b in pairs),
                cache_per_token=statistics.median(b[1] - a[1] for a, b in pairs))


def gauge_cost_us(calls: int = 20000) -> float:
    """Microseconds one reading of the memory gauges takes (what the Session does every few tokens)."""
    from chatapp.engine.memory import read_gauges

    read_gauges()
    t0 = time.perf_counter()
    for _ in range(calls):
        read_gauges(kv_held=1, tokens=1)
    return (time.perf_counter() - t0) / calls * 1e6


def _release() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


# ---- the benchmark -----------------------------------------------------------------------------
def bench_model(args, spec: str, log=print) -> dict[str, Any]:
    import mlx.core as mx

    from cache import CacheConfigError, check_settings, model_geometry

    m = load_peer_model(spec, args.big_layers, args.seed)
    model, tokenizer = m["model"], m["tokenizer"]
    geom = model_geometry(model)
    tokens = args.big_tokens if m["big"] and args.big_tokens else args.tokens
    repeats = args.big_repeats if m["big"] and args.big_repeats else args.repeats
    log(f"# {m['name']}: {m['desc']}; {tokens} tokens x {repeats} repeats per point")

    peers, skipped = [MLX_LM], {}
    # prealloc runs right next to mlx-lm in every repeat: the target compares those two.
    for mode in sorted(args.modes, key=lambda m: m != "prealloc"):
        try:
            check_settings(settings_for(args, mode), geom)
            peers.append(mode)
        except CacheConfigError as e:
            skipped[mode] = str(e)
            log(f"# {m['name']}: skipping {mode}: {e}")

    if "prealloc" in peers:
        peers.insert(peers.index("prealloc") + 1, NO_GAUGES)

    vocab = getattr(getattr(model, "args", None), "vocab_size", 256)
    start = min(vocab - 1, 65)
    # Warm-up (untimed): one short run per peer on the smallest context.
    kv = synthetic_kv(geom, args.contexts[0], args.seed)
    for peer in peers:
        decode_peer(model, tokenizer, args, peer, kv, start, 2)
    del kv

    # Every repeat visits every context and every peer, in forward then reverse order on
    # alternate repeats, so a slow phase of a shared machine spreads over all points alike.
    kvs = {ctx: synthetic_kv(geom, ctx, args.seed) for ctx in args.contexts}
    steps = {p: {c: [] for c in args.contexts} for p in peers}
    run_tps = {p: {c: [] for c in args.contexts} for p in peers}
    held: dict[tuple[str, int], int] = {}
    for rep in range(repeats):
        ctx_order = args.contexts if rep % 2 == 0 else args.contexts[::-1]
        for ctx in ctx_order:
            order = peers if rep % 2 == 0 else peers[::-1]
            for peer in order:
                ms, held[(peer, ctx)] = decode_peer(model, tokenizer, args, peer, kvs[ctx], start, tokens)
                steps[peer][ctx] += ms
                run_tps[peer][ctx].append(1000.0 / statistics.median(ms))
                _release()
        log(f"# {m['name']} repeat {rep + 1}/{repeats}: " + "; ".join(
            f"{c}: " + " ".join(f"{p} {run_tps[p][c][-1]:.1f}" for p in peers) for c in args.contexts))
    memory = {(p, c): memory_run(model, tokenizer, args, p, kvs[c], start, tokens)
              for c in args.contexts for p in peers if p != NO_GAUGES}
    del kvs
    points: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in peers}
    for peer in peers:
        for ctx in args.contexts:
            st = steps[peer][ctx]
            med = statistics.median(st)
            # tok/s of a run = 1000 / its median step ms; a point's tok/s = median over runs; the
            # ratio pairs each run with the mlx-lm run of the same repeat and context (medians of
            # the pairs), which cancels the slow phases of a shared machine.
            pair = [a / b for a, b in zip(run_tps[peer][ctx], run_tps[MLX_LM][ctx])]
            points[peer][ctx] = dict(tps=statistics.median(run_tps[peer][ctx]), best_tps=max(run_tps[peer][ctx]),
                                     median_step_ms=med, mean_step_ms=statistics.fmean(st), steps=len(st),
                                     held=held[(peer, ctx)], run_tps=run_tps[peer][ctx],
                                     ratio=statistics.median(pair),
                                     best_ratio=max(run_tps[peer][ctx]) / max(run_tps[MLX_LM][ctx]),
                                     **memory.get((peer, ctx), {}))
    del model
    _release()
    return dict(name=m["name"], desc=m["desc"], tokens=tokens, repeats=repeats, peers=peers,
                skipped=skipped, points=points, peak_memory=mx.get_peak_memory())


def check_targets(args, results: list[dict[str, Any]], gauge_us: float) -> list[dict[str, Any]]:
    from chatapp.engine.session import LIVE_VIEW_EVERY

    out = []
    ctxs = args.contexts
    for r in results:
        pts = r["points"]
        if "prealloc" in pts:
            ratios = {c: pts["prealloc"][c]["ratio"] for c in ctxs}
            worst = min(ratios, key=ratios.get)
            out.append(dict(
                model=r["name"], target=f"prealloc >= {PREALLOC_RATIO} x mlx-lm tok/s at every context",
                value=round(ratios[worst], 3), passed=ratios[worst] >= PREALLOC_RATIO,
                detail=f"worst at context {worst}: {ratios[worst]:.3f}; "
                       + ", ".join(f"{c}: {x:.2f}" for c, x in ratios.items())))
        if NO_GAUGES in pts:
            # The gauges' own cost per token against a decode step; the paired A/B (prealloc with
            # the gauges over prealloc without, same repeat and context) shows what is visible of it.
            share = max(gauge_us / LIVE_VIEW_EVERY / (pts["prealloc"][c]["median_step_ms"] * 1000) for c in ctxs)
            ratios = {c: statistics.median(a / b for a, b in zip(pts["prealloc"][c]["run_tps"],
                                                                  pts[NO_GAUGES][c]["run_tps"])) for c in ctxs}
            out.append(dict(
                model=r["name"], target=f"memory gauges cost under {GAUGES_SHARE:.1%} of a decode step",
                value=share, passed=share < GAUGES_SHARE,
                detail=f"{gauge_us:.2f} us per reading, one every {LIVE_VIEW_EVERY} tokens: {share:.5%} of the "
                       f"median prealloc step at worst; A/B tok/s with / without them (paired): "
                       + ", ".join(f"{c}: {x:.3f}" for c, x in ratios.items()), ab=ratios))
        for mode in ("window", "window-quant"):
            if mode not in pts:
                continue
            budget = settings_for(args, mode).budget
            below = [c for c in ctxs if c <= budget]
            past = [c for c in ctxs if c > budget]
            if not below or not past:
                continue
            ref = max(below)
            # Paired per repeat: the run at each context past the budget over the run at the
            # reference context in the same repeat (one pass over the contexts takes seconds).
            ratios = {c: statistics.median(a / b for a, b in zip(pts[mode][c]["run_tps"], pts[mode][ref]["run_tps"]))
                      for c in past}
            worst = min(ratios, key=ratios.get)
            contrast = ""
            if "prealloc" in pts:
                pre = pts["prealloc"]
                contrast = (
                    f"; prealloc for contrast: "
                    f"{statistics.median(a / b for a, b in zip(pre[max(past)]['run_tps'], pre[ref]['run_tps'])):.2f}"
                    f" at {max(past)}")
            out.append(dict(
                model=r["name"], target=f"{mode} flat past its budget ({budget} tokens): tok/s >= "
                                        f"{FLAT_RATIO} x its tok/s at context {ref}",
                value=round(ratios[worst], 3), passed=ratios[worst] >= FLAT_RATIO,
                detail=f"worst at context {worst}: paired ratio {ratios[worst]:.2f} "
                       f"(medians {pts[mode][worst]['tps']:.2f} "
                       f"vs {pts[mode][ref]['tps']:.2f} tok/s; holds {pts[mode][worst]['held']} tokens)" + contrast))
    return out


def run(args) -> int:
    import mlx.core as mx

    from chatapp.backend.blas import current_blas

    blas = current_blas()
    if not blas.loaded:
        print("# WARNING: no optimised BLAS loaded (run through `chatapp bench`); numbers use the reference BLAS")
    specs = [s.strip() for s in args.models.split(",") if s.strip()]
    results = [bench_model(args, spec) for spec in specs]
    gauge_us = gauge_cost_us()
    targets = check_targets(args, results, gauge_us)

    rep = BenchReport("decode tok/s: chatapp cache modes vs mlx-lm, caches pre-filled with the same synthetic K/V",
                      ["model", "context", "mode", "held", "tok/s", "mlx-lm tok/s", "ratio", "peak MiB",
                       "active B/tok", "cache B/tok"])
    for r in results:
        pts = r["points"]
        for ctx in args.contexts:
            base = pts[MLX_LM][ctx]
            for mode in args.modes:
                if mode in r["skipped"]:
                    continue
                p = pts[mode][ctx]
                rep.add(r["name"], ctx, mode, p["held"], round(p["tps"], 2), round(base["tps"], 2),
                        round(p["ratio"], 3), round(p["peak_mib"], 2), round(p["active_per_token"]),
                        round(p["cache_per_token"]))
            rep.add(r["name"], ctx, MLX_LM, ctx, round(base["tps"], 2), round(base["tps"], 2), 1.0,
                    round(base["peak_mib"], 2), round(base["active_per_token"]), round(base["cache_per_token"]))
    rep.meta.update(
        method="caches filled with the same float32 random-normal K/V per context (no prefill); chatapp = "
               "Session.decode over make_caches(mode); mlx-lm = stream_generate over make_prompt_cache; "
               "run tok/s = 1000 / median step ms of the run; tok/s = median over runs; each repeat visits every "
               "context and peer (order reversed on alternate repeats); ratio = median over repeats of (run tok/s / "
               "mlx-lm run tok/s, same repeat and context); the targets use paired ratios",
        held="tokens the chatapp cache holds after the fill (window modes evict down to their budget)",
        memory="one extra run per context and peer, cache limit raised to the memory limit: peak MiB = peak active "
               "memory above what was held before the run (the cache's copy of the fill included); "
               "active / cache B/tok = growth of active memory and of "
               "MLX's buffer cache per decoded token (their sum: bytes newly allocated per token)",
        settings=f"window={args.window} sinks={args.sinks} max_kv_tokens={args.max_kv_tokens} "
                 f"evict_chunk={args.evict_chunk} quant_start={args.quant_start} kv_bits={args.kv_bits} "
                 f"kv_group_size={args.kv_group_size}",
        blas=f"{blas.name} ({blas.path})" if blas.loaded else f"reference ({blas.reason})",
        device=str(mx.default_device()), mlx=mx.__version__,
    )
    for r in results:
        rep.meta[f"model {r['name']}"] = f"{r['desc']}; {r['tokens']} tokens x {r['repeats']} repeats"
        for mode, why in r["skipped"].items():
            rep.meta[f"skipped {r['name']} {mode}"] = why
    from chatapp.engine.session import LIVE_VIEW_EVERY

    rep.meta["gauge_read_us"] = round(gauge_us, 2)
    rep.meta["gauge_reads"] = (f"one every {LIVE_VIEW_EVERY} decoded tokens: "
                               f"{gauge_us / LIVE_VIEW_EVERY:.2f} us per token")
    rep.meta["results"] = [{k: v for k, v in r.items()} for r in results]
    rep.meta["targets"] = targets

    def plot(path):
        # One axis for models 200x apart in speed: each model's tok/s relative to its mlx-lm
        # tok/s at the smallest context (the table has the absolute numbers).
        series = {}
        for r in results:
            short = r["name"].replace("stories260K", "s260K").replace(BIG, "7B-geom")
            base = r["points"][MLX_LM][args.contexts[0]]["tps"]
            for peer in r["peers"]:
                series[f"{short} {peer}"] = (args.contexts, [r["points"][peer][c]["tps"] / base for c in args.contexts])
        line_plot(path, f"decode tok/s relative to mlx-lm at context {args.contexts[0]} (synthetic K/V fill)",
                  "context (tokens)", "tok/s / mlx-lm tok/s at the smallest context", series, logx=True)

    emit(rep, args.json, plot, args.plot)
    print()
    print("## targets")
    for t in targets:
        print(f"{'PASS' if t['passed'] else 'FAIL'}  [{t['model']}] {t['target']}: {t['detail']}")
    return 0
