"""Recall of early facts after filler pushes them past the cache budget, per cache mode.

Each seeded conversation: a first user turn states three facts (a name, a number, a place), the
assistant acknowledges; ``--filler-turns`` turns of public-domain text (the bench text, KJV) push
the facts past the budget; a last turn asks for one fact. The reply is greedy (``--max-new``
tokens) through ``cache.make_caches(model, settings)`` after a chunked prefill of the whole
conversation (chunks of ``evict_chunk``, as the Session prefills evicting caches); it counts as
correct when it contains the fact. Rows: prealloc (everything held: the ceiling), then for each
``--budgets`` B window@B (sinks + window = B) and scored@B (max_kv_tokens = B, recent window
B/4): both full precision, so equal budgets are equal KV bytes (the KV bytes column shows it);
with ``--budget-quant`` also window-quant@B and scored-quant@B, sized to the same bytes (recent
window B/4 at full precision, the rest quantised: see quality_bench.equal_bytes_budget).

Only meaningful on a real instruction model (SmolLM2, the default); ``--random`` runs a tiny
random-weight model to check the plumbing.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

from chatapp.bench.quality_bench import SHARED, budget_list, equal_bytes_budget, model_itemsize, token_bytes

DEFAULT_MODEL = str(SHARED / "smollm2-135m-instruct")
TEXT = Path(__file__).resolve().parent / "texts" / "kjv-ruth-esther.txt"
NAMES = ["Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas"]
PLACES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Kyoto", "Dublin", "Cairo", "Quebec", "Perth", "Zagreb"]
ASKS = {"name": "What is my name?", "number": "What is my favourite number?", "place": "Which city do I live in?"}
# The start of the assistant's answer, given with the prompt (``--prime``): SmolLM2-135M answers a
# bare question with "I'm sorry, I'm not familiar with ..." even with the whole conversation held,
# but completes a started answer from the conversation.
PRIMERS = {"name": "Your name is", "number": "Your favourite number is", "place": "You live in"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder or GGUF (default ../shared SmolLM2)")
    p.add_argument("--random", action="store_true", help="tiny random-weight model (plumbing check only)")
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--filler-turns", type=int, default=6)
    p.add_argument("--filler-words", type=int, default=120, help="words of bench text per filler turn")
    p.add_argument("--budgets", type=budget_list, default=[512], help="comma list of token budgets (default 512)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--evict-chunk", type=int, default=64)
    p.add_argument("--budget-quant", action="store_true",
                   help="also rows window-quant@B and scored-quant@B at the KV bytes of B full-precision tokens")
    p.add_argument("--kv-bits", type=int, choices=(4, 8), default=8, help="kv_bits of the --budget-quant rows")
    p.add_argument("--cache-mode", default=None,
                   help="comma list of row labels to run (e.g. prealloc,window@512,scored-quant@512); default all")
    p.add_argument("--fast-path", action="store_true",
                   help="run through the app's CPU fast path (kernels, fused decode) instead of MLX's own route")
    p.add_argument("--prime", action="store_true",
                   help="start the assistant's answer (\"Your name is\", ...) so a small model completes it")
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


def conversation(rng: random.Random, words: list[str], turns: int, per_turn: int) -> tuple[list[dict], str]:
    facts = dict(name=rng.choice(NAMES), number=str(rng.randint(10, 99)), place=rng.choice(PLACES))
    msgs = [{"role": "user", "content": f"Remember this: my name is {facts['name']}, my favourite number is "
                                        f"{facts['number']} and I live in {facts['place']}."},
            {"role": "assistant", "content": "Noted, I will remember."}]
    for _ in range(turns):
        start = rng.randrange(0, max(1, len(words) - per_turn))
        msgs.append({"role": "user", "content": "Read this: " + " ".join(words[start : start + per_turn])})
        msgs.append({"role": "assistant", "content": "I have read it."})
    kind = rng.choice(sorted(ASKS))
    msgs.append({"role": "user", "content": ASKS[kind]})
    return msgs, facts[kind], PRIMERS[kind]


def render(tokenizer, msgs: list[dict]) -> list[int]:
    try:
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    except Exception:  # no chat template (the random model's byte tokenizer): a plain layout
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
        return list(tokenizer.encode(text))


def answer(model, settings, geom, prompt: list[int], max_new: int) -> tuple[list[int], Any]:
    import mlx.core as mx

    from cache import make_caches

    caches = make_caches(model, settings, geom)
    step = settings.evict_chunk if settings.evicts else 512
    logits = None
    for i in range(0, len(prompt), step):
        logits = model(mx.array([prompt[i : i + step]]), cache=caches)[:, -1]
    out = []
    for _ in range(max_new):
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)[:, -1]
    return out, caches


def run(args) -> int:
    import mlx.core as mx

    from cache import CacheSettings, model_geometry, total_usage
    from chatapp.bench.quality_bench import RANDOM_SHAPE
    from chatapp.bench.report import BenchReport, emit

    if args.random:
        from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

        model, _ = build_random_llama(LlamaShape(**RANDOM_SHAPE), seed=args.seed)
        tokenizer, desc = byte_tokenizer(), "random-weight Llama (plumbing check: its answers mean nothing)"
    else:
        from chatapp.model.loader import load_model

        lm = load_model(args.model, cast_scales=not args.fast_path)  # the fast path keeps float16 scales
        model, tokenizer, desc = lm.model, lm.tokenizer, lm.model_id
        if args.fast_path:
            from chatapp.bench.common import fast_path

            desc += f"; CPU fast path: {fast_path(model, off=False)}"
    geom = model_geometry(model)
    words = TEXT.read_text(encoding="utf-8").split()
    rng = random.Random(args.seed)
    convs = [conversation(rng, words, args.filler_turns, args.filler_words) for _ in range(args.conversations)]
    prompts = [(render(tokenizer, m) + (list(tokenizer.encode(primer))
                                        if args.prime else []), fact) for m, fact, primer in convs]
    rows = [("prealloc", CacheSettings(mode="prealloc"))]
    for b in args.budgets:
        rows.append((f"window@{b}", CacheSettings(mode="window", sinks=args.sinks, window=b - args.sinks,
                                                  evict_chunk=args.evict_chunk)))
        w = max(args.sinks, b // 4)
        rows.append((f"scored@{b}", CacheSettings(mode="scored", sinks=args.sinks, window=w, max_kv_tokens=b,
                                                  evict_chunk=args.evict_chunk)))
        if args.budget_quant:
            sizes = token_bytes(geom, model_itemsize(model), args.kv_bits, 64)
            budget = equal_bytes_budget(b, w, args.sinks, args.evict_chunk, *sizes)
            for mode in ("window-quant", "scored-quant"):
                rows.append((f"{mode}@{b}", CacheSettings(mode=mode, sinks=args.sinks, window=w, max_kv_tokens=budget,
                                                          evict_chunk=args.evict_chunk, kv_bits=args.kv_bits)))
    if args.cache_mode:
        wanted = [x.strip() for x in args.cache_mode.split(",") if x.strip()]
        bad = [x for x in wanted if x not in {label for label, _ in rows}]
        if bad:
            raise SystemExit(f"--cache-mode: unknown rows {bad}; choose from {', '.join(label for label, _ in rows)}")
        rows = [r for r in rows if r[0] in wanted]
    rep = BenchReport("recall: early facts asked for after filler, greedy answers per cache mode",
                      ["mode", "conversations", "correct", "fraction", "mean prompt tokens", "mean KV bytes held",
                       "seconds"])
    for label, s in rows:
        correct, held, t0 = 0, 0, time.perf_counter()
        for prompt, fact in prompts:
            out, caches = answer(model, s, geom, prompt, args.max_new)
            correct += fact.lower() in tokenizer.decode(out).lower()
            held += total_usage(caches).bytes_held
            mx.clear_cache()
        n = len(prompts)
        rep.add(label, n, correct, round(correct / n, 3), round(sum(len(p) for p, _ in prompts) / n),
                held // n, round(time.perf_counter() - t0, 1))
        print(f"# {label}: {correct}/{n}")
    rep.meta.update(model=desc, seed=args.seed, filler_turns=args.filler_turns, filler_words=args.filler_words,
                    max_new=args.max_new, text=str(TEXT.name), device=str(mx.default_device()))
    emit(rep, args.json)
    return 0
