"""Every cache policy on the fused native steps (backend/fused_decode.py, kernels/quant_split.py)
against MLX's own route: after random sequences of prefill chunks, decode steps, evictions,
trims (regenerate / edit-last), mode switches (auto's conversion), snapshots and restores, the
fused model's logits and its caches' contents equal those of the same model with no fused step,
fed the same tokens."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cache import CacheSettings, convert_caches, make_caches  # noqa: E402
from cache.factory import restore_caches  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_decode import FusedDecoder  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.fused_support import cache_refusal  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from tests.fused_llama import SHAPE, _no_leftover_kernels, small_llama  # noqa: E402, F401

POLICIES = ("prealloc", "window", "quantized", "window-quant", "scored", "scored-quant")
VOCAB = SHAPE.vocab_size


def _settings(mode: str, bits: int = 8) -> CacheSettings:
    """Small windows and budgets, so a few dozen tokens quantise, evict and re-rotate."""
    return CacheSettings(mode=mode, sinks=2, window=24, evict_chunk=8, max_kv_tokens=56, quant_start=16,
                         kv_bits=bits, kv_group_size=32)


def _pair():
    """The same random model twice: MLX's route, and fused with float32 K/V (so the caches'
    contents compare at float32)."""
    ref, fast = small_llama(), small_llama()
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    assert is_fused(fast)
    return ref, fast


def _content(caches) -> tuple[np.ndarray, np.ndarray]:
    for c in caches:
        c.settle()  # content() reads what is held, maintenance due or not
    k, v = zip(*(c.content() for c in caches))
    return np.stack([np.array(x) for x in k]), np.stack([np.array(x) for x in v])


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> bool:
    return a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) <= tol * max(1.0, float(np.abs(b).max()))


class _Run:
    """One model's conversation: its caches and the logits of every call."""

    def __init__(self, model, settings_: CacheSettings):
        self.model, self.settings = model, settings_
        self.caches = make_caches(model, settings_)

    def prefill(self, tokens: list[int]) -> np.ndarray:
        with last_position_only():  # as the session prefills: the last position's logits only
            out = self.model(mx.array([tokens]), cache=self.caches)
        return np.array(out[0, -1])

    def step(self, token: int) -> np.ndarray:
        return np.array(self.model(mx.array([[token]]), cache=self.caches)[0, -1])

    def trim(self, n: int) -> None:
        for c in self.caches:
            c.trim(n)

    def switch(self, mode: str) -> str:
        self.settings = self.settings.with_(mode=mode)
        conv = convert_caches(self.caches, self.model, self.settings)
        if conv.action == "reprefill":
            return conv.action
        self.caches = conv.caches
        return conv.action

    def snapshot_restore(self) -> None:
        states, metas = [c.state for c in self.caches], [c.meta_state for c in self.caches]
        mx.eval(states)
        self.caches = restore_caches(self.model, self.settings, states, metas)


_ops = st.lists(st.one_of(
    st.tuples(st.just("prefill"), st.integers(2, 20)),
    st.tuples(st.just("decode"), st.integers(1, 24)),
    st.tuples(st.just("trim"), st.integers(1, 6)),
    st.tuples(st.just("switch"), st.sampled_from(POLICIES)),
    st.tuples(st.just("snapshot"), st.just(0)),
), min_size=3, max_size=9)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(POLICIES), bits=st.sampled_from([4, 8]), ops=_ops, seed=st.integers(0, 10_000))
# found by hypothesis: a conversion's second quantisation crossing a second rounding step
@example(mode="quantized", bits=4, seed=0, ops=[("prefill", 2), ("prefill", 2), ("prefill", 2), ("prefill", 15),
                                                ("prefill", 15), ("prefill", 4), ("prefill", 20),
                                                ("switch", "scored-quant")])
