"""SmolLM2-135M-Instruct (a real, trained chat model, as a Q4_1 GGUF) through the whole stack:
its tokenizer against llama.cpp's ids, a greedy answer, cache reuse across turns, every cache mode
past its window, and resume / prefix-store warm starts equal to cold starts."""

from __future__ import annotations

import pytest

from cache import CacheSettings
from chatapp.engine.generate import GenerationSettings, run_turn
from chatapp.engine.session import Session
from chatapp.store.chat import ModelIdentity, open_chat
from tests.conftest import SHARED_MODELS

GGUF = SHARED_MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
GREEDY = GenerationSettings(temp=0.0, max_tokens=12)
# ids from llama.cpp's own tokenizer on this file (../shared/models/README.md)
REFERENCE_IDS = {
    "Hello, world!": [19556, 28, 905, 17],
    "The year 2026 has 365 days.": [504, 713, 216, 34, 32, 34, 38, 553, 216, 35, 38, 37, 2009, 30],
    "  two leading spaces\n\ttab": [216, 827, 2899, 5600, 198, 197, 15999],
    "naïve café “quoted”": [3546, 46494, 37366, 619, 385, 5036, 573],
}


@pytest.fixture(scope="module")
def smol():
    """Loaded once for the module, as the app loads it on the CPU (``load_engine``): float16
    scales kept (the prefix store's namespace takes the activations' dtype) and the CPU fast
    path applied. Without the fast path MLX's CPU products prefill ~3 tokens/s on a busy machine
    (minutes for the prefix test's 300-token prompt), a configuration the app never runs."""
    if not GGUF.is_file():
        pytest.skip(f"needs {GGUF} (../shared is absent)")
    from cache.attention import decode_kernels, set_decode_kernels
    from chatapp.backend.cpu import apply_fast_path
    from chatapp.model.loader import load_model

    lm = load_model(str(GGUF), cast_scales=False)
    previous = decode_kernels()
    apply_fast_path(lm.model, backend="cpu")
    yield lm
    set_decode_kernels(*previous)  # process-wide: leave none behind for other modules


def session(lm, mode="prealloc", settings=None, system="", max_tokens=12) -> Session:
    return Session(lm.model, lm.tokenizer, mode=mode, cache_settings=settings or CacheSettings(), system=system,
                   generation=GenerationSettings(temp=0.0, max_tokens=max_tokens))


def test_tokenizer_gives_llama_cpp_ids(smol):
    tok = smol.tokenizer
    for text, ids in REFERENCE_IDS.items():
        assert tok.encode(text, add_special_tokens=False) == ids, text
    assert tok.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False) == [1, 4093, 198, 26843, 2, 198]
    assert smol.has_chat_template and smol.format == "gguf"


def test_greedy_answer_names_paris_and_stops_at_im_end(smol):
    s = session(smol, max_tokens=24)
    done = run_turn(s.send("What is the capital of France?"))
    assert done.stats.prompt_tokens == 37
    assert "Paris" in done.text and "<|im_end|>" not in done.text
    assert done.stats.finish == "eos"  # <|im_end|> ended the reply before max_tokens


def test_three_turns_reuse_the_previous_prompt_and_reply(smol):
    s = session(smol)
    prev = None
    for q in ("Name a colour.", "Name an animal.", "Name a fruit."):
        done = run_turn(s.send(q))
        if prev is not None:
            assert done.stats.reused_tokens == prev
        prev = len(s.cached)  # this turn's prompt + reply
        assert prev >= done.stats.prompt_tokens


SMALL = dict(sinks=4, window=32, evict_chunk=16, max_kv_tokens=64, quant_start=24)


@pytest.mark.parametrize("mode", ["concat", "prealloc", "quantized", "window", "window-quant"])
def test_every_cache_mode_runs_a_conversation_past_its_window(smol, mode):
    s = session(smol, mode=mode, settings=CacheSettings(**SMALL), max_tokens=8)
    for q in ("Tell me about the sea.", "And about the mountains?", "Which is colder?"):
        done = run_turn(s.send(q))
        assert done.text.strip()
    assert len(s.cached) > SMALL["window"] + SMALL["sinks"] + SMALL["evict_chunk"]
    if mode in ("window", "window-quant"):
        assert s.caches[0].evicted > 0


def test_resume_gives_the_cold_reply(smol, tmp_path):
    ident = ModelIdentity.from_loaded(smol, str(GGUF))
    with open_chat(session(smol), ident, tmp_path) as chat:
        run_turn(chat.send("Name a colour."))
    cold = session(smol)
    run_turn(cold.send("Name a colour."))
    expected = run_turn(cold.send("Name another one."))
    with open_chat(session(smol), ident, tmp_path, resume="latest") as chat:
        assert chat.resume_info.source == "snapshot", chat.resume_info.reason
        done = run_turn(chat.send("Name another one."))
    assert done.text == expected.text and done.stats.reused_tokens == expected.stats.reused_tokens


def test_prefix_store_warm_start_gives_the_cold_reply(smol, tmp_path):
    # float16 scales kept (the fixture), as the app loads on the CPU: the namespace takes the
    # activations' dtype
    ident = ModelIdentity.from_loaded(smol, str(GGUF))
    system = "You are a helpful assistant. Answer in one short sentence about geography. " * 20
    with open_chat(session(smol, system=system), ident, tmp_path, prefix_cap_mb=64) as chat:
        run_turn(chat.send("What is the capital of Italy?"))
        chat.after_turn()
    warm_session = session(smol, system=system)
    with open_chat(warm_session, ident, tmp_path, prefix_cap_mb=64) as chat:
        warm = run_turn(chat.send("What is the capital of France?"))
    cold_session = session(smol, system=system)
    cold = run_turn(cold_session.send("What is the capital of France?"))
    assert warm.stats.prefix_tokens >= 256 and cold.stats.prefix_tokens == 0
    assert warm.text == cold.text and warm_session.cached == cold_session.cached
