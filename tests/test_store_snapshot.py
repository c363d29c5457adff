"""KV snapshots: restoring caches from saved state (every mode), the file format, damage."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from cache import CacheSettings, make_caches
from cache.factory import restore_caches
from cache.kv import CacheStateError
from chatapp.store.snapshot import (
    SnapshotError,
    SnapshotWriteError,
    read_snapshot,
    save_snapshot,
    state_nbytes,
    token_hash,
)
from tests.conftest import tiny_llama

SMALL = dict(sinks=4, window=48, evict_chunk=16, max_kv_tokens=96, quant_start=40)
MODES = ["concat", "prealloc", "quantized", "window", "window-quant", "scored", "scored-quant"]


def ids(n: int, seed: int = 3) -> list[int]:
    return mx.random.randint(0, 512, (n,), key=mx.random.key(seed)).tolist()


def fill(model, caches, tokens: list[int], prefill: int = 120) -> None:
    model(mx.array([tokens[:prefill]]), cache=caches)
    for t in tokens[prefill:]:
        model(mx.array([[t]]), cache=caches)


def next_logits(model, caches, tokens: list[int]) -> mx.array:
    """Prefill a chunk, then decode token by token: logits of every position."""
    out = [model(mx.array([tokens[:5]]), cache=caches)[0]]
    for t in tokens[5:]:
        out.append(model(mx.array([[t]]), cache=caches)[0])
    return mx.concatenate(out, axis=0)


def save(path, caches, tokens, settings, **kw):
    args = dict(caches=caches, tokens=tokens, settings=settings, requested_mode=settings.mode, model_id="tiny",
                weights_fingerprint="fp", messages=2, transcript_sha256="t" * 64, prompt_format="plain",
                conversation_id=1)
    args.update(kw)
    return save_snapshot(path, **args)


@pytest.mark.parametrize("mode", MODES)
def test_restore_round_trip_through_a_file_gives_identical_logits(mode, tmp_path):
    model = tiny_llama(layers=2)
    settings = CacheSettings(mode=mode, **SMALL)
    history, more = ids(230), ids(40, seed=4)
    live = make_caches(model, settings)
    fill(model, live, history)
    path = tmp_path / "1.safetensors"
    size = save(path, live, history, settings)
    assert size == path.stat().st_size and size >= state_nbytes(live)
    snap = read_snapshot(path)
    assert snap.tokens == history and snap.settings == settings and snap.messages == 2
    restored = restore_caches(model, snap.settings, snap.states, snap.metas)
    u_live, u_rest = live[0].usage(), restored[0].usage()
    assert (u_rest.full_tokens, u_rest.quant_tokens, u_rest.evicted) == (u_live.full_tokens, u_live.quant_tokens,
                                                                        u_live.evicted)
    if mode == "window-quant":  # the hard case: quantised tokens, a rotation delta and evictions
        assert live[0].delta_q > 0 and live[0].evicted > 0 and u_live.quant_tokens > 0
        assert restored[0].delta_q == live[0].delta_q
    if mode in ("window", "scored"):
        assert live[0].evicted > 0
    if mode == "quantized":
        assert u_live.quant_tokens > 0
    a = next_logits(model, live, more)
    b = next_logits(model, restored, more)
    assert mx.array_equal(a, b).item()
    # and both keep doing the same maintenance afterwards
    assert (live[0].offset, live[0].evicted, live[0].delta_q if hasattr(live[0], "delta_q") else 0) == (
        restored[0].offset, restored[0].evicted, restored[0].delta_q if hasattr(restored[0], "delta_q") else 0)


def test_restore_in_memory_with_pending_maintenance():
    """State read while maintenance is due (before the next offset read) restores the same."""
    model = tiny_llama(layers=2)
    settings = CacheSettings(mode="window-quant", **SMALL)
    live = make_caches(model, settings)
    model(mx.array([ids(150)]), cache=live)  # maintenance is now pending
    assert live[0]._pending
    states, metas = [c.state for c in live], [c.meta_state for c in live]
    restored = restore_caches(model, settings, states, metas)
    more = ids(20, seed=9)
    assert mx.array_equal(next_logits(model, live, more), next_logits(model, restored, more)).item()


def test_restore_refuses_state_that_does_not_fit():
    model = tiny_llama(layers=2)
    wq = CacheSettings(mode="window-quant", **SMALL)
    live = make_caches(model, wq)
    fill(model, live, ids(230))
    states, metas = [c.state for c in live], [c.meta_state for c in live]
    with pytest.raises(CacheStateError, match="layers"):
        restore_caches(model, wq, states[:1], metas[:1])
    with pytest.raises(CacheStateError, match="quantised tokens but window keeps none"):
        restore_caches(model, CacheSettings(mode="window", **SMALL), states, metas)
    with pytest.raises(CacheStateError, match="never evicts"):
        restore_caches(model, CacheSettings(mode="prealloc", **SMALL), [s[:2] for s in states], metas)
    with pytest.raises(CacheStateError, match="meta state"):
        restore_caches(model, wq, states, [("x",)] * 2)
    other = tiny_llama(layers=2, head_dim=32, kv_heads=2, heads=4)
    with pytest.raises(CacheStateError, match="head_dim"):
        restore_caches(other, CacheSettings(mode="window", **SMALL), [s[:2] for s in states], [("0", "0")] * 2)
    with pytest.raises(CacheStateError, match="no meta state"):
        restore_caches(model, CacheSettings(mode="concat"), [s[:2] for s in states], metas)


def test_snapshot_metadata_is_strings_and_complete(tmp_path):
    path, _, toks, _ = _saved(tmp_path)
    arrays, md = mx.load(str(path), return_metadata=True)
    assert md["format"] == "chatapp-kv-snapshot" and md["version"] == "1"
    assert md["tokens_sha256"] == token_hash(toks) and md["model_id"] == "tiny"
    assert json.loads(md["cache_settings"])["mode"] == "prealloc"
    assert set(arrays) == {"tokens", "layer.0.0", "layer.0.1", "layer.1.0", "layer.1.1"}
    assert arrays["tokens"].tolist() == toks
    assert not [p for p in tmp_path.iterdir() if p.name != path.name]  # no temporary file left


def _saved(tmp_path):
    model = tiny_llama(layers=2)
    settings = CacheSettings(mode="prealloc")
    caches = make_caches(model, settings)
    toks = ids(60)
    fill(model, caches, toks, prefill=60)
    path = tmp_path / "1.safetensors"
    save(path, caches, toks, settings)
    return path, caches, toks, settings


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "damaged"),
    ("header", "damaged"),
    ("flip", "checksum"),
    ("empty", "damaged"),
    ("missing", "no snapshot"),
])
def test_damaged_snapshots_are_detected(tmp_path, damage, reason):
    path, *_ = _saved(tmp_path)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 1000])
    elif damage == "header":
        path.write_bytes(data[:8] + b"{garbage" + data[16:])
    elif damage == "flip":
        i = len(data) - 300
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    with pytest.raises(SnapshotError, match=reason):
        read_snapshot(path)


def test_other_format_and_tampered_tokens_are_refused(tmp_path):
    path, caches, toks, settings = _saved(tmp_path)
    arrays, md = mx.load(str(path), return_metadata=True)
    md2 = dict(md, format="something-else")
    mx.save_safetensors(str(path), arrays, metadata=md2)
    with pytest.raises(SnapshotError, match="not a chatapp KV snapshot"):
        read_snapshot(path)
    arrays["tokens"] = mx.array(list(reversed(toks)), dtype=mx.int32)
    mx.save_safetensors(str(path), arrays, metadata=md)
    with pytest.raises(SnapshotError, match="damaged"):
        read_snapshot(path)


def test_failed_write_leaves_the_previous_snapshot_intact(tmp_path):
    path, caches, toks, settings = _saved(tmp_path)
    before = path.read_bytes()
    model = tiny_llama(layers=2)
    more = ids(30, seed=5)
    fill(model, caches, more, prefill=30)
    from chatapp.store.paths import snapshot_tmp_path

    blocker = snapshot_tmp_path(path)
    blocker.mkdir()  # the temporary file cannot be created: the write fails for real
    with pytest.raises(SnapshotWriteError):
        save(path, caches, toks + more, settings)
    assert path.read_bytes() == before and read_snapshot(path).tokens == toks
    blocker.rmdir()
    save(path, caches, toks + more, settings)
    assert read_snapshot(path).tokens == toks + more
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1.safetensors"]
