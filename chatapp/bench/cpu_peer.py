"""One peer of `chatapp bench cpu --geometry llama2-7b`, run in a process of its own.

Each peer loads the model itself, so its load time and peak memory (``ru_maxrss``) are its
own. It prints one JSON object on its last line of stdout. The orchestrator is cpu_flagship.py.

    python -m chatapp.bench.cpu_peer {chatapp,mlx-lm,llama.cpp} SPEC.json

SPEC holds: model (folder; gguf: the GGUF file for llama.cpp), load_only (return after loading),
prompt (token ids, BOS first),
short (prefix of the prompt for the greedy check), greedy (tokens decoded from it), decode
(tokens decoded after the full prompt), contexts and modes (synthetic long-context decode),
long_tokens (tokens decoded per long-context point), seed, threads.
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import sys
import time


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("nan")


def step_rate(stamps: list[float]) -> float:
    """Decode tokens/s from the times tokens reached Python: 1 / median interval."""
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1.0 / statistics.median(gaps) if gaps else float("nan")


def _fill_layer_by_layer(caches, geom, context: int, seed: int) -> None:
    """Write ``context`` random float32 K/V tokens into each layer's cache, one layer at a time
    (the whole synthetic history of a 7B model at 4,096 tokens would be another 4 GiB)."""
    import mlx.core as mx

    shape = (1, geom["kv_heads"], context, geom["head_dim"])
    for i, c in enumerate(caches):
        k1, k2 = mx.random.split(mx.random.key(seed * 1_000_003 + context * 101 + i))
        k, v = mx.random.normal(shape, key=k1), mx.random.normal(shape, key=k2)
        c.update_and_fetch(k, v)
        mx.eval([s for s in c.state if s is not None] if isinstance(c.state, (list, tuple)) else c.state)
    for c in caches:
        c.offset  # run the maintenance (quantise / evict) the fill made due


# --- chatapp ----------------------------------------------------------------------------------


def run_chatapp(spec: dict, fused_decode: bool = True, numerics: str = "exact", gguf: bool = False) -> dict:
    """chatapp on the spec's model folder, or (``gguf``) on the Q4_0 GGUF llama.cpp reads."""
    import mlx.core as mx

    from cache import CacheSettings, make_caches, model_geometry
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.bench.cpu_bench import chatapp_prefill, greedy_decode
    from chatapp.config import CacheConfig
    from chatapp.model.loader import load_model

    t0 = time.perf_counter()
    lm = load_model(spec["gguf"] if gguf else spec["model"], cast_scales=False)
    plan = apply_fast_path(lm.model, backend="cpu", threads=spec.get("threads", 0), fused_decode=fused_decode,
                           numerics=numerics)
    load_s = time.perf_counter() - t0
    model = lm.model
    name = "chatapp-unfused" if not fused_decode else ("chatapp-fast" if numerics == "fast" else "chatapp")
    name = name.replace("chatapp", "chatapp-gguf") if gguf else name
    res: dict = {"peer": name, "load_s": load_s, "rss_after_load": peak_rss(), "plan": plan.details(),
                 "warm_up_s": plan.warm_up_seconds}
    if spec.get("load_only"):
        return res

    # weight bytes a decoded token reads: every quantised layer once (the embedding: one row)
    from chatapp.backend.fused_install import fused_decoder
    from chatapp.backend.qlinear import is_routed

    decoder = fused_decoder(model)
    res["weight_bytes_per_token"] = sum(
        m["weight"].nbytes + m["scales"].nbytes + m["biases"].nbytes
        for _, m in model.named_modules() if is_routed(m) and m.route == "kernel"
    ) - (decoder.dropped_bias_bytes() if decoder is not None else 0)  # symmetric: biases not read

    def generate(prompt: list[int], n: int) -> tuple[list[int], float, list[float]]:
        """Greedy tokens, prefill tok/s (prompt / time to the first token), token times."""
        caches = make_caches(model, CacheSettings(mode="prealloc"))
        t = time.perf_counter()
        tokens, stamps = greedy_decode(model, caches, chatapp_prefill(model, caches, prompt), n)
        return tokens, rate(len(prompt), stamps[0] - t), stamps

    res["greedy"], res["short_prefill_tok_s"], _ = generate(spec["prompt"][: spec["short"]], spec["greedy"])
    _, res["prefill_tok_s"], stamps = generate(spec["prompt"], spec["decode"] + 1)
    res["decode_tok_s"] = step_rate(stamps)
    res["peak_rss"] = peak_rss()  # load + the 256-token turn: what the RSS target is about

    geom = model_geometry(model)
    g = {"kv_heads": geom.n_kv_heads, "head_dim": geom.head_dim}
    defaults = CacheConfig()
    res["long"] = []
    for mode in spec["modes"] if spec["contexts"] else []:  # --contexts '': no long-context decode
        settings = CacheSettings(mode=mode, sinks=defaults.sinks, window=defaults.window,
                                 evict_chunk=defaults.evict_chunk, kv_bits=defaults.kv_bits,
                                 kv_group_size=defaults.kv_group_size,
                                 max_kv_tokens=max(max(spec["contexts"]) + 64, defaults.sinks + defaults.window),
                                 quant_start=defaults.quant_start)
        for ctx in spec["contexts"]:
            caches = make_caches(model, settings)
            if decoder is not None:
                # the K/V dtype a session's caches hold (float16 where the CPU has F16C): filled
                # first, they kept the fill's float32 (twice the bytes each step reads)
                decoder.adopt(caches)
            _fill_layer_by_layer(caches, g, ctx, spec["seed"])
            held = caches[0].offset
            kv = str(caches[0].full.keys.dtype).removeprefix("mlx.core.")
            _, stamps = greedy_decode(model, caches, mx.array([spec["prompt"][-1]]), spec["long_tokens"] + 1)
            res["long"].append({"mode": mode, "context": ctx, "held": held, "kv_dtype": kv,
                                "decode_tok_s": step_rate(stamps)})
            del caches
            mx.clear_cache()
    return res


