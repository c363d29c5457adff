"""`chatapp bench numerics`: what ``cpu.numerics = fast`` costs in quality and gains in speed.

A Llama GGUF (default: SmolLM2-135M Q4_1 from ../shared) is read into mlx-lm's
Llama by the app's own GGUF loader (chatapp.model.gguf), given
the CPU fast path twice in one process, exact and fast, and then:

- quality: a long English text (default: ../shared/docs/architecture.md) teacher-forced one token
  at a time through the fused decode step of each route: perplexity, the largest logit difference
  against exact (relative to exact's largest |logit|), and how often the two routes' argmax agree;
- speed: greedy decode tokens/s of each route, alternating exact/fast ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from chatapp.bench.common import SMOLLM2_GGUF
from chatapp.bench.report import BenchReport, emit

SHARED = Path(__file__).resolve().parents[3] / "shared"
DEFAULT_MODEL = SMOLLM2_GGUF
DEFAULT_TEXT = SHARED / "docs" / "architecture.md"

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL),
                   help="a Llama GGUF with 4-bit weights (default SmolLM2-135M Q4_1)")
    p.add_argument("--text", default=str(DEFAULT_TEXT),
                   help="text for the perplexity (default ../shared/docs/architecture.md)")
    p.add_argument("--tokens", type=int, default=512, help="text tokens teacher-forced per route (default 512)")
    p.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens per speed run (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="speed runs per route, alternating (default 3)")
    p.add_argument("--threads", type=int, default=0, help="kernel threads (0: one per core)")
    p.add_argument("--prefill", type=int, default=256,
                   help="also: the first N text tokens as one prefill chunk (the fused prefill), the rest "
                   "teacher-forced, for each route (0: skip; default 256)")
    p.add_argument("--prefill-blocks", default="",
                   help="more fast prefill rows, e.g. '8,64': elements per int8 activation scale in the "
                   "prefill's products (kernels/int8panel.py; default: none, only its PREFILL_ACT_BLOCK)")
    p.add_argument("--prefill-down", default="",
                   help="more fast prefill rows, e.g. 'exact,wide': the prefill's down_proj exact or on 16-bit "
                   "activations instead of int8 ones (default: none)")
    p.add_argument("--prefill-scores", default="",
                   help="more fast prefill rows, e.g. 'exact': the prefill chunk's attention scores on floats "
                   "instead of u8 keys and int8 queries (where the CPU has vpdpbusd; default: none)")
    p.add_argument("--kv-dtype-rows", default="",
                   help="more exact rows with the fused routes' K/V in these dtypes, e.g. 'float32' "
                   "(the models run cpu.kv_dtype auto: float16 where the CPU has F16C; default: none)")
    p.add_argument("--decode-down", default="",
                   help="more fast rows with the decode step's down_proj on these: 'wide' (16-bit "
                   "activations), 'exact' (float32) or 'int8' (what fast runs) (default: none)")
    p.add_argument("--head", default="",
                   help="more fast rows with the output head on these: 'exact' (float32 activations) or "
                   "'int8' (what fast runs) (default: none)")
    p.add_argument("--variants", default="",
                   help="more fast variants for the quality rows, e.g. 'b32,b8,b16-all': activation "
                   "elements per int8 scale, '-all' with the last layer on int8 too (default: none)")


def _variants(spec: str) -> list[tuple[str, int, bool]]:
    out = []
    for v in (s.strip() for s in spec.split(",") if s.strip()):
        block, _, rest = v.removeprefix("b").partition("-")
        if not block.isdigit() or int(block) not in (8, 16, 32) or rest not in ("", "all"):
            raise SystemExit(f"--variants: {v!r} is not b8|b16|b32 with an optional -all")
        out.append((f"fast {v}", int(block), rest != "all"))
    return out


def load_gguf_llama(path: str):
    """(model, tokenizer) through the app's own GGUF loader (chatapp.model.gguf: its RoPE layout,
    tokenizer and per-layer bit widths), scales kept as stored for the CPU kernels."""
    from chatapp.model.loader import load_model

    lm = load_model(path, cast_scales=False)
    return lm.model, lm.tokenizer


def _teacher_forced(model, ids: list[int]):
    """Per-position logits (numpy) through single-token steps (the fused route), chatapp's caches."""
    import mlx.core as mx
    import numpy as np

    from cache import CacheSettings, make_caches

    caches = make_caches(model, CacheSettings(mode="prealloc"))
    out = []
    for t in ids[:-1]:
        logits = model(mx.array([[t]]), cache=caches)[0, -1]
        mx.eval(logits)
        out.append(np.array(logits))
    return out


