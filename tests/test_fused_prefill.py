"""The fused prefill chunk (kernels/prefill_step.py: every layer of a T-token chunk in one native
call) against MLX's own model: last-position logits, the K/V it leaves in the caches, and where
it is not used."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("numba", reason="the CPU kernels need numba (installed on Linux x86_64/aarch64)")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cache import CacheSettings, make_caches  # noqa: E402
from cache.kv import SegmentedKVCache  # noqa: E402
from chatapp.backend.cpu import apply_fast_path  # noqa: E402
from chatapp.backend.fused_decode import FusedDecoder  # noqa: E402
from chatapp.backend.fused_install import is_fused  # noqa: E402
from chatapp.backend.qlinear import last_position_only  # noqa: E402
from tests.fused_llama import SHAPE as SMALL  # noqa: E402
from tests.fused_llama import _no_leftover_kernels  # noqa: E402, F401
from tests.test_fused_decode import SMOL, _close, _model  # noqa: E402


def _prefill(model, history: list[int], chunk: list[int], mode: str = "prealloc"):
    """(last-position logits of ``chunk`` after ``history``, caches), as the session prefills."""
    caches = make_caches(model, CacheSettings(mode=mode))
    with last_position_only():
        if history:
            model(mx.array([history]), cache=caches)
        out = model(mx.array([chunk]), cache=caches)[0, -1]
    mx.eval(out)
    return np.array(out), caches


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([4, 8]), group_size=st.sampled_from([32, 64]), traditional=st.booleans(),
       cached=st.integers(0, 30), tokens=st.integers(2, 40), seed=st.integers(0, 3))
def test_fused_prefill_matches_dequantize_then_matmul(bits, group_size, traditional, cached, tokens, seed):
    ref = _model(bits, group_size, tied=False, traditional=traditional, seed=seed, shape=SMALL)
    fast = _model(bits, group_size, tied=False, traditional=traditional, seed=seed, shape=SMALL)
    apply_fast_path(fast, backend="cpu", warm_up=False)
    assert is_fused(fast)
    ids = [int(t) for t in mx.random.randint(0, 256, (cached + tokens,), key=mx.random.key(seed))]
    (a, ca), (b, cb) = (_prefill(m, ids[:cached], ids[cached:]) for m in (ref, fast))
    assert _close(b, a)
    for x, y in zip(cb, ca):
        assert x.offset == y.offset == cached + tokens
        (kx, vx), (ky, vy) = x.full.view(), y.full.view()
        assert _close(np.array(kx), np.array(ky)) and _close(np.array(vx), np.array(vy))


def test_fused_prefill_is_taken_for_session_chunks_only(monkeypatch):
    ref, fast = _model(shape=SMOL), _model(shape=SMOL)
    apply_fast_path(fast, backend="cpu", warm_up=False)
    calls = []
    real = FusedDecoder.prefill
    monkeypatch.setattr(FusedDecoder, "prefill", lambda self, t, c: calls.append(t.shape[0]) or real(self, t, c))
    a, _ = _prefill(ref, [], list(range(20)))
    b, _ = _prefill(fast, [], list(range(20)))
    assert calls == [20] and _close(b, a)
    # all positions' logits wanted (no last_position_only): MLX's route, every row computed
    out = fast(mx.array([list(range(20))]), cache=make_caches(fast, CacheSettings()))
    want = ref(mx.array([list(range(20))]), cache=make_caches(ref, CacheSettings()))
    assert calls == [20] and out.shape == want.shape and _close(np.array(out), np.array(want))
    # every segmented cache takes it too; concat (per-token concatenation, shown for its cost) does not
    _prefill(fast, [], list(range(20)), mode="window-quant")
    assert calls == [20, 20]
    _prefill(fast, [], list(range(20)), mode="concat")
    assert calls == [20, 20]


def test_greedy_after_a_fused_prefill_equals_mlx():
    ref, fast = _model(shape=SMOL, seed=2), _model(shape=SMOL, seed=2)
    apply_fast_path(fast, backend="cpu", warm_up=False)
    outs = []
    for m in (ref, fast):
        logits, caches = _prefill(m, list(range(7)), list(range(40, 71)))
        toks = []
        for _ in range(8):
            toks.append(int(np.argmax(logits)))
            logits = np.array(m(mx.array([[toks[-1]]]), cache=caches)[0, -1])
        outs.append(toks)
    assert outs[0] == outs[1]


def test_fast_numerics_runs_every_product_on_int8_but_the_last_layer_and_a_cleared_mask_is_exact():
    from chatapp.kernels.decode_step import FAST_ALL, FAST_ATTN, FAST_DOWN, FAST_DOWN_WIDE
    from chatapp.kernels.prefill_step import PREFILL_DOWN_WIDE

    exact, fast = _model(shape=SMOL, seed=4), _model(shape=SMOL, seed=4)
    apply_fast_path(exact, backend="cpu", warm_up=False)
    plan = apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    dec = fast._chatapp_fused
    last = len(dec.layers) - 1
    assert PREFILL_DOWN_WIDE == FAST_DOWN_WIDE and FAST_DOWN_WIDE & FAST_ALL == 0 and FAST_DOWN_WIDE < 1 << 8
    assert list(dec.fast_mask) == list(dec.prefill_mask) == [FAST_ALL] * last + [0]
    assert "down_proj on int8 too; the last layer exact" in plan.fused_decode
    # down_proj on 16 bits or exact on request, per phase; the other products stay on int8
    wide = FAST_ALL & ~FAST_DOWN | FAST_DOWN_WIDE
    dec.set_fast(True, decode_down="wide")
    assert list(dec.fast_mask) == [wide] * last + [0] and list(dec.prefill_mask) == [FAST_ALL] * last + [0]
    dec.set_fast(True, decode_down="exact", prefill_down="wide")
    assert list(dec.fast_mask) == [FAST_ALL & ~FAST_DOWN] * last + [0]
    assert list(dec.prefill_mask) == [wide] * last + [0]
    dec.set_fast(True, last_exact=False, prefill_down="exact")
    assert list(dec.fast_mask) == [FAST_ALL] * (last + 1)
    assert list(dec.prefill_mask) == [FAST_ALL & ~FAST_DOWN] * (last + 1)
    # the prefill's scores on floats on request (they run on integers only where the CPU has vpdpbusd)
    dec.set_fast(True, prefill_scores="exact")
    assert list(dec.fast_mask) == [FAST_ALL] * last + [0]
    assert list(dec.prefill_mask) == [FAST_ALL & ~FAST_ATTN] * last + [0]
    for bad in ({"decode_down": "int4"}, {"prefill_down": "float"}, {"prefill_scores": "int4"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dec.set_fast(True, **bad)
    dec.set_fast(True)

    def step_logits(m):
        caches = make_caches(m, CacheSettings())
        m(mx.array([[1, 2, 3, 4]]), cache=caches)
        return np.array(m(mx.array([[5]]), cache=caches)[0, -1])

    want, got_fast = step_logits(exact), step_logits(fast)
    assert not np.array_equal(got_fast, want)  # int8 activations in layer 0 change the numbers
    dec.fast_mask[:] = 0
    # the output head has its own switch (int8head.py): on int8 alone it moves the logits a little
    head_only = np.abs(step_logits(fast) - want).max() / np.abs(want).max()
    assert 0 < head_only < 1e-2, head_only
    dec.int8_head = False
    assert np.array_equal(step_logits(fast), want)
    # down_proj alone on 16-bit activations in every layer: far closer to exact than on int8
    err = {}
    for bit in (FAST_DOWN_WIDE, FAST_DOWN):
        dec.fast_mask[:] = bit
        err[bit] = np.abs(step_logits(fast) - want).max() / np.abs(want).max()
    assert 0 < err[FAST_DOWN_WIDE] < 1e-3 and err[FAST_DOWN_WIDE] * 20 < err[FAST_DOWN], err


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_size=st.sampled_from([32, 64]), cached=st.integers(0, 20), tokens=st.integers(2, 23),
       seed=st.integers(0, 3), prefill_block=st.sampled_from([0, 8, 64]))
# blocks of 64 (one int8 scale per 64 activations) round coarser: 5.2-5.3% of the largest logit here
@example(group_size=64, cached=2, tokens=5, seed=2, prefill_block=64)
@example(group_size=64, cached=1, tokens=3, seed=3, prefill_block=64)
def test_fast_prefill_stays_close_to_the_exact_one(group_size, cached, tokens, seed, prefill_block):
    """numerics fast: the prefill's 4-bit products on int8 activations (int8panel.py, 16 rows x 8
    tokens, token counts that are no multiple of 8 included; activation blocks finer than, as and
    coarser than the group): last logits and every cached K/V within int8 rounding of the exact
    fused prefill; a cleared mask gives the exact numbers."""
    exact = _model(4, group_size, tied=False, seed=seed, shape=SMALL)
    fast = _model(4, group_size, tied=False, seed=seed, shape=SMALL)
    apply_fast_path(exact, backend="cpu", warm_up=False)
    apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    # every product on int8
    fast._chatapp_fused.set_fast(True, last_exact=False, prefill_block=prefill_block)
    ids = [int(t) for t in mx.random.randint(0, 256, (cached + tokens,), key=mx.random.key(seed))]
    (a, ca), (b, cb) = (_prefill(m, ids[:cached], ids[cached:]) for m in (exact, fast))
    assert not np.array_equal(a, b)
    rel = 8e-2 if prefill_block == 64 else 5e-2  # two layers of int8 rounding, coarser over 64 elements
    assert np.abs(a - b).max() <= rel * np.abs(a).max()
    for x, y in zip(cb, ca):
        (kx, vx), (ky, vy) = x.full.view(), y.full.view()
        for p, q in ((np.array(kx), np.array(ky)), (np.array(vx), np.array(vy))):
            assert np.abs(p - q).max() <= rel * np.abs(q).max()
    fast._chatapp_fused.set_fast(False)
    assert np.array_equal(_prefill(fast, ids[:cached], ids[cached:])[0], a)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group_size=st.sampled_from([32, 64]), cached=st.integers(0, 20), tokens=st.integers(2, 23),
       seed=st.integers(0, 3), prefill_block=st.sampled_from([0, 8, 64]))
def test_the_prefills_16_bit_down_proj_stays_far_closer_to_exact_than_int8(group_size, cached, tokens, seed,
                                                                         prefill_block):
    """numerics fast with every other product exact: the prefill's down_proj on 16-bit activations
    (two int8 planes) changes the last logits and the cached K/V (layer 1's, from layer 0's down)
    by a fraction of what int8 ones change them, and is not the float route."""
    ref = _model(4, group_size, tied=False, seed=seed, shape=SMALL)
    apply_fast_path(ref, backend="cpu", warm_up=False)
    fast = _model(4, group_size, tied=False, seed=seed, shape=SMALL)
    apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    dec = fast._chatapp_fused
    ids = [int(t) for t in mx.random.randint(0, 256, (cached + tokens,), key=mx.random.key(seed))]
    a, ca = _prefill(ref, ids[:cached], ids[cached:])
    got = {}
    for down in ("wide", "int8"):
        dec.set_fast(True, last_exact=False, prefill_block=prefill_block, prefill_down=down, head="exact",
                     prefill_scores="exact")
        dec.prefill_mask &= ~7  # q/k/v, o, gate/up and the scores exact: only down_proj's activations differ
        dec.fast_mask[:] = 0  # and a one-token history goes through the (exact) decode step
        got[down] = _prefill(fast, ids[:cached], ids[cached:])
    err = {}
    for down, (b, cb) in got.items():
        k1 = np.array(cb[1].full.view()[0])
        err[down] = (np.abs(b - a).max() / np.abs(a).max(), np.abs(k1 - np.array(ca[1].full.view()[0])).max())
    assert not np.array_equal(got["wide"][0], a)
    assert err["wide"][0] <= 2e-3 and err["wide"][0] * 8 <= err["int8"][0]
    # layer 1's keys are float16 in the cache: wide moves them by at most a rounding flip (one
    # float16 step of the largest key), int8 by more
    step = float(np.spacing(np.abs(np.array(ca[1].full.view()[0])).max().astype(np.float16)))
    assert err["wide"][1] <= step < err["int8"][1], (err, step)


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_prefill_rows_written_in_place_equal_the_appended_ones(kv_dtype, monkeypatch):
    """The chunk's K/V written straight into the cache buffers (no [layers, T, kv] copy) are the
    bits the append through update_and_fetch leaves, after cached rows too; a chunk over rows a
    snapshot holds (after a trim) is appended through MLX and leaves the snapshot as it was."""
    model = _model(shape=SMALL, seed=1)
    apply_fast_path(model, backend="cpu", warm_up=False, kv_dtype=kv_dtype)
    dec = model._chatapp_fused
    ids = [int(t) for t in mx.random.randint(0, 256, (45,), key=mx.random.key(4))]
    runs = []
    appended = []
    real = SegmentedKVCache.absorb
    monkeypatch.setattr(SegmentedKVCache, "absorb", lambda self, k, v: appended.append(1) or real(self, k, v))
    for in_place in (True, False):
        dec.write_in_place = in_place
        caches = make_caches(model, CacheSettings(mode="prealloc"))
        logits = [dec.prefill(mx.array(ids[:20]), caches), dec.prefill(mx.array(ids[20:]), caches)]
        # rows written in place never go through an append; the other route appends each chunk
        runs.append((logits, [tuple(np.array(a) for a in c.full.view()) for c in caches], caches, len(appended)))
    dec.write_in_place = True
    (la, ka, ca, appends_a), (lb, kb, _, appends_b) = runs
    assert appends_a == 0 and appends_b == 2 * len(ca)
    assert all(np.array_equal(x, y) for x, y in zip(la, lb))
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(ka, kb))
    assert ka[0][0].dtype == {"float16": np.float16, "float32": np.float32}[kv_dtype]
    held = [c.full.view() for c in ca]  # handed out: rows 0..44 of the buffers
    before = [tuple(np.array(a) for a in h) for h in held]
    for c in ca:
        c.trim(10)
    other = [int(t) for t in mx.random.randint(0, 256, (10,), key=mx.random.key(5))]
    dec.prefill(mx.array(other), ca)
    assert all(c.offset == 45 for c in ca)
    assert all(np.array_equal(np.array(h[0]), b[0]) and np.array_equal(np.array(h[1]), b[1])
               for h, b in zip(held, before))
    assert any(not np.array_equal(np.array(c.full.view()[0]), b[0]) for c, b in zip(ca, before))


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_a_prefill_that_fills_the_cache_chunk_whole_keeps_its_rows_through_the_growth(kv_dtype):
    """A 256-token prefill into an empty cache fills its first chunk exactly; the next step grows
    the buffers, which must carry the rows the kernel wrote (once keys and values were made one
    buffer there, and every later token attended to garbage: perplexity 17 -> 941 on SmolLM2)."""
    ref = _model(shape=SMALL, seed=1)
    fast = _model(shape=SMALL, seed=1)
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype=kv_dtype)
    ids = [int(t) for t in mx.random.randint(0, 256, (259,), key=mx.random.key(6))]
    chunk = CacheSettings().chunk_size
    assert chunk == 256
    outs = []
    for m in (ref, fast):
        logits, caches = _prefill(m, [], ids[:chunk])
        seq = [logits]
        for t in ids[chunk:]:
            seq.append(np.array(m(mx.array([[t]]), cache=caches)[0, -1]))
        outs.append(seq)
        assert not np.shares_memory(np.asarray(caches[0].full.keys), np.asarray(caches[0].full.values))
    assert all(_close(b, a) for a, b in zip(*outs))


def test_the_prefills_integer_scores_move_the_logits_by_a_rounding_only():
    """numerics fast with every product exact but the prefill's scores: on a CPU with vpdpbusd
    (u8 keys, int8 queries) the chunk's last logits and layer 1's cached keys differ from the
    float scores' by little; elsewhere the scores stay on floats and nothing differs."""
    from chatapp.kernels.decode_step import FAST_ATTN
    from chatapp.kernels.qk_int import INT_SCORES

    fast = _model(4, 32, tied=False, seed=3, shape=SMALL)
    apply_fast_path(fast, backend="cpu", warm_up=False, numerics="fast")
    dec = fast._chatapp_fused
    ids = [int(t) for t in mx.random.randint(0, 256, (60,), key=mx.random.key(3))]
    got = {}
    for scores in ("exact", "int8"):
        dec.set_fast(True, last_exact=False, head="exact", prefill_scores=scores)
        dec.prefill_mask &= FAST_ATTN  # every product exact: only the scores differ
        dec.fast_mask[:] = 0
        got[scores] = _prefill(fast, ids[:20], ids[20:])
    (a, ca), (b, cb) = got["exact"], got["int8"]
    k_a, k_b = (np.array(c[1].full.view()[0]) for c in (ca, cb))
    if not INT_SCORES:
        assert np.array_equal(a, b) and np.array_equal(k_a, k_b)
        return
    assert not np.array_equal(a, b)
    # 2.7e-3 and 3.1e-3 here (seed 3)
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()
    assert np.abs(k_a - k_b).max() <= 1e-2 * np.abs(k_a).max()