# --- mlx-lm -----------------------------------------------------------------------------------


def run_mlx_lm(spec: dict) -> dict:
    """mlx_lm.stream_generate on the same folder, read into mlx-lm's Llama with every float
    parameter in float32 (MLX's fast CPU configuration: quantized_matmul is 2-30x slower with
    half-precision scales or activations). mlx-lm's own ``load`` refuses this legacy layout."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from chatapp.model.loader import load_model

    t0 = time.perf_counter()
    lm = load_model(spec["model"])
    load_s = time.perf_counter() - t0
    res: dict = {"peer": "mlx-lm", "load_s": load_s, "rss_after_load": peak_rss()}
    if spec.get("load_only"):
        return res
    short = spec["prompt"][: spec["short"]]
    t = time.perf_counter()
    stamps, tokens = [], []
    for r in stream_generate(lm.model, lm.tokenizer, mx.array(short), max_tokens=spec["greedy"]):
        tokens.append(int(r.token))
        stamps.append(time.perf_counter())
    res["greedy"] = tokens
    res["prefill_tok_s"] = rate(len(short), stamps[0] - t)
    res["decode_tok_s"] = step_rate(stamps)
    res["peak_rss"] = peak_rss()
    layer = lm.model.model.layers[0].self_attn
    g = {"kv_heads": layer.n_kv_heads, "head_dim": layer.head_dim}
    res["long"] = []
    for ctx in spec["contexts"]:
        cache = make_prompt_cache(lm.model)
        _fill_layer_by_layer(cache, g, ctx, spec["seed"])
        stamps = []
        for _ in stream_generate(lm.model, lm.tokenizer, mx.array([spec["prompt"][-1]]), prompt_cache=cache,
                                 max_tokens=spec["long_tokens"] + 1):
            stamps.append(time.perf_counter())
        res["long"].append({"mode": "mlx-lm KVCache", "context": ctx, "held": ctx, "decode_tok_s": step_rate(stamps)})
        del cache
        mx.clear_cache()
    return res


# --- llama.cpp --------------------------------------------------------------------------------


def run_llama_cpp(spec: dict) -> dict:
    """llama.cpp through llama-cpp-python on the same weights as a Q4_0 GGUF (gguf.py)."""
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=max(len(spec["prompt"]) + spec["decode"] + 8, 512),
                          n_threads=spec.get("threads") or None, n_batch=512, verbose=False)
    res: dict = {"peer": "llama.cpp", "load_s": time.perf_counter() - t0, "rss_after_load": peak_rss(),
                 "version": getattr(llama_cpp, "__version__", "?")}

    def generate(prompt: list[int], n: int) -> tuple[list[int], float, list[float]]:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill_s = time.perf_counter() - t
        out, stamps = [], []
        for _ in range(n):
            tok = llm.sample(top_k=1, temp=0.0)
            out.append(int(tok))
            stamps.append(time.perf_counter())
            llm.eval([tok])
        return out, prefill_s, stamps

    res["greedy"], _, _ = generate(spec["prompt"][: spec["short"]], spec["greedy"])
    _, prefill_s, stamps = generate(spec["prompt"], spec["decode"] + 1)
    res["prefill_tok_s"] = rate(len(spec["prompt"]), prefill_s)
    res["decode_tok_s"] = step_rate(stamps)
    res["peak_rss"] = peak_rss()
    # decode after N cached tokens: llama.cpp's cache is filled by a real prefill of the prompt
    # repeated to N tokens (its fill time recorded); its decode reads the same KV bytes whatever
    # the values, as chatapp's synthetic fill does
    res["long"] = []
    for ctx in spec["contexts"]:
        if not spec["modes"]:
            break
        if ctx + spec["long_tokens"] + 8 > llm.n_ctx():
            # one instance alive at a time: a second 7B context beside the first read its decode
            # as 1.96 tok/s where one alone decodes 3.19 on the same file and machine (issue 34)
            _close(llm)
            llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=ctx + spec["long_tokens"] + 16,
                                  n_threads=spec.get("threads") or None, n_batch=512, verbose=False)
        ids = (spec["prompt"] * (ctx // len(spec["prompt"]) + 1))[:ctx]
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        fill_s = time.perf_counter() - t
        stamps = []
        for _ in range(spec["long_tokens"] + 1):
            tok = llm.sample(top_k=1, temp=0.0)
            stamps.append(time.perf_counter())
            llm.eval([tok])
        res["long"].append({"mode": "real prefill", "context": ctx, "held": ctx, "fill_s": fill_s,
                            "decode_tok_s": step_rate(stamps)})
    return res


def _close(llm) -> None:
    """Free a llama_cpp.Llama's model and context now, not when the collector gets to it."""
    close = getattr(llm, "close", None)
    if close is not None:
        close()
    gc.collect()