def _prefilled(model, ids: list[int], n: int):
    """Per-position logits of ids[n:] after a prefill chunk of ids[:n] (the session's route)."""
    import mlx.core as mx
    import numpy as np

    from cache import CacheSettings, make_caches
    from chatapp.backend.qlinear import last_position_only

    caches = make_caches(model, CacheSettings(mode="prealloc"))
    with last_position_only():
        first = model(mx.array([ids[:n]]), cache=caches)[0, -1]
    mx.eval(first)
    out = [np.array(first)]
    for t in ids[n:-1]:
        logits = model(mx.array([[t]]), cache=caches)[0, -1]
        mx.eval(logits)
        out.append(np.array(logits))
    return out


def _ppl(logits, ids) -> float:
    import numpy as np

    nll = 0.0
    for lg, t in zip(logits, ids[1:]):
        m = lg.max()
        nll += float(m + np.log(np.exp(lg - m).sum()) - lg[t])
    return math.exp(nll / len(logits))


def _decode_rate(model, n: int) -> float:
    import mlx.core as mx

    from cache import CacheSettings, make_caches

    caches = make_caches(model, CacheSettings(mode="prealloc"))
    tok = 1
    stamps = []
    for _ in range(n + 1):
        tok = int(mx.argmax(model(mx.array([[tok]]), cache=caches)[0, -1]).item())
        stamps.append(time.perf_counter())
    return n / (stamps[-1] - stamps[0])