def test_fused_policies_equal_mlx_route(mode, bits, ops, seed):
    ref, fast = _pair()
    runs = [_Run(ref, _settings(mode, bits)), _Run(fast, _settings(mode, bits))]
    rng = np.random.default_rng(seed)
    # K/V is quantised from float32 rows on both routes, but the rows differ in their last bits
    # (the kernel sums in another order; the native quantiser's scales differ from mx.quantize's
    # by an ulp), which can move an element across a rounding step: one step of the widest group
    # (2 x |max| / levels). A conversion quantises what it dequantised and an eviction re-rotates
    # quantised keys and quantises them again: a step crossed the first time moves the second
    # group's range (its min or max), so every element of that group moves and one can cross a
    # second step (seen: quantized -> scored-quant, 4-bit, 0.52 against one step's 0.516). The
    # contents' bound is two steps; their mean error stays small (a whole group off is ~1e-4 of
    # the elements); the logits' bound is looser where anything is quantised
    tol = 5e-3 if bits == 8 else 3e-2
    step = 2.0 / (2 ** bits - 1)
    for op, arg in [("prefill", 6)] + ops:
        if op == "prefill":
            toks = [int(t) for t in rng.integers(0, VOCAB, arg)]
            outs = [r.prefill(toks) for r in runs]
        elif op == "decode":
            outs = []
            toks = [int(t) for t in rng.integers(0, VOCAB, arg)]
            for t in toks:
                outs = [r.step(t) for r in runs]
                assert _close(outs[1], outs[0], tol), (op, t)
        elif op == "trim":
            for r in runs:
                r.trim(arg)
            continue
        elif op == "switch":
            actions = {r.switch(arg) for r in runs}
            assert len(actions) == 1
            if actions == {"reprefill"}:
                return  # history a window dropped cannot come back: the session re-prefills
            continue
        else:
            for r in runs:
                r.snapshot_restore()
            continue
        assert _close(outs[1], outs[0], tol), op
        assert cache_refusal(runs[1].caches, SHAPE.num_hidden_layers) is None
    held = [r.caches[0].offset for r in runs]
    assert held[0] == held[1]
    assert [c.evicted for c in runs[0].caches] == [c.evicted for c in runs[1].caches]
    if held[0]:
        (k0, v0), (k1, v1) = (_content(r.caches) for r in runs)
        # tokens quantised on the way count too: a switch back to a full-precision mode keeps
        # them as their dequantised values, which differ by the rounding step the routes crossed
        quantised = any(c.usage().quant_tokens or getattr(c, "quantised_by", None) for c in runs[0].caches)
        for a, b in ((k1, k0), (v1, v0)):
            assert _close(a, b, 2 * step + 1e-4 if quantised else 1e-4)
            assert float(np.abs(a - b).mean()) <= 1e-3 * max(1.0, float(np.abs(b).max()))


@pytest.mark.parametrize("mode", ["window-quant", "scored-quant", "quantized"])
def test_a_decode_step_reads_the_quantised_middle_in_place(mode, monkeypatch):
    """With tokens in the middle, the fused step serves the decode (no MLX attention runs) and the
    middle is never dequantised for it."""
    import cache.buffers as buffers
    import cache.kv as kv

    ref, fast = _pair()
    run = _Run(fast, _settings(mode))
    run.prefill(list(range(1, 17)))
    for t in range(40):
        run.step(t)
    assert run.caches[0].usage().quant_tokens > 0
    steps = []
    real = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, t, c: steps.append(t) or real(self, t, c))
    monkeypatch.setattr(kv, "attend_mixed", lambda *a, **k: pytest.fail("MLX's mixed attention ran"))
    monkeypatch.setattr(buffers.QuantBuffer, "dequantized", lambda *a, **k: pytest.fail("the middle was dequantised"))
    for t in range(5):
        run.step(t)
    assert steps == list(range(5))


def _past_evictions(runs: list, checked: "_Run") -> None:
    """Each run prefills 39 tokens and decodes 40 more: past several evictions, so that ``checked``'s
    quantised middle holds rows and has moved (a rotation delta not 0)."""
    for r in runs:
        r.prefill(list(range(1, 40)))
        for t in range(40):
            r.step(t)
    c0 = checked.caches[0]
    assert c0.delta_q != 0 and c0.quant.length > 0

def _fast_pair(seed: int, prefill: bool) -> list:
    """The same random model (head_dim 64: a layout the integer kernels serve) twice on numerics
    fast: the middle's decode scores on integers, then with FAST_ATTN cleared (and with
    ``prefill``, the prefill's attention too, both products)."""
    from dataclasses import replace

    from chatapp.kernels.decode_step import FAST_ATTN
    from tests.fused_llama import build_random_llama, install_attention

    models = []
    for attn in (True, False):
        m, _ = build_random_llama(replace(SHAPE, head_dim=64), seed=seed, quantize_bits=4, group_size=32)
        mx.eval(m.parameters())
        install_attention(m)
        apply_fast_path(m, backend="cpu", warm_up=False, kv_dtype="float16", numerics="fast")
        dec = m._chatapp_fused
        assert all(f & FAST_ATTN for f in dec.fast_mask[:-1])
        if not attn:
            dec.fast_mask[:] &= ~FAST_ATTN
            if prefill:
                dec.prefill_mask[:] &= ~FAST_ATTN
        models.append(m)
    return models


