"""Time to first token over a scripted multi-turn chat: cache reuse vs re-prefilling every turn.

A fixed list of user messages (``--turns`` of them, up to 20) is sent greedily with a fixed
``--max-tokens`` per reply.

* reuse: one ``Session`` for the whole conversation, as the app runs it: each turn renders the
  conversation, keeps the cached prefix it shares with the cache and prefills only the rest.
* stateless: what a stateless client does: before each turn a fresh ``Session`` gets the
  conversation so far (the same messages and replies, so the same prompt tokens) and prefills
  all of it; the reply is cancelled once its first token is out.

TTFT is the Session's own ``TurnStats.ttft`` (from the start of ``reply()`` to the first token,
prompt rendering and tokenisation included). Within a turn the two are measured one after the
other, alternating which goes first; the whole conversation runs ``--repeats`` times (a fresh
reuse session each time) and the table shows per-turn medians. One untimed warm-up turn of each
kind runs first.

Before each measured turn the bench waits ``--pause`` seconds (0.2), as a user typing would.
Without it, a turn starts within microseconds of the previous reply's last decode step, while the
BLAS worker threads of that decode (numpy's, for the decode matvecs, or MLX's OpenBLAS) still
spin-wait for work (OpenBLAS keeps them busy ~0.1 s); the next prefill's BLAS threads then fight
them for the two cores, and on the random model turn 1's TTFT swung between 80 and 240 ms for the
same work. Both paths get the same pause.

Models: ``--model`` (default ``../shared/models/stories260K-4bit``), or ``--random``: a
random-weight 4-bit Llama (hidden 1024, 4 layers, 8 heads of 128, intermediate 2816, byte-level
tokenizer, vocab 258, output rows of the non-ASCII bytes zeroed so that it writes ASCII) where the
prefill cost is visible. By default the model gets the app's
CPU fast path (``chatapp.backend.cpu.apply_fast_path``: ``accelerate_model`` with
``dense_weights=auto`` and the numpy prefill attention kernel), as the ``[cpu]`` config does; without it, 4-bit
prefill runs through ``quantized_matmul`` at ~15 tokens/s on this CPU for the random model, and a 20-turn stateless
run would take an hour.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from chatapp.bench.report import BenchReport, emit, line_plot

DEFAULT_MODEL = str(Path(__file__).resolve().parents[3] / "shared" / "models" / "stories260K-4bit")
TTFT_GROWTH = 1.5  # reuse: last turn's TTFT within this factor of turn 1's

MESSAGES = [
    "Tell me a story about a little cat.",
    "What was the cat's name?",
    "Where did the cat live?",
    "Did the cat have a friend?",
    "What did they like to play?",
    "One day it started to rain. What did they do?",
    "Was the cat scared of the thunder?",
    "Who came to help them?",
    "What did mom say to the cat?",
    "Then the sun came out. Where did they go?",
    "Did they find something in the park?",
    "What colour was the ball?",
    "Why was the dog sad?",
    "How did the cat make the dog happy?",
    "What did they eat for lunch?",
    "Did they share their food?",
    "What happened when it got dark?",
    "Where did the cat sleep that night?",
    "What did the cat dream about?",
    "How does the story end?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="model folder (default ../shared/models/stories260K-4bit)")
    p.add_argument("--random", action="store_true",
                   help="use a random-weight 4-bit Llama (hidden 1024, 4 layers, 8 heads of 128) with a byte tokenizer")
    p.add_argument("--turns", type=int, default=20, help=f"turns (1-{len(MESSAGES)}, default 20)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per reply (default 32)")
    p.add_argument("--mode", default="prealloc", help="cache mode of both sessions (default prealloc)")
    p.add_argument("--repeats", type=int, default=7, help="times the conversation is run (default 7)")
    p.add_argument("--dense-weights", choices=("auto", "on", "off"), default="auto",
                   help="CPU fast path: keep float32 copies of 4-bit weights (default auto, as the app)")
    p.add_argument("--no-fast-path", action="store_true", help="do not apply the CPU fast path")
    p.add_argument("--mlx-attention", action="store_true",
                   help="CPU fast path without its numpy prefill attention (MLX SDPA throughout)")
    p.add_argument("--pause", type=float, default=0.2,
                   help="seconds to wait before each measured turn, as a user typing would (default 0.2)")
    p.add_argument("--seed", type=int, default=0)


RANDOM_SHAPE = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                    head_dim=128, intermediate_size=2816, vocab_size=258, max_position_embeddings=4096)


def load(args) -> tuple[Any, Any, str]:
    if args.random:
        from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

        tokenizer = byte_tokenizer()
        # Random weights emit random bytes, mostly invalid UTF-8, which no text can carry back to
        # the same ids; silencing the non-ASCII bytes makes the model write (meaningless) ASCII,
        # so its replies round-trip through the transcript as a real model's text does.
        non_ascii = tuple(i for i in range(256) if not tokenizer.decode([i]).isascii())
        model, _ = build_random_llama(LlamaShape(**RANDOM_SHAPE), seed=args.seed, quantize_bits=4,
                                      silent_tokens=non_ascii)
        desc = ("random 4-bit Llama: hidden 1024, 4 layers, 8 heads (8 KV heads) of 128, intermediate 2816, "
                "byte tokenizer (vocab 258), non-ASCII bytes silenced")
        return model, tokenizer, desc
    from chatapp.model.loader import load_model

    lm = load_model(args.model)
    return lm.model, lm.tokenizer, (f"{lm.model_id}: {lm.n_layers} layers, "
                                    f"{lm.n_kv_heads} KV heads of {lm.head_dim}, {lm.dtype}")


def fast_path(model, args) -> str:
    if args.no_fast_path:
        return "off (--no-fast-path)"
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.model.device import pick_backend

    return apply_fast_path(model, backend=pick_backend().name, fast_attention=not args.mlx_attention,
                           dense_weights=args.dense_weights).summary()


def _finish(events, stop_after_first=None) -> tuple[Any, int | None]:
    """Run a reply to the end (or cancel ``stop_after_first`` once it has a token); (TurnDone, first token id)."""
    from chatapp.engine.events import TokenEvent, TurnDone

    done, first = None, None
    for ev in events:
        if isinstance(ev, TokenEvent) and first is None and ev.token >= 0:
            first = ev.token
            if stop_after_first is not None:
                stop_after_first.cancel()
        elif isinstance(ev, TurnDone):
            done = ev
    return done, first


def run_conversation(model, tokenizer, args, messages: list[str], first_stateless_on_even: bool = True) -> list[dict]:
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session

    greedy = GenerationSettings(temp=0.0, max_tokens=args.max_tokens)
    session = Session(model, tokenizer, mode=args.mode, generation=greedy)
    rows = []
    for i, msg in enumerate(messages):
        before = session.conversation.copy()  # the conversation so far, without this turn

        def stateless():
            # Same settings as the reuse session, so the first token goes through the same
            # pipelined decode loop (the next step is scheduled before the first token is read);
            # the reply is cancelled once it has its first token.
            fresh = Session(model, tokenizer, mode=args.mode, generation=greedy)
            fresh.load_conversation(before.copy())
            return _finish(fresh.send(msg), stop_after_first=fresh)

        def reuse():
            return _finish(session.send(msg))

        first, second = (stateless, reuse) if (i % 2 == 0) == first_stateless_on_even else (reuse, stateless)
        results = {}
        for fn in (first, second):
            time.sleep(args.pause)  # a user's think time: BLAS threads from the last reply go idle
            results[fn] = fn()
        (sl, sl_first), (ru, ru_first) = results[stateless], results[reuse]
        rs, ss = ru.stats, sl.stats
        rows.append(dict(turn=i + 1, prompt_tokens=rs.prompt_tokens, stateless_prompt_tokens=ss.prompt_tokens,
                         reused=rs.reused_tokens, prefilled=rs.prefill_tokens, ttft_reuse=rs.ttft,
                         prefill_reuse=rs.prefill_seconds, prefill_stateless=ss.prefill_seconds,
                         ttft_stateless=ss.ttft, generated=rs.generated_tokens, finish=rs.finish,
                         first_token_agrees=ru_first == sl_first, reply=ru.text))
    return rows


def run(args) -> int:
    import mlx.core as mx

    from chatapp.backend.blas import current_blas

    if not 1 <= args.turns <= len(MESSAGES):
        raise SystemExit(f"--turns must be 1..{len(MESSAGES)}")
    blas = current_blas()
    if not blas.loaded:
        print("# WARNING: no optimised BLAS loaded (run through `chatapp bench`); numbers use the reference BLAS")
    model, tokenizer, desc = load(args)
    fp = fast_path(model, args)
    print(f"# model: {desc}")
    print(f"# {fp}")
    messages = MESSAGES[: args.turns]

    # Warm-up (untimed): one turn of each kind.
    run_conversation(model, tokenizer, args, messages[:1])

    runs = []
    for r in range(args.repeats):
        rows = run_conversation(model, tokenizer, args, messages, first_stateless_on_even=r % 2 == 0)
        runs.append(rows)
        last = rows[-1]
        print(f"# repeat {r + 1}: turn {last['turn']}: prompt {last['prompt_tokens']}, reuse "
              f"{last['ttft_reuse'] * 1000:.1f} ms, stateless {last['ttft_stateless'] * 1000:.1f} ms")

    rep = BenchReport("turns: time to first token, cache reuse vs stateless re-prefill (median of repeats)",
                      ["turn", "prompt tokens", "reused", "TTFT reuse (ms)", "TTFT stateless (ms)", "ratio"])
    med = []
    for t in range(args.turns):
        per = [rows[t] for rows in runs]
        a = statistics.median(x["ttft_reuse"] for x in per) * 1000
        b = statistics.median(x["ttft_stateless"] for x in per) * 1000
        first = per[0]
        med.append((a, b))
        rep.add(first["turn"], first["prompt_tokens"], first["reused"], round(a, 2), round(b, 2), round(b / a, 2))

    consistent = all(
        [(x["prompt_tokens"], x["reused"], x["reply"]) for x in rows] ==
        [(x["prompt_tokens"], x["reused"], x["reply"]) for x in runs[0]] for rows in runs)
    same_prompts = all(x["prompt_tokens"] == x["stateless_prompt_tokens"] for rows in runs for x in rows)
    agree = sum(x["first_token_agrees"] for x in runs[0])
    growth = med[-1][0] / med[0][0]
    target = dict(target=f"reuse: turn {args.turns} TTFT within {TTFT_GROWTH}x of turn 1",
                  value=round(growth, 3), passed=growth <= TTFT_GROWTH,
                  detail=f"{med[-1][0]:.2f} ms / {med[0][0]:.2f} ms = {growth:.2f}x "
                         f"(stateless: {med[-1][1]:.2f} ms / {med[0][1]:.2f} ms = {med[-1][1] / med[0][1]:.2f}x)")
    rep.meta.update(
        model=desc, fast_path=fp, mode=args.mode, max_tokens=args.max_tokens, repeats=args.repeats,
        pause_s=args.pause,
        method="reuse = one Session for all turns; stateless = a fresh Session per turn given the conversation "
               "so far (same prompt tokens), cancelled after its first token; TTFT = TurnStats.ttft; "
               "medians over repeats; "
               "each measured turn starts after --pause seconds",
        replies_identical_across_repeats=consistent, same_prompt_tokens=same_prompts,
        first_token_agreement=f"{agree}/{args.turns} turns (reuse vs stateless, first repeat)",
        blas=f"{blas.name}" if blas.loaded else "reference",
        device=str(mx.default_device()), mlx=mx.__version__,
    )
    rep.meta["target"] = target
    rep.meta["runs"] = runs
    rep.meta["replies"] = [x["reply"] for x in runs[0]]

    def plot(path):
        turns = list(range(1, args.turns + 1))
        line_plot(path,
                  f"TTFT per turn ({'random 1024x4 4-bit' if args.random else Path(args.model).name}, {args.mode})",
                  "turn", "TTFT ms (log)",
                  {"reuse (one session)": (turns, [m[0] for m in med]),
                   "stateless (re-prefill)": (turns, [m[1] for m in med])}, logy=True)

    emit(rep, args.json, plot, args.plot)
    print()
    print("## target")
    print(f"{'PASS' if target['passed'] else 'FAIL'}  {target['target']}: {target['detail']}")
    return 0
