"""One peer of `chatapp bench cpu --model FILE.gguf`, run in a process of its own.

Both peers load the same GGUF file themselves (so load time and peak RSS are each their own) and
print one JSON object on the last line of stdout. The orchestrator is cpu_gguf.py.

    python -m chatapp.bench.cpu_gguf_peer {chatapp,chatapp-fast,llama.cpp} SPEC.json

SPEC holds: model (the GGUF file), threads, system and user (the first turn), turn_ids (that turn
rendered and tokenised by chatapp: llama.cpp is given these ids), ttft_runs, text_ids (a long
text's token ids), cached (history lengths), prompt (tokens prefilled after each history),
decode (tokens decoded after them).

What each peer measures:
- load_s: chatapp: ``engine.setup.load_engine`` (read, CPU plan, kernel warm-up: what the app
  does before its first turn); llama.cpp: ``Llama(model_path=...)``.
- ttft_ms: chatapp: the Session's own ``TurnStats.ttft`` of a new conversation (rendering,
  tokenising, prefill, first sample); llama.cpp: eval of the same ids and its first sample.
- for each history length N: the first N text tokens are prefilled untimed, then ``prompt``
  more tokens are timed (prefill tok/s: prompt / time to the first token), then ``decode``
  greedy tokens (decode tok/s: 1 / median gap between tokens).
"""

from __future__ import annotations

import sys
import time

from chatapp.bench.cpu_peer import peak_rss, peer_main, rate, step_rate


def run_chatapp(spec: dict, numerics: str = "exact", write_in_place: bool = True) -> dict:
    import mlx.core as mx

    from cache import make_caches
    from chatapp.backend.fused_install import fused_decoder
    from chatapp.bench.cpu_bench import chatapp_prefill, greedy_decode
    from chatapp.config import Config
    from chatapp.engine.setup import cache_settings_from, load_engine, session_from_config

    cfg = Config()
    cfg.model.id = spec["model"]
    cfg.cpu.threads = spec.get("threads", 0)
    cfg.cpu.numerics = numerics
    cfg.sampling.temp = 0.0
    cfg.sampling.max_tokens = 4
    t0 = time.perf_counter()
    loaded = load_engine(cfg)
    load_s = time.perf_counter() - t0
    dec = fused_decoder(loaded.model)
    if dec is not None:
        dec.write_in_place = write_in_place
    name = "chatapp-append" if not write_in_place else ("chatapp" if numerics == "exact" else "chatapp-fast")
    res: dict = {"peer": name, "load_s": load_s,
                 "rss_after_load": peak_rss(), "plan": loaded.cpu_plan.summary()}
    session = session_from_config(cfg, loaded)
    ttft = []
    for _ in range(spec["ttft_runs"]):
        session.new_chat(system=spec["system"])
        done = None
        for ev in session.send(spec["user"]):
            done = ev
        ttft.append(done.stats.ttft * 1000)
        res["turn_tokens"] = done.stats.prompt_tokens
    res["turn_ids"] = session.format.tokens(_first_turn(spec))
    res["ttft_ms"] = ttft
    model = loaded.model
    settings = cache_settings_from(cfg, "prealloc")
    res["points"] = []
    text = spec["text_ids"]
    for n in spec["cached"]:
        caches = make_caches(model, settings)
        if n:
            chatapp_prefill(model, caches, text[: n + 1])  # all but the last: the cache holds n tokens
        part = text[n : n + spec["prompt"]]
        t = time.perf_counter()
        _, stamps = greedy_decode(model, caches, chatapp_prefill(model, caches, part), spec["decode"] + 1)
        res["points"].append({"cached": n, "prefill_tok_s": rate(len(part), stamps[0] - t),
                              "decode_tok_s": step_rate(stamps)})
        del caches
        mx.clear_cache()
    res["peak_rss"] = peak_rss()
    return res


def _first_turn(spec: dict):
    from chatapp.prompt.conversation import Conversation

    conv = Conversation.start(spec["system"])
    conv.add("user", spec["user"])
    return conv


def run_chatapp_fast(spec: dict) -> dict:
    return run_chatapp(spec, numerics="fast")


def run_chatapp_append(spec: dict) -> dict:
    """chatapp with the fused step's new K/V rows appended through update_and_fetch (the route
    before rows were written in place): a same-run baseline."""
    return run_chatapp(spec, write_in_place=False)


def run_llama_cpp(spec: dict) -> dict:
    import llama_cpp

    n_ctx = max(spec["cached"]) + spec["prompt"] + spec["decode"] + 16
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=max(n_ctx, 512), n_threads=spec.get("threads") or None,
                          n_threads_batch=spec.get("threads") or None, n_batch=512, verbose=False)
    res: dict = {"peer": "llama.cpp", "load_s": time.perf_counter() - t0, "rss_after_load": peak_rss(),
                 "version": getattr(llama_cpp, "__version__", "?")}
    ids = spec["turn_ids"]
    ttft = []
    for _ in range(spec["ttft_runs"]):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        llm.sample(top_k=1, temp=0.0)
        ttft.append((time.perf_counter() - t) * 1000)
    res["ttft_ms"] = ttft
    res["turn_tokens"] = len(ids)
    res["points"] = []
    text = spec["text_ids"]
    for n in spec["cached"]:
        llm.reset()
        if n:
            llm.eval(text[:n])
        part = text[n : n + spec["prompt"]]
        t = time.perf_counter()
        llm.eval(part)
        tok = llm.sample(top_k=1, temp=0.0)
        stamps = [time.perf_counter()]
        prefill_s = stamps[0] - t
        for _ in range(spec["decode"]):
            llm.eval([tok])
            tok = llm.sample(top_k=1, temp=0.0)
            stamps.append(time.perf_counter())
        res["points"].append({"cached": n, "prefill_tok_s": rate(len(part), prefill_s),
                              "decode_tok_s": step_rate(stamps)})
    res["peak_rss"] = peak_rss()
    return res


PEERS = {"chatapp": run_chatapp, "chatapp-fast": run_chatapp_fast, "chatapp-append": run_chatapp_append,
         "llama.cpp": run_llama_cpp}


def main(argv: list[str]) -> int:
    return peer_main(argv, PEERS, "chatapp.bench.cpu_gguf_peer")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
