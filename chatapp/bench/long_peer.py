"""The llama.cpp peer of `chatapp bench long`, in a process of its own, kept for the whole chat.

    python -m chatapp.bench.long_peer SPEC.json

SPEC holds: model (the GGUF file), threads, reply (greedy tokens per turn). The process loads the
file with llama-cpp-python at its trained context (``n_ctx=0``: the context the file declares),
prints one JSON line (``{"ready": ..., "n_ctx": ...}``), then reads one JSON list of token ids
per line on stdin: the turn's new tokens, evaluated after what its cache already holds (its own
earlier turns and replies: the cache is kept across turns, as a chat client keeps it), then
``reply`` greedy tokens. It answers one JSON line per turn: tokens held, TTFT (eval of the new
tokens and the first sample), prefill and decode tok/s, or, when the turn does not fit (past
n_ctx), what llama.cpp did: the error it raised, after which the peer answers nothing more for
the chat. An empty line ends the process. The orchestrator is long_bench.py.
"""

from __future__ import annotations

import json
import sys
import time

from chatapp.bench.cpu_peer import peak_rss, rate, step_rate


def _turn(llm, ids: list[int], reply: int) -> dict:
    before = llm.n_tokens
    t = time.perf_counter()
    llm.eval(ids)
    tok = llm.sample(top_k=1, temp=0.0)
    stamps = [time.perf_counter()]
    for _ in range(reply - 1):
        llm.eval([tok])
        tok = llm.sample(top_k=1, temp=0.0)
        stamps.append(time.perf_counter())
    return {"held": llm.n_tokens, "before": before, "ttft_ms": (stamps[0] - t) * 1000,
            "prefill_tok_s": rate(len(ids), stamps[0] - t), "decode_tok_s": step_rate(stamps),
            "peak_rss": peak_rss()}


def serve(spec: dict, stdin=sys.stdin, stdout=sys.stdout) -> int:
    import llama_cpp

    threads = spec.get("threads") or None
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=0, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False)
    n_ctx = llm.n_ctx()

    def say(obj: dict) -> None:
        stdout.write(json.dumps(obj, default=str) + "\n")
        stdout.flush()

    say({"ready": True, "n_ctx": n_ctx, "version": getattr(llama_cpp, "__version__", "?")})
    failed = None
    for line in stdin:
        if not line.strip():
            break
        ids = json.loads(line)
        if failed is not None:
            say({"error": f"stopped: {failed}"})
            continue
        try:
            say(_turn(llm, ids, spec["reply"]))
        except Exception as e:  # noqa: BLE001 - what llama.cpp does past its context is the measurement
            failed = f"{type(e).__name__}: {e}".splitlines()[0]
            say({"error": failed, "held": llm.n_tokens, "n_ctx": n_ctx, "asked": llm.n_tokens + len(ids)})
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m chatapp.bench.long_peer SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        return serve(json.load(f))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
