"""CPU fast path: prefill and decode tokens/sec against plain mlx-lm, plus a matmul layer table.

It runs a random-weight 4-bit Llama (hidden 2048, 4 layers, 16 heads of 128, intermediate 5632,
vocab 32000; float32 activations) twice in the same process: once through plain
`mlx_lm.stream_generate`, once through `chatapp.backend.cpu.accelerate_model` with a simple greedy
loop over mlx-lm's KV cache, and compares the greedy tokens.

The optimised BLAS has to be loaded before `mlx.core` is imported, which is before this module's
`run()` can act: `chatapp bench cpu` relies on the CLI calling
`chatapp.backend.blas.preload_blas()` first. Without the CLI, launch it as

    python -c "from chatapp.backend.blas import preload_blas; preload_blas(); import sys; \
from chatapp.bench import main; sys.exit(main(['cpu']))"

It prints whether BLAS is loaded and warns when it is not.
"""

from __future__ import annotations

import argparse
import time

from chatapp.bench.common import loadavg
from chatapp.bench.report import BenchReport, emit, line_plot

SHAPE = dict(
    hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
    head_dim=128, intermediate_size=5632, vocab_size=32000,
)
LAUNCHER = (
    'python -c "from chatapp.backend.blas import preload_blas; preload_blas(); import sys; '
    "from chatapp.bench import main; sys.exit(main(['cpu']))\""
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="128,1024", help="comma-separated prompt lengths (default 128,1024)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="transformer layers (default 4)")
    p.add_argument("--hidden", type=int, default=SHAPE["hidden_size"],
                   help="hidden size, a multiple of 128 (heads of 128, intermediate 2.75x; default 2048)")
    p.add_argument("--vocab", type=int, default=SHAPE["vocab_size"], help="vocabulary (default 32000)")
    p.add_argument("--threshold", type=int, default=16, help="dense_prefill_threshold (default 16)")
    p.add_argument("--dense-weights", choices=("auto", "on", "off"), default="auto",
                   help="keep float32 copies of the weights (default auto: only where no kernel applies)")
    p.add_argument("--kernels", choices=("auto", "off"), default="auto", help="chatapp's CPU kernels (default auto)")
    p.add_argument("--no-numpy-matvec", action="store_true",
                   help="decode products through MLX's matmul instead of numpy's sgemv")
    p.add_argument("--layer-dim", type=int, default=4096, help="weight size for the layer table (default 4096)")
    p.add_argument("--no-layer-table", action="store_true", help="skip the per-layer matmul table")
    p.add_argument("--repeats", type=int, default=1,
                   help="run each generation N times and keep the best rates (steadier on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--geometry", choices=("bench-2048", "llama2-7b"), default="bench-2048",
                   help="bench-2048: the 4-layer 2048-wide random model in this process (default); "
                   "llama2-7b: the flagship's full geometry, peers in processes of their own")
    from chatapp.bench.cpu_flagship import add_flagship_arguments

    add_flagship_arguments(p)
    from chatapp.bench.cpu_gguf import add_model_arguments

    add_model_arguments(p)


class _NullTokenizer:
    """Just enough of a tokenizer for mlx_lm.stream_generate on a random-weight model."""

    eos_token_id = None
    bos_token = None
    chat_template = None

    def get_vocab(self) -> dict:
        return {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in text.split() if t.isdigit()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def apply_chat_template(self, messages, **_):
        raise NotImplementedError("a random-weight model has no chat template")


def mlx_lm_generate(model, prompt: list[int], n: int) -> tuple[list[int], float, float]:
    """Greedy tokens, prefill tok/s (prompt / time to first token), decode tok/s, via mlx-lm."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    tok = TokenizerWrapper(_NullTokenizer())
    out, stamps = [], []
    t0 = time.perf_counter()
    for r in stream_generate(model, tok, mx.array(prompt), max_tokens=n):
        out.append(int(r.token))
        stamps.append(time.perf_counter())
    return out, *_rates(len(prompt), t0, stamps)


def chatapp_prefill(model, cache, prompt: list[int], step: int = 512):
    """Prefill all but the last prompt token in chunks that evaluate only the cache (the output
    head runs for no position: ``last_position_only``), as mlx-lm does; returns the last token,
    the first input of ``greedy_decode``."""
    import mlx.core as mx

    from chatapp.backend.qlinear import last_position_only

    toks = mx.array(prompt)
    i = 0
    while len(prompt) - i > 1:
        k = min(step, len(prompt) - 1 - i)
        with last_position_only():
            model(toks[i : i + k][None], cache=cache)
        mx.eval([c.state for c in cache])
        i += k
    return toks[i:]


def greedy_decode(model, cache, inputs, n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens from ``inputs`` (an mx.array of token ids) through the Session's token
    loop (``engine.generate.decode_tokens``: the next step queued before a token is read, or,
    with the fused step, run after it), room for the n tokens reserved first as a turn does;
    returns the tokens and the times they reached Python."""
    import mlx.core as mx

    from cache import reserve_tokens
    from chatapp.backend.fused_install import steps_synchronously
    from chatapp.engine.generate import decode_tokens

    reserve_tokens(cache, len(inputs) + n)
    logits = model(inputs[None], cache=cache)[:, -1, :]
    out, stamps = [], []
    for token, _, _ in decode_tokens(model, cache, logits, lambda lg: mx.argmax(lg, axis=-1), n,
                                     sync=steps_synchronously(model)):
        out.append(int(token))
        stamps.append(time.perf_counter())
    return out, stamps


def chatapp_generate(model, prompt: list[int], n: int, prefill_step: int = 512) -> tuple[list[int], float, float]:
    """The same measurement through chatapp's caches (prealloc, attention dispatched to the
    cache, so decode attention takes the CPU kernel when installed)."""
    from cache import CacheSettings, make_caches

    cache = make_caches(model, CacheSettings(mode="prealloc"))
    t0 = time.perf_counter()
    out, stamps = greedy_decode(model, cache, chatapp_prefill(model, cache, prompt, prefill_step), n)
    return out, *_rates(len(prompt), t0, stamps)


def _rates(prompt_len: int, t0: float, stamps: list[float]) -> tuple[float, float]:
    prefill = prompt_len / (stamps[0] - t0)
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return prefill, decode


def _best_ms(fn, repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best * 1000


def layer_table(dim: int, seed: int = 0) -> BenchReport:
    """Milliseconds of the matmul variants for one dim x dim weight (4-bit, group 64)."""
    import mlx.core as mx

    mx.random.seed(seed)
    w = mx.random.normal((dim, dim)) * dim**-0.5
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x512, x1 = mx.random.normal((512, dim)), mx.random.normal((1, dim))
    mx.eval(w, wq, s, b, x512, x1)
    import numpy as np

    wn = np.asarray(w)

    def qmm(x, dtype):
        return lambda: mx.quantized_matmul(x.astype(dtype), wq, s.astype(dtype), b.astype(dtype),
                                           transpose=True, group_size=64, bits=4)

    def deq():
        return mx.dequantize(wq, s, b, group_size=64, bits=4, dtype=mx.float32)

    from chatapp.backend.qlinear import Route, matmul, packed_view

    route = Route(kind="kernel", packed=packed_view(wq, s, b, 4, 64))
    dense = Route(kind="dense", dense=w, dense_np=wn)
    rows = [
        ("4-bit packed kernel (chatapp: decode)", 1, lambda: matmul(route, x1), 10),
        ("dequantise blocks + numpy gemm (chatapp: prefill)", 512, lambda: matmul(route, x512), 3),
        ("dense matmul (float32, MLX matmul)", 512, lambda: x512 @ w.T, 3),
        ("dense matvec (float32, MLX matmul)", 1, lambda: x1 @ w.T, 10),
        ("dense matvec (float32, numpy sgemv: decode)", 1, lambda: matmul(dense, x1), 10),
        ("4-bit quantized_matmul, float32", 512, qmm(x512, mx.float32), 1),
        ("4-bit quantized_matmul, float32", 1, qmm(x1, mx.float32), 10),
        ("4-bit quantized_matmul, bfloat16", 1, qmm(x1, mx.bfloat16), 3),
        ("4-bit quantized_matmul, float16", 1, qmm(x1, mx.float16), 2),
        ("dequantize alone", 0, deq, 3),
        ("dequantize + dense matmul", 512, lambda: x512 @ deq().T, 3),
    ]
    rep = BenchReport(f"cpu: layers ({dim}x{dim} weight)", ["operation", "tokens", "ms", "GFLOP/s"])
    for name, tokens, fn, repeats in rows:
        ms = _best_ms(fn, repeats)
        gflops = 2.0 * tokens * dim * dim / (ms / 1000) / 1e9 if tokens else 0.0
        rep.add(name, tokens, ms, gflops)
    return rep


def bench_shape(args: argparse.Namespace) -> dict:
    """SHAPE at ``--layers``, ``--hidden`` and ``--vocab`` (smaller ones: a smoke test in seconds)."""
    if args.hidden < 128 or args.hidden % 128 or args.vocab < 2 or args.layers < 1:
        raise SystemExit("--hidden needs a multiple of 128, --vocab >= 2, --layers >= 1")
    heads = args.hidden // SHAPE["head_dim"]
    return {**SHAPE, "num_hidden_layers": args.layers, "hidden_size": args.hidden, "num_attention_heads": heads,
            "num_key_value_heads": heads, "intermediate_size": args.hidden * 11 // 4 // 64 * 64,
            "vocab_size": args.vocab}


def run(args: argparse.Namespace) -> int:
    if args.model:
        from chatapp.bench.cpu_gguf import run_gguf

        return run_gguf(args)
    if args.geometry == "llama2-7b":
        from chatapp.bench.cpu_flagship import run_flagship

        return run_flagship(args)
    import mlx.core as mx

    from chatapp.backend.blas import current_blas
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.model.synthetic import LlamaShape, build_random_llama

    prompts = [int(p) for p in str(args.prompts).split(",") if p.strip()]
    if not prompts or min(prompts) < 1 or args.decode_tokens < 2:
        raise SystemExit("--prompts needs lengths >= 1 and --decode-tokens needs >= 2")
    load_start = loadavg()
    blas = current_blas()
    print(f"# {blas.summary()}")
    if not blas.loaded:
        print("# WARNING: no optimised BLAS is loaded, so the dense path runs on MLX's reference BLAS and "
              "will not be fast. `chatapp bench cpu` relies on the CLI calling preload_blas() before mlx "
              f"is imported; without it launch: {LAUNCHER}")

    shape = LlamaShape(**bench_shape(args))
    plain, _ = build_random_llama(shape, seed=args.seed, quantize_bits=4)
    fast, _ = build_random_llama(shape, seed=args.seed, quantize_bits=4)
    plan = apply_fast_path(fast, backend="cpu", dense_prefill_threshold=args.threshold,
                           dense_weights=args.dense_weights, numpy_matvec=not args.no_numpy_matvec,
                           kernels=args.kernels, threads=args.threads)
    for line in plan.details():
        print(f"# {line}")
    for w in plan.warnings:
        print(f"# WARNING: {w}")

    rng = __import__("random").Random(args.seed)
    warm = [rng.randrange(shape.vocab_size) for _ in range(8)]
    mlx_lm_generate(plain, warm, 2)
    chatapp_generate(fast, warm, 2)

    rep = BenchReport(
        "cpu: chatapp fast path vs mlx-lm",
        ["prompt", "mlx-lm prefill tok/s", "chatapp prefill tok/s", "prefill x",
         "mlx-lm decode tok/s", "chatapp decode tok/s", "decode x", "greedy equal"],
    )
    for n in prompts:
        prompt = [rng.randrange(shape.vocab_size) for _ in range(n)]
        ref_pf = ref_dc = pf = dc = 0.0
        same = True
        for _ in range(max(1, args.repeats)):  # alternate the two so both see the same machine load
            ref, a, b = mlx_lm_generate(plain, prompt, args.decode_tokens)
            ref_pf, ref_dc = max(ref_pf, a), max(ref_dc, b)
            got, a, b = chatapp_generate(fast, prompt, args.decode_tokens)
            pf, dc = max(pf, a), max(dc, b)
            same = same and ref == got
        if not same:
            first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
            print(f"# prompt {n}: greedy tokens differ from position {first}")
        rep.add(n, ref_pf, pf, pf / ref_pf, ref_dc, dc, dc / ref_dc, "yes" if same else "no")
        print(f"# prompt {n}: prefill {ref_pf:.2f} -> {pf:.2f} tok/s, decode {ref_dc:.2f} -> {dc:.2f} tok/s",
              flush=True)

    rep.meta.update(
        blas=blas.summary(), blas_loaded=blas.loaded, plan=plan.summary(),
        dense_bytes=plan.dense_bytes, decode_tokens=args.decode_tokens, repeats=args.repeats,
        load_average_start=load_start, load_average_end=loadavg(),
        model=f"random 4-bit Llama {shape.config()}", mlx=mx.__version__,
    )
    layers = None if args.no_layer_table else layer_table(args.layer_dim, args.seed)
    if layers is not None:
        rep.meta["layers"] = {"columns": layers.columns, "rows": layers.rows}

    def plot(path):
        xs = [r[0] for r in rep.rows]
        line_plot(path, "CPU: chatapp fast path vs mlx-lm", "prompt tokens", "tokens/s", {
            "mlx-lm prefill": (xs, [r[1] for r in rep.rows]),
            "chatapp prefill": (xs, [r[2] for r in rep.rows]),
            "mlx-lm decode": (xs, [r[4] for r in rep.rows]),
            "chatapp decode": (xs, [r[5] for r in rep.rows]),
        }, logx=True, logy=True)

    emit(rep, args.json, plot, args.plot)
    if layers is not None:
        print()
        emit(layers, None)
    return 0