@pytest.mark.parametrize("bits", [8, 4])
def test_fast_numerics_scores_a_quantised_middle_on_integers(bits):
    """numerics fast: the middle's scores run on 16-bit query planes (kernels/qk_int.py, where the
    CPU has vpdpbusd); with the bit cleared they run on floats. The two agree bit for bit until
    the middle holds rows; then within what the int8 activations' rounding makes of any change
    (fast against exact numerics differ by ~2% of the logits' scale here): a score gone wrong
    (a missing bias, a wrong row) moves them by their whole scale."""

    from chatapp.kernels.qk_int import INT_SCORES

    if not INT_SCORES:
        pytest.skip("this CPU has no vpdpbusd: the middle's scores stay on floats")
    runs = [_Run(m, _settings("window-quant", bits).with_(kv_group_size=64)) for m in _fast_pair(5, prefill=False)]
    for run in runs:
        run.prefill(list(range(1, 17)))
    moved = 0.0
    for t in range(40):
        a, b = runs[0].step(t), runs[1].step(t)
        assert _close(a, b, 2e-2), (t, float(np.abs(a - b).max()))
        moved = max(moved, float(np.abs(a - b).max()))
    assert runs[0].caches[0].usage().quant_tokens > 0
    assert moved > 0  # the two routes differ in rounding: the integer one ran


def test_fast_numerics_prefills_over_an_8bit_middle_on_integers():
    """numerics fast: a prefill chunk over a moved 8-bit middle runs its scores and its P V over the
    middle on integers (kernels/chunk_scores_int.py, kernels/pv_prefill_int.py, where the CPU has
    vpdpbusd); with FAST_ATTN cleared both run on floats, and so did the decode steps before (whose
    rows the chunk reads). The two chunks' logits agree within what the int8 activations' rounding
    makes of any change (measured 1.2% of the logits' scale here); a P V gone wrong (its bias term
    dropped) moved them by 34%."""
    from chatapp.kernels.qk_int import INT_SCORES

    if not INT_SCORES:
        pytest.skip("this CPU has no vpdpbusd: the prefill's attention stays on floats")
    runs = [_Run(m, _settings("window-quant", 8)) for m in _fast_pair(6, prefill=True)]
    _past_evictions(runs, runs[0])
    a, b = (run.prefill(list(range(50, 90))) for run in runs)
    assert _close(a, b, 2e-2), float(np.abs(a - b).max())
    assert float(np.abs(a - b).max()) > 0  # the integer route ran


def test_scored_votes_come_from_the_fused_steps_queries():
    """The scored caches choose what to evict from their last queries' attention: the fused step
    hands them the roped queries it computed, the same as MLX's route keeps."""
    ref, fast = _pair()
    runs = [_Run(ref, _settings("scored")), _Run(fast, _settings("scored"))]
    for r in runs:
        r.prefill(list(range(3, 13)))
        for t in range(60):
            r.step((7 * t) % VOCAB)
    (a, b) = (r.caches[0] for r in runs)
    assert a.evicted == b.evicted > 0 and a.last_dropped == b.last_dropped
    assert _close(np.array(b._obs), np.array(a._obs), 1e-4)


@pytest.mark.parametrize("chunk", [5, 16, 23])
def test_scored_votes_come_from_the_fused_prefills_queries(chunk):
    """A prefill chunk's last queries (up to the observation window) are the next votes: the fused
    prefill hands every layer's over, roped at their positions, as MLX's route keeps them (the last
    layer, which computes past K/V for the chunk's last row only, computes those rows' queries too)."""
    ref, fast = _pair()
    runs = [_Run(ref, _settings("scored")), _Run(fast, _settings("scored"))]
    for r in runs:
        r.prefill(list(range(3, 3 + chunk)))
        r.prefill(list(range(40, 40 + chunk)))
    for a, b in zip(*(r.caches for r in runs)):
        assert b._obs.shape == a._obs.shape and _close(np.array(b._obs), np.array(a._obs), 1e-4)
        assert b._since == a._since == 2 * chunk


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_prefill_over_a_moved_quantised_middle_reads_it_in_place(bits, kv_dtype, monkeypatch):
    """A prefill chunk over a quantised middle that evictions have moved (its rotation delta
    not 0) reads the middle as stored (never dequantised through MLX) and gives MLX's route's
    logits; its rows land after the window as MLX's route puts them."""
    import cache.buffers as buffers

    ref = small_llama()
    fast = small_llama()
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype=kv_dtype)
    runs = [_Run(ref, _settings("window-quant", bits)), _Run(fast, _settings("window-quant", bits))]
    _past_evictions(runs, runs[1])
    real = buffers.QuantBuffer.dequantized
    monkeypatch.setattr(buffers.QuantBuffer, "dequantized", lambda *a, **k: pytest.fail("the middle was dequantised"))
    got = runs[1].prefill(list(range(50, 70)))
    monkeypatch.setattr(buffers.QuantBuffer, "dequantized", real)
    want = runs[0].prefill(list(range(50, 70)))
    tol = 3e-2 if bits == 4 or kv_dtype == "float16" else 5e-3
    assert _close(got, want, tol)
    for a, b in zip(_content(runs[0].caches), _content(runs[1].caches)):
        assert a.shape == b.shape
