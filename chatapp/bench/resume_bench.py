"""Time to first token after a restart: resume from a KV snapshot vs re-prefill from the transcript.

For each model and each history length in ``--lengths`` (tokens the saved conversation renders
to), a conversation is built from fixed user/assistant messages until it renders to at least
that many tokens, prefilled into a session, stored with :class:`chatapp.store.PersistentChat`
in a temporary data directory, and its KV snapshot written, as the app does after a turn.
Then, each ``--repeats`` times, alternating which goes first, in a fresh ``Session`` (as a new
process would have):

* resume: ``open_chat(..., resume=id, save=False)`` (reads the transcript, reads and checks the
  snapshot, restores the caches), then one new user message is sent and its first token
  generated;
* re-prefill: the transcript is read from the store into the conversation, and the same
  message is sent: the whole history is prefilled before the first token.

"time to first token" is wall time from the start of the resume (or of reading the transcript)
to the end of the first token: snapshot reading and checking included. The table shows medians
and the turn statistics of the last repeat (tokens reused from the cache, tokens prefilled),
which show that the resumed turn prefilled only the new message. One untimed warm-up of each
kind runs per model first.

Models: a random-weight 4-bit Llama (hidden 1024, 4 layers, 8 KV heads of 128, intermediate
2816, byte-level tokenizer; the shape of ``chatapp bench turns --random``) and
``../shared/models/stories260K-4bit`` when present (its trained context is 512 tokens: the
longer histories run past it, which changes nothing about the cost measured here). Both get the
app's CPU fast path (``chatapp.backend.cpu.apply_fast_path``). Cache mode: ``--mode``
(default prealloc, which keeps every token, so the re-prefill cost is the whole history).
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

RANDOM_SHAPE = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                    head_dim=128, intermediate_size=2816, vocab_size=258, max_position_embeddings=4096)
NEXT_MESSAGE = "And what happened after that?"
HISTORY = [
    ("user", "Tell me a story about a little cat who lived near the sea."),
    ("assistant", "Once upon a time there was a little cat named Tom. Tom lived in a small house near the "
                  "sea with his mom. Every day he went to the beach to look at the boats and the birds."),
    ("user", "What did Tom find on the beach one day?"),
    ("assistant", "One day Tom found a big red ball in the sand. He was very happy. He pushed the ball with "
                  "his nose and it rolled to the water. A wave came and took the ball away."),
    ("user", "Was Tom sad?"),
    ("assistant", "Tom was sad at first. Then a friendly dog named Max came and jumped into the water. Max "
                  "brought the ball back to Tom. Tom said thank you and they played together all day."),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", type=lambda t: int_list(t, minimum=16), default=[256, 512, 1024, 2048],
                   help="history lengths in tokens (default 256,512,1024,2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length and method (default 3)")
    p.add_argument("--models", default="random,stories",
                   help="comma-separated: random (4-bit random Llama) and/or stories (stories260K-4bit)")
    p.add_argument("--stories", default=str(STORIES), help="the stories260K-4bit folder")
    p.add_argument("--mode", default="prealloc", help="cache mode (default prealloc)")
    p.add_argument("--no-fast-path", action="store_true", help="do not apply the CPU fast path")
    p.add_argument("--seed", type=int, default=0)


def _load(name: str, args) -> tuple[Any, Any, Any, str]:
    from chatapp.store.chat import ModelIdentity

    if name == "random":
        from chatapp.model.synthetic import LlamaShape, build_random_llama, byte_tokenizer

        model, _ = build_random_llama(LlamaShape(**RANDOM_SHAPE), seed=args.seed, quantize_bits=4)
        ident = ModelIdentity("random-4bit", "random-4bit", f"random-seed-{args.seed}")
        return model, byte_tokenizer(), ident, ("random 4-bit Llama: hidden 1024, 4 layers, 8 KV heads of 128, "
                                                "intermediate 2816, byte tokenizer")
    return load_stories(args.stories)


def _history(session, length: int):
    """A conversation of fixed messages rendering to at least ``length`` tokens and at most a
    word more (unless one user message alone is longer): whole user/assistant pairs while
    another pair fits after them, then a last pair whose reply is cut at the word reaching
    ``length``."""
    from chatapp.prompt.conversation import Conversation, Message

    def size(messages) -> int:
        return len(session.format.tokens(Conversation(list(messages)), generation_prompt=False))

    pairs = [(HISTORY[k][1], HISTORY[k + 1][1]) for k in range(0, len(HISTORY), 2)]
    words = " ".join(reply for _, reply in pairs).split(" ") * 40
    msgs: list[Message] = []
    i = 0
    while True:  # whole pairs while another pair still fits after them
        user, reply = pairs[i % len(pairs)]
        full = msgs + [Message("user", user), Message("assistant", reply)]
        after = [Message("user", pairs[(i + 1) % len(pairs)][0]), Message("assistant", words[0])]
        if size(full + after) >= length:
            break
        msgs, i = full, i + 1
    head = msgs + [Message("user", user)]
    lo, hi = 1, len(words)  # the fewest words of the last reply that reach ``length``
    while lo < hi:
        mid = (lo + hi) // 2
        if size(head + [Message("assistant", " ".join(words[:mid]))]) >= length:
            hi = mid
        else:
            lo = mid + 1
    return Conversation(head + [Message("assistant", " ".join(words[:lo]))])


def _save(model, tok, ident, args, data_dir: Path, length: int) -> tuple[int, int, int]:
    """Store a conversation of ``length`` tokens with its snapshot; (id, tokens, snapshot bytes)."""
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session
    from chatapp.store.chat import open_chat
    from chatapp.store.paths import snapshot_path

    s = Session(model, tok, mode=args.mode, generation=GenerationSettings(temp=0.0, max_tokens=1))
    conv = _history(s, length)
    chat = open_chat(s, ident, data_dir)
    s.load_conversation(conv)
    tokens = s.format.tokens(conv, generation_prompt=False)
    s.prefill(tokens)  # as compare_modes does
    chat.commit()
    if not chat.save_snapshot():
        raise SystemExit(f"resume bench: the snapshot was not written: {[str(n) for n in chat.take_notes()]}")
    cid = chat.conversation_id
    chat.close()
    return cid, len(tokens), snapshot_path(data_dir, cid).stat().st_size


def _resume(model, tok, ident, args, data_dir: Path, cid: int) -> dict:
    from chatapp.engine.generate import GenerationSettings, run_turn
    from chatapp.engine.session import Session
    from chatapp.store.chat import open_chat

    s = Session(model, tok, mode=args.mode, generation=GenerationSettings(temp=0.0, max_tokens=1))
    t0 = time.perf_counter()
    chat = open_chat(s, ident, data_dir, save=False, resume=cid)
    done = run_turn(s.send(NEXT_MESSAGE))
    total = time.perf_counter() - t0
    info = chat.resume_info
    chat.close()
    if info.source != "snapshot":
        raise SystemExit(f"resume bench: the snapshot was not used: {info.reason}")
    return dict(total=total, load=info.load_seconds, reused=done.stats.reused_tokens,
                prefilled=done.stats.prefill_tokens, token=done.text)


def _reprefill(model, tok, args, data_dir: Path, cid: int) -> dict:
    from chatapp.engine.generate import GenerationSettings, run_turn
    from chatapp.engine.session import Session
    from chatapp.prompt.conversation import Conversation, Message
    from chatapp.store.db import ChatStore

    s = Session(model, tok, mode=args.mode, generation=GenerationSettings(temp=0.0, max_tokens=1))
    t0 = time.perf_counter()
    with ChatStore.open(data_dir, write=False) as store:
        s.load_conversation(Conversation([Message(m.role, m.content, m.interrupted)
                                          for m in store.messages(cid)]))
    done = run_turn(s.send(NEXT_MESSAGE))
    return dict(total=time.perf_counter() - t0, reused=done.stats.reused_tokens,
                prefilled=done.stats.prefill_tokens, token=done.text)


def run(args) -> int:
    blas = start_bench()
    names = model_names(args.models, args.stories)

    rep = BenchReport("resume: time to first token after a restart, KV snapshot vs re-prefill (median ms)",
                      ["model", "history tokens", "snapshot MiB", "read+restore ms", "TTFT resume ms",
                       "TTFT re-prefill ms", "speedup", "reused (resume)", "prefilled (resume)",
                       "prefilled (re-prefill)"])
    series: dict[str, tuple[list[float], list[float]]] = {}
    agree = True
    models_meta = {}
    with tempfile.TemporaryDirectory(prefix="chatapp-resume-bench-") as tmp:
        for name in names:
            model, tok, ident, desc = _load(name, args)
            fp = fast_path(model, args.no_fast_path)
            models_meta[name] = dict(model=desc, fast_path=fp)
            print(f"# {name}: {desc}")
            print(f"# {fp}")
            data_dir = Path(tmp) / name
            cid, _, _ = _save(model, tok, ident, args, data_dir, min(args.lengths))
            _resume(model, tok, ident, args, data_dir, cid)  # warm-up, untimed
            _reprefill(model, tok, args, data_dir, cid)
            xs, ys_resume, ys_pre = [], [], []
            for length in args.lengths:
                cid, tokens, size = _save(model, tok, ident, args, data_dir, length)
                res, pre = [], []
                for r in range(args.repeats):
                    if r % 2 == 0:
                        res.append(_resume(model, tok, ident, args, data_dir, cid))
                        pre.append(_reprefill(model, tok, args, data_dir, cid))
                    else:
                        pre.append(_reprefill(model, tok, args, data_dir, cid))
                        res.append(_resume(model, tok, ident, args, data_dir, cid))
                agree = agree and all(a["token"] == b["token"] for a, b in zip(res, pre))
                t_res = statistics.median(x["total"] for x in res) * 1000
                t_pre = statistics.median(x["total"] for x in pre) * 1000
                t_load = statistics.median(x["load"] for x in res) * 1000
                rep.add(name, tokens, round(size / (1 << 20), 2), round(t_load, 1), round(t_res, 1),
                        round(t_pre, 1), round(t_pre / t_res, 1), res[-1]["reused"], res[-1]["prefilled"],
                        pre[-1]["prefilled"])
                xs.append(tokens)
                ys_resume.append(t_res)
                ys_pre.append(t_pre)
                print(f"# {name} {tokens} tokens: resume {t_res:.1f} ms, re-prefill {t_pre:.1f} ms")
            series[f"{name}: resume from snapshot"] = (xs, ys_resume)
            series[f"{name}: re-prefill transcript"] = (xs, ys_pre)
    rep.meta.update(
        models=models_meta, mode=args.mode, repeats=args.repeats, lengths=args.lengths, next_message=NEXT_MESSAGE,
        blas=getattr(blas, "name", str(blas)),
        method="fresh Session per run; resume = open_chat(resume=id) + first token of the next message; "
               "re-prefill = read the transcript + first token of the same message (whole history prefilled); "
               "wall time, medians over repeats",
        first_token_agrees=agree,
    )
    emit(rep, args.json, lambda path: line_plot(
        path, "Time to first token after a restart", "history tokens", "ms", series, logx=True, logy=True),
        args.plot)
    print(f"# first token identical for resume and re-prefill: {'yes' if agree else 'NO'}")
    return 0 if agree else 1