@pytest.mark.parametrize("mode", ["prealloc", "window-quant"])
def test_every_position_of_a_fused_prefill_equals_mlx(mode):
    """bench quality's chunked fused route (prefill_every_position): each row's logits, not the
    last one's alone, equal MLX's route; for window-quant after enough history that the chunk
    reads a quantised middle moved by evictions."""
    from chatapp.backend.fused_install import prefill_every_position
    from tests.test_fused_policies import _settings

    settings_ = _settings(mode) if mode != "prealloc" else CacheSettings(mode=mode)
    ref, fast = _model(shape=SMALL, seed=1), _model(shape=SMALL, seed=1)
    apply_fast_path(fast, backend="cpu", warm_up=False, kv_dtype="float32")
    ids = [int(t) for t in mx.random.randint(0, 256, (104,), key=mx.random.key(5))]
    ca, cb = make_caches(ref, settings_), make_caches(fast, settings_)
    for start in range(0, 96, 8):
        want = ref(mx.array([ids[start:start + 8]]), cache=ca)[0]
        got = prefill_every_position(fast, mx.array([ids[start:start + 8]]), cb)
        assert got is not None and got.shape[1] == 8
        assert _close(np.array(got[0]), np.array(want)), start
    if mode != "prealloc":
        assert cb[0].quant is not None and cb[0].quant.length > 0 and cb[0].evicted > 0
    # not fused (the plain model): None, the caller runs the model
    assert prefill_every_position(ref, mx.array([ids[:8]]), make_caches(ref, settings_)) is None