def run(args) -> int:
    import numpy as np

    from chatapp.backend.cpu import apply_fast_path
    from chatapp.backend.fused_settings import DOWN_CHOICES, HEAD_CHOICES, SCORES_CHOICES
    from chatapp.bench.common import loadavg

    variants = _variants(args.variants)
    decode_downs = [d.strip() for d in args.decode_down.split(",") if d.strip()]
    downs = [d.strip() for d in args.prefill_down.split(",") if d.strip()]
    if any(d not in DOWN_CHOICES for d in decode_downs + downs):
        raise SystemExit(f"--decode-down / --prefill-down: {args.decode_down!r} / {args.prefill_down!r} "
                         f"are not lists of {'|'.join(DOWN_CHOICES)}")
    scores = [c.strip() for c in args.prefill_scores.split(",") if c.strip()]
    if any(c not in SCORES_CHOICES for c in scores):
        raise SystemExit(f"--prefill-scores: {args.prefill_scores!r} is not a list of {'|'.join(SCORES_CHOICES)}")
    heads = [h.strip() for h in args.head.split(",") if h.strip()]
    if any(h not in HEAD_CHOICES for h in heads):
        raise SystemExit(f"--head: {args.head!r} is not a list of {'|'.join(HEAD_CHOICES)}")
    load_start = loadavg()
    models = {}
    for numerics in ("exact", "fast"):
        model, tokenizer = load_gguf_llama(args.model)
        plan = apply_fast_path(model, backend="cpu", threads=args.threads, numerics=numerics)
        print(f"# {numerics}: {plan.fused_decode}", flush=True)
        models[numerics] = model
    ids = tokenizer.encode(Path(args.text).read_text(), add_special_tokens=False)[: args.tokens]
    logits = {n: _teacher_forced(m, ids) for n, m in models.items()}
    from chatapp.backend.fused_install import fused_decoder
    from chatapp.backend.fused_settings import resolve_kv_dtype

    dec = fused_decoder(models["fast"])
    for name, block, last_exact in variants:
        dec.set_fast(True, block, last_exact)
        logits[name] = _teacher_forced(models["fast"], ids)
    for d in decode_downs:
        dec.set_fast(True, decode_down=d)
        logits[f"fast, decode down {d}"] = _teacher_forced(models["fast"], ids)
    for h in heads:
        dec.set_fast(True, head=h)
        logits[f"fast, head {h}"] = _teacher_forced(models["fast"], ids)
    dec.set_fast(True)
    kv_rows = [d.strip() for d in args.kv_dtype_rows.split(",") if d.strip()]
    dec_exact = fused_decoder(models["exact"])
    kv_default = dec_exact.kv_dtype
    for kv in kv_rows:  # caches made afresh take the decoder's K/V dtype (FusedDecoder.adopt)
        dec_exact.kv_dtype = resolve_kv_dtype(kv)
        logits[f"exact, K/V {kv}"] = _teacher_forced(models["exact"], ids)
    dec_exact.kv_dtype = kv_default
    print(f"# K/V cache of the exact and fast rows: {kv_default}", flush=True)
    ex = logits["exact"]
    rel = {n: max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(lg, ex)) for n, lg in logits.items()}
    agree = {n: sum(int(a.argmax() == b.argmax()) for a, b in zip(lg, ex)) / len(ex) for n, lg in logits.items()}
    pre = {}
    blocks = [int(b) for b in args.prefill_blocks.split(",") if b.strip()]
    if 0 < args.prefill < len(ids) - 1:
        pre = {n: _prefilled(models[n], ids, args.prefill) for n in ("exact", "fast")}
        for kv in kv_rows:
            dec_exact.kv_dtype = resolve_kv_dtype(kv)
            pre[f"exact, K/V {kv}"] = _prefilled(models["exact"], ids, args.prefill)
        dec_exact.kv_dtype = kv_default
        for b in blocks:
            dec.set_fast(True, prefill_block=b)
            pre[f"fast, block {b}"] = _prefilled(models["fast"], ids, args.prefill)
        for d in downs:
            dec.set_fast(True, prefill_down=d)
            pre[f"fast, down {d}"] = _prefilled(models["fast"], ids, args.prefill)
        for c in scores:
            dec.set_fast(True, prefill_scores=c)
            pre[f"fast, scores {c}"] = _prefilled(models["fast"], ids, args.prefill)
        dec.set_fast(True)
    rates: dict[str, list[float]] = {"exact": [], "fast": []}
    for r in range(max(1, args.repeats)):
        for n in ("exact", "fast") if r % 2 == 0 else ("fast", "exact"):
            rates[n].append(_decode_rate(models[n], args.decode_tokens))
    rep = BenchReport(f"numerics: {Path(args.model).name}, {len(ids)} text tokens teacher-forced",
                      ["numerics", "perplexity", "ppl / exact", "max |dlogit| / max |logit|", "argmax = exact",
                       "decode tok/s (runs)", "decode x exact (per run)"])
    ppl = {n: _ppl(lg, ids) for n, lg in logits.items()}
    for n in logits:
        rep.add(n, ppl[n], ppl[n] / ppl["exact"], rel[n], agree[n],
                ", ".join(f"{v:.1f}" for v in rates.get(n, [])),
                ", ".join(f"{a / b:.2f}" for a, b in zip(rates.get(n, []), rates["exact"])))
    if pre:
        tail = ids[args.prefill - 1:]
        p_ex, p_fa = _ppl(pre["exact"], tail), _ppl(pre["fast"], tail)
        d = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(pre["fast"], pre["exact"]))
        rep.add(f"exact, prefill {args.prefill}", p_ex, 1.0, 0.0, 1.0, "", "")
        agree_p = sum(int(a.argmax() == b.argmax()) for a, b in zip(pre["fast"], pre["exact"])) / len(pre["exact"])
        rep.add(f"fast, prefill {args.prefill}", p_fa, p_fa / p_ex, d, agree_p, "", "")
        ppl[f"exact, prefill {args.prefill}"], ppl[f"fast, prefill {args.prefill}"] = p_ex, p_fa

        def prefill_row(label: str, lg: list) -> None:
            """One more prefilled route against the exact prefill: perplexity, logit error, agreement."""
            p = _ppl(lg, tail)
            d = max(float(np.abs(a - e).max() / np.abs(e).max()) for a, e in zip(lg, pre["exact"]))
            agree = sum(int(a.argmax() == e.argmax()) for a, e in zip(lg, pre["exact"])) / len(pre["exact"])
            rep.add(label, p, p / p_ex, d, agree, "", "")
            ppl[label] = p

        for kv in kv_rows:
            prefill_row(f"exact, K/V {kv}, prefill {args.prefill}", pre[f"exact, K/V {kv}"])
        for key in [f"block {b}" for b in blocks] + [f"down {d}" for d in downs] + [f"scores {c}" for c in scores]:
            prefill_row(f"fast, prefill {args.prefill}, {key}", pre[f"fast, {key}"])
    print(rep.table())
    print(f"# load average: {load_start} at the start, {loadavg()} at the end")
    rep.meta.update(load_average_start=load_start, load_average_end=loadavg(), rates=rates, perplexity=ppl)
    emit(rep, args.json, None, None)
    return 0