def run_chatapp_unfused(spec: dict) -> dict:
    """chatapp with ``cpu.fused_decode = false``: the per-projection route the fused step replaced."""
    return run_chatapp(spec, fused_decode=False)


def run_chatapp_fast(spec: dict) -> dict:
    """chatapp with ``cpu.numerics = fast`` (int8 activations in the fused step's 4-bit rows)."""
    return run_chatapp(spec, numerics="fast")


def run_chatapp_gguf(spec: dict) -> dict:
    """chatapp (exact) on the Q4_0 GGUF llama.cpp reads (group 32, through chatapp's GGUF loader)."""
    return run_chatapp(spec, gguf=True)


def run_chatapp_gguf_fast(spec: dict) -> dict:
    """chatapp with ``cpu.numerics = fast`` on the Q4_0 GGUF llama.cpp reads."""
    return run_chatapp(spec, numerics="fast", gguf=True)


PEERS = {"chatapp": run_chatapp, "chatapp-unfused": run_chatapp_unfused, "chatapp-fast": run_chatapp_fast,
         "chatapp-gguf": run_chatapp_gguf, "chatapp-gguf-fast": run_chatapp_gguf_fast,
         "mlx-lm": run_mlx_lm, "llama.cpp": run_llama_cpp}


def peer_main(argv: list[str], peers: dict, module: str) -> int:
    """``python -m MODULE PEER SPEC.json``: run one peer of ``peers`` on the spec, print its JSON."""
    if len(argv) != 2 or argv[0] not in peers:
        print(f"usage: python -m {module} {{{','.join(peers)}}} SPEC.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    res = peers[argv[0]](spec)
    print(json.dumps(res, default=str))
    return 0


def main(argv: list[str]) -> int:
    return peer_main(argv, PEERS, "chatapp.bench.cpu_peer")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
