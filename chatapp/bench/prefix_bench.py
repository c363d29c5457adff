"""Time to first token of a new conversation with a long system prompt: cold vs warm from the prefix store.

For each model and each system-prompt length in ``--system-tokens`` (tokens the system prompt
alone renders to), in a temporary data directory:

1. a first conversation (system prompt + :data:`FIRST_MESSAGE`) runs one turn through
   :class:`chatapp.store.chat.PersistentChat` with the prefix store on, and ``after_turn()``
   stores its prompt's K/V in the prefix store (untimed; its size is reported);
2. then, ``--repeats`` times, alternating which goes first, a *new* conversation with the same
   system prompt and another first message (:data:`NEXT_MESSAGE`) is answered by a fresh
   ``Session`` (as a new chat or a new process would be):

   * cold: no prefix store: the whole prompt is prefilled;
   * warm: the prefix store attached: the longest stored prefix of the prompt (the system prompt
     and the first message's tokens it shares) is read, checked, converted into the session's
     cache mode, and only the rest is prefilled.

TTFT is the Session's own ``TurnStats.ttft``: from the start of ``reply()`` (prompt rendering and
tokenisation included, and for warm the whole prefix-store lookup) to the first token. Both
replies are greedy, ``--max-tokens`` long; the bench checks that cold and warm generate the same
token ids. Targets (:data:`TARGETS`): warm at least 10x sooner than cold at 2,000 system tokens,
and at least 3x at 360 (issue 16's, on SmolLM2: ``--model FILE.gguf --system-tokens 360``).

Models (``--models``): ``stories`` (``../shared/models/stories260K-4bit``) and ``random``: a
random-weight 4-bit Llama of realistic width (hidden 2048, 4 layers, 16 heads of 128 sharing 4 KV
heads, intermediate 5632) with Llama 2's tokenizer and vocabulary (``../shared/models/llama2-tokenizer``;
saved to a folder and loaded through ``load_model`` as a downloaded model would be), or with a byte
tokenizer (``--random-tokenizer bytes``, vocab 258). Both get the app's CPU fast path, as
``load_engine`` sets it up. Cache mode ``--mode`` (default auto, as the app).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from chatapp.bench.common import STORIES, fast_path, load_stories, model_names, start_bench
from chatapp.bench.report import BenchReport, emit, int_list, line_plot

RANDOM_SHAPE = dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=128, intermediate_size=5632, vocab_size=258, max_position_embeddings=4096)
LLAMA2_TOKENIZER = STORIES.parent / "llama2-tokenizer"
# (system tokens at least, speedup at least): warm against cold with identical greedy tokens
TARGETS = ((2000, 10.0), (360, 3.0))
FIRST_MESSAGE = "Tell me a story about a little cat who lived near the sea."
NEXT_MESSAGE = "What did the little dog find in the garden?"
PERSONA = ("You are a friendly storyteller for small children. You tell short, happy stories about animals, "
           "families and friends, with simple words and a kind ending. Lily is a little girl who loves her dog "
           "Max, her red ball and the big tree in the park. ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="stories,random",
                   help="comma list: stories (stories260K-4bit) and/or random (a 4-bit random Llama, hidden 2048)")
    p.add_argument("--stories", default=str(STORIES), help="the stories260K-4bit folder")
    p.add_argument("--random-tokenizer", choices=("llama2", "bytes"), default="llama2",
                   help="the random model's tokenizer: Llama 2's (vocab 32000, from --llama2-tokenizer; default) "
                        "or bytes (vocab 258)")
    p.add_argument("--llama2-tokenizer", default=str(LLAMA2_TOKENIZER), help="the llama2-tokenizer folder")
    p.add_argument("--system-tokens", type=lambda t: int_list(t, minimum=16), default=[500, 1000, 2000],
                   help="system prompt lengths in tokens (default 500,1000,2000)")
    p.add_argument("--repeats", type=int, default=3, help="timed cold and warm runs per length (default 3)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per reply (default 16)")
    p.add_argument("--mode", default="auto", help="cache mode (default auto)")
    p.add_argument("--no-fast-path", action="store_true", help="do not apply the CPU fast path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", metavar="FILE", default=None,
                   help="run this model (a GGUF file or model folder, loaded as the app loads it) instead of --models")


def _load(name: str, args, tmp: Path) -> tuple[Any, Any, Any, str]:
    if name == "stories":
        return load_stories(args.stories)
    if name == "model":  # --model: through the app's loader (scales as stored, as load_engine does)
        from chatapp.model.loader import load_model
        from chatapp.store.chat import ModelIdentity

        lm = load_model(args.model, cast_scales=False)
        desc = f"{lm.model_id} ({lm.format}): {lm.n_layers} layers, {lm.n_kv_heads} KV heads of {lm.head_dim}"
        return lm.model, lm.tokenizer, ModelIdentity.from_loaded(lm, args.model), desc
    from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer
    from chatapp.store.chat import ModelIdentity

    shape = dict(RANDOM_SHAPE)
    desc = (f"random 4-bit Llama: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
            f"{shape['num_attention_heads']} heads of {shape['head_dim']} / {shape['num_key_value_heads']} KV heads, "
            f"intermediate {shape['intermediate_size']}")
    if args.random_tokenizer == "llama2" and (Path(args.llama2_tokenizer) / "tokenizer.model").exists():
        # Llama 2's own tokenizer and vocabulary: real text takes as many tokens as on Llama-2-7B
        # (a byte tokenizer would make every message about four times longer).
        from chatapp.model.loader import load_model, save_model_dir

        model, config = build_random_llama(LlamaShape(**{**shape, "vocab_size": 32000}), seed=args.seed,
                                           quantize_bits=4)
        lm = load_model(str(save_model_dir(tmp / "random-llama2", model, config, args.llama2_tokenizer)))
        return lm.model, lm.tokenizer, ModelIdentity.from_loaded(lm), f"{desc}, Llama 2's tokenizer (vocab 32000)"
    if args.random_tokenizer == "llama2":
        print(f"# no Llama 2 tokenizer at {args.llama2_tokenizer}: the random model uses a byte tokenizer")
    model, _ = build_random_llama(LlamaShape(**shape), seed=args.seed, quantize_bits=4)
    ident = ModelIdentity("random-4bit", "random", f"random-seed-{args.seed}")
    return model, byte_tokenizer(), ident, f"{desc}, byte tokenizer (vocab {shape['vocab_size']})"


def system_prompt(session, tokens: int) -> str:
    """The persona repeated, cut at the word where the system prompt alone reaches ``tokens``."""
    from chatapp.prompt.conversation import Conversation

    words = (PERSONA * (tokens // 8 + 2)).split(" ")

    def size(n: int) -> int:
        return len(session.format.tokens(Conversation.start(" ".join(words[:n])), generation_prompt=False))

    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi) // 2
        if size(mid) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def _session(model, tok, args, system: str):
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session

    return Session(model, tok, mode=args.mode, system=system,
                   generation=GenerationSettings(temp=0.0, max_tokens=args.max_tokens, ignore_eos=True))


def _answer(session, message: str) -> dict:
    from chatapp.engine.generate import run_turn

    done = run_turn(session.send(message))
    st = done.stats
    return dict(ttft=st.ttft, prompt=st.prompt_tokens, prefix=st.prefix_tokens, prefix_s=st.prefix_seconds,
                prefilled=st.prefill_tokens, tokens=list(session.cached[st.prompt_tokens:]), text=done.text,
                mode=st.mode)


def _store_first(model, tok, ident, args, data_dir: Path, system: str) -> dict:
    """The first conversation: one turn, then its prompt goes into the prefix store."""
    from chatapp.store.chat import open_chat
    from chatapp.store.paths import prefix_dir

    s = _session(model, tok, args, system)
    chat = open_chat(s, ident, data_dir, prefix_cap_mb=4096)
    _answer(s, FIRST_MESSAGE)
    t0 = time.perf_counter()
    stored = chat.store_prefix()
    seconds = time.perf_counter() - t0
    chat.close()
    size = sum(p.stat().st_size for p in prefix_dir(data_dir).iterdir())
    return dict(stored=stored, seconds=seconds, bytes=size)


def _cold(model, tok, args, system: str) -> dict:
    return _answer(_session(model, tok, args, system), NEXT_MESSAGE)


def _warm(model, tok, ident, args, data_dir: Path, system: str) -> dict:
    from chatapp.store.chat import open_chat

    s = _session(model, tok, args, system)
    chat = open_chat(s, ident, data_dir, save=False, prefix_cap_mb=4096)  # reads the store, writes nothing
    out = _answer(s, NEXT_MESSAGE)
    chat.close()
    if not out["prefix"]:
        raise SystemExit(f"prefix bench: the warm run found nothing in the prefix store: "
                         f"{[str(n) for n in chat.take_notes()]}")
    return out


def run(args) -> int:
    blas = start_bench()
    names = ["model"] if args.model else model_names(args.models, args.stories)

    rep = BenchReport("prefix: TTFT of a new conversation with a long system prompt, cold vs warm (median ms)",
                      ["model", "system tokens", "prompt tokens", "from store", "store MiB", "TTFT cold ms",
                       "TTFT warm ms", "read+convert ms", "speedup", "same tokens"])
    series: dict[str, tuple[list[float], list[float]]] = {}
    targets, models_meta, runs_meta = [], {}, []
    all_same = True
    with tempfile.TemporaryDirectory(prefix="chatapp-prefix-bench-") as tmp:
        for name in names:
            model, tok, ident, desc = _load(name, args, Path(tmp))
            label = Path(args.model).name if name == "model" else name  # the file, in the table
            fp = fast_path(model, args.no_fast_path)
            models_meta[name] = dict(model=desc, fast_path=fp)
            print(f"# {name}: {desc}\n# {fp}")
            probe = _session(model, tok, args, "")
            warm_dir = Path(tmp) / f"{name}-warmup"
            system = system_prompt(probe, min(args.system_tokens))
            _store_first(model, tok, ident, args, warm_dir, system)  # warm-up, untimed
            _cold(model, tok, args, system)
            _warm(model, tok, ident, args, warm_dir, system)
            xs, ys_cold, ys_warm = [], [], []
            for length in args.system_tokens:
                system = system_prompt(probe, length)
                data_dir = Path(tmp) / f"{name}-{length}"
                stored = _store_first(model, tok, ident, args, data_dir, system)
                cold, warm = [], []
                for r in range(args.repeats):
                    if r % 2 == 0:
                        cold.append(_cold(model, tok, args, system))
                        warm.append(_warm(model, tok, ident, args, data_dir, system))
                    else:
                        warm.append(_warm(model, tok, ident, args, data_dir, system))
                        cold.append(_cold(model, tok, args, system))
                same = all(c["tokens"] == w["tokens"] and c["text"] == w["text"] for c, w in zip(cold, warm))
                all_same = all_same and same
                t_cold = statistics.median(x["ttft"] for x in cold) * 1000
                t_warm = statistics.median(x["ttft"] for x in warm) * 1000
                t_load = statistics.median(x["prefix_s"] for x in warm) * 1000
                speedup = t_cold / t_warm
                rep.add(label, length, cold[-1]["prompt"], warm[-1]["prefix"], round(stored["bytes"] / (1 << 20), 2),
                        round(t_cold, 1), round(t_warm, 1), round(t_load, 1), round(speedup, 1),
                        "yes" if same else "NO")
                runs_meta.append(dict(model=name, system_tokens=length, stored=stored, mode=warm[-1]["mode"],
                                      cold=[{k: v for k, v in c.items() if k != "text"} for c in cold],
                                      warm=[{k: v for k, v in w.items() if k != "text"} for w in warm]))
                xs.append(length)
                ys_cold.append(t_cold)
                ys_warm.append(t_warm)
                print(f"# {name} {length} system tokens: cold {t_cold:.1f} ms, warm {t_warm:.1f} ms "
                      f"({speedup:.1f}x), tokens {'identical' if same else 'DIFFER'}")
                for at_least, wanted in TARGETS:
                    if length >= at_least:
                        targets.append(dict(model=label, system_tokens=length, wanted=wanted, speedup=round(speedup, 2),
                                            same_tokens=same, passed=speedup >= wanted and same))
                        break  # the most demanding target the length reaches
            series[f"{name}: cold"] = (xs, ys_cold)
            series[f"{name}: warm (prefix store)"] = (xs, ys_warm)
    rep.meta.update(
        models=models_meta, mode=args.mode, repeats=args.repeats, max_tokens=args.max_tokens,
        first_message=FIRST_MESSAGE, next_message=NEXT_MESSAGE, blas=getattr(blas, "name", str(blas)),
        method="first conversation stores its prompt (untimed); then a new conversation with the same system prompt "
               "and another message, fresh Session per run: cold = no prefix store, warm = prefix store attached; "
               "TTFT = TurnStats.ttft (rendering, lookup, read, conversion and prefill included); medians",
        targets=targets, runs=runs_meta, tokens_identical=all_same,
    )
    emit(rep, args.json, lambda path: line_plot(
        path, "TTFT of a new conversation: cold vs prefix store", "system prompt tokens", "ms", series,
        logx=True, logy=True), args.plot)
    print()
    print("## targets")
    for t in targets:
        print(f"{'PASS' if t['passed'] else 'FAIL'}  [{t['model']}] warm >= {t['wanted']:g}x faster than cold at "
              f"{t['system_tokens']} system tokens with identical greedy tokens: {t['speedup']}x, "
              f"tokens {'identical' if t['same_tokens'] else 'DIFFER'}")
    return 0 if all_same else 1
