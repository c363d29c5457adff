"""The shared-prefix KV store: hits on the common prefix of two conversations, misses on another
model, format or weights, survives a restart, prunes to its cap, refuses damaged blocks without
losing the conversation, and the reply after a warm start equals the cold one."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import CacheSettings
from chatapp.engine.generate import GenerationSettings, run_turn
from chatapp.engine.session import Session
from chatapp.prompt.conversation import Conversation
from chatapp.store import ChatStore
from chatapp.store import prefixes as px
from chatapp.store.chat import ModelIdentity, open_chat
from chatapp.store.paths import prefix_dir, snapshot_path
from tests.conftest import tiny_llama

GREEDY = GenerationSettings(temp=0.0, max_tokens=12)
# About 700 bytes: with the byte tokenizer, two full blocks of 256 tokens and a tail.
SYSTEM = ("You are a helpful assistant who answers questions about small animals in short, friendly sentences. "
          * 7).strip()
IDENT = ModelIdentity("tiny", "tiny", "fingerprint-a")
ROOMY = CacheSettings(window=1024, max_kv_tokens=2048, quant_start=1024)  # no mode quantises or evicts a prompt
SMALL = CacheSettings(sinks=4, window=48, evict_chunk=16, max_kv_tokens=96, quant_start=40)
MODES = ["concat", "prealloc", "quantized", "window", "window-quant", "scored", "scored-quant"]


def tokenizer():
    from chatapp.model.synthetic import byte_tokenizer

    return byte_tokenizer()


def session(mode="prealloc", system=SYSTEM, raw=False, cache_settings=ROOMY, model=None) -> Session:
    return Session(model or tiny_llama(layers=2), tokenizer(), generation=GREEDY, mode=mode, system=system,
                   raw=raw, cache_settings=cache_settings)


def first_prompt(s: Session, message: str) -> list[int]:
    conv = s.conversation.copy()
    conv.add("user", message)
    return s.format.tokens(conv)


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def store_first_turn(data_dir, s: Session | None = None, message="Tell me about a cat.", ident=IDENT):
    """One conversation's first turn, its prompt kept in the prefix store; returns its prompt tokens."""
    s = s or session()
    with open_chat(s, ident, data_dir, prefix_cap_mb=64) as chat:
        prompt = first_prompt(s, message)
        run_turn(chat.send(message))
        chat.after_turn()
    return prompt


def blocks(data_dir) -> list:
    return sorted(prefix_dir(data_dir).glob("*.safetensors"))


def warm_turn(data_dir, s: Session, message="Tell me about a dog.", ident=IDENT, **kw):
    chat = open_chat(s, ident, data_dir, prefix_cap_mb=64, **kw)
    done = run_turn(chat.send(message))
    return chat, done


# ---- hits, misses, restarts --------------------------------------------------------------------------
def test_two_conversations_reuse_exactly_their_common_prefix(tmp_path):
    a = store_first_turn(tmp_path)
    assert len(blocks(tmp_path)) == 3  # 2 full blocks and the tail of the first prompt
    s = session()
    b = first_prompt(s, "Tell me about a dog.")
    chat, done = warm_turn(tmp_path, s)
    st_ = done.stats
    # token-exact: the system prompt and "User: Tell me about a " (not only whole blocks)
    assert st_.prefix_tokens == common(a, b) > len(SYSTEM)
    assert st_.reused_tokens == st_.prefix_tokens and st_.prefill_tokens == st_.prompt_tokens - st_.prefix_tokens
    assert st_.prefix_line() == f"reused {st_.prefix_tokens} prefix tokens from the prefix store " \
                                f"({st_.prefix_seconds * 1000:.0f} ms)"
    assert chat.take_notes() == []
    chat.close()
    cold = session()
    expected = run_turn(cold.send("Tell me about a dog."))
    assert done.text == expected.text and s.cached == cold.cached


def test_the_same_prompt_reuses_all_but_its_last_token_and_after_ctrl_n(tmp_path):
    s = session()
    with open_chat(s, IDENT, tmp_path, prefix_cap_mb=64) as chat:
        first = run_turn(chat.send("Hello there"))
        assert first.stats.prefix_tokens == 0
        chat.after_turn()
        chat.new_chat()  # Ctrl+N
        again = run_turn(chat.send("Hello there"))
    assert again.stats.prefix_tokens == again.stats.prompt_tokens - 1  # the last token runs for the logits
    assert again.text == first.text


@pytest.mark.parametrize("mode", MODES)
def test_reply_after_a_warm_start_equals_the_cold_one_in_every_mode(mode, tmp_path):
    store_first_turn(tmp_path)  # stored from a prealloc conversation
    s = session(mode)
    chat, warm = warm_turn(tmp_path, s)
    chat.close()
    assert warm.stats.prefix_tokens > len(SYSTEM) and warm.stats.mode == mode
    cold = session(mode)
    expected = run_turn(cold.send("Tell me about a dog."))
    assert warm.text == expected.text and s.cached == cold.cached


def test_reply_after_a_warm_start_equals_the_cold_one_on_a_real_model(stories4_path, tmp_path):
    from chatapp.model.loader import load_model

    lm = load_model(str(stories4_path))
    ident = ModelIdentity.from_loaded(lm, str(stories4_path))
    system = "Lily and her dog Max went to the park to play with a red ball. " * 12

    def fresh():
        return Session(lm.model, lm.tokenizer, generation=GenerationSettings(temp=0.0, max_tokens=24), system=system)

    store_first_turn(tmp_path, fresh(), "Tell me about a cat.", ident)
    warm_session = fresh()
    chat, warm = warm_turn(tmp_path, warm_session, "Tell me about a dog.", ident)
    chat.close()
    cold_session = fresh()
    cold = run_turn(cold_session.send("Tell me about a dog."))
    assert warm.stats.prefix_tokens > 200 and cold.stats.prefix_tokens == 0
    assert warm.text == cold.text and warm_session.cached == cold_session.cached


def test_survives_a_restart(tmp_path):
    store_first_turn(tmp_path)
    # A new process: a new Session, a new store object on the same directory.
    chat, done = warm_turn(tmp_path, session())
    chat.close()
    assert done.stats.prefix_tokens > len(SYSTEM)


@pytest.mark.parametrize("change", ["weights", "model", "format"])
def test_misses_on_another_model_format_or_weights(change, tmp_path):
    store_first_turn(tmp_path)
    ident, s = IDENT, session()
    if change == "weights":
        ident = ModelIdentity("tiny", "tiny", "fingerprint-b")  # the same files, changed
    elif change == "model":  # other arguments (a longer context), the same weight files
        s = session(model=tiny_llama(layers=2, max_pos=8192))
    else:
        s = session(raw=True)
    chat, done = warm_turn(tmp_path, s, ident=ident)
    chat.close()
    assert done.stats.prefix_tokens == 0 and done.stats.reused_tokens == 0
    assert chat.take_notes() == []


def test_a_conversation_resumed_without_its_snapshot_starts_from_the_prefix_store(tmp_path):
    s = session()
    first = first_prompt(s, "Tell me about a cat.")
    with open_chat(s, IDENT, tmp_path, prefix_cap_mb=64) as chat:
        run_turn(chat.send("Tell me about a cat."))
        chat.after_turn()
        cid = chat.conversation_id
    snapshot_path(tmp_path, cid).unlink()
    with open_chat(session(), IDENT, tmp_path, prefix_cap_mb=64, resume=cid) as chat:
        assert chat.resume_info.source == "transcript"
        done = run_turn(chat.send("And then?"))
    assert done.stats.prefix_tokens == len(first)  # the whole first prompt; the rest is prefilled


def test_a_chat_that_does_not_save_reads_but_never_writes(tmp_path):
    store_first_turn(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in blocks(tmp_path)}
    s = session()
    chat, done = warm_turn(tmp_path, s, save=False)  # --no-save, or another chatapp holds the directory
    assert done.stats.prefix_tokens > len(SYSTEM)
    chat.after_turn()
    chat.new_chat()
    run_turn(chat.send("Something else entirely, longer than a block of tokens. " * 6))
    chat.after_turn()
    chat.close()
    assert {p.name: p.stat().st_mtime_ns for p in blocks(tmp_path)} == before  # nothing written or touched


# ---- what is stored ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["window", "scored"])
def test_a_lossy_cache_mode_stores_the_same_full_precision_blocks(mode, tmp_path):
    """window (or scored) with a small budget evicts the prompt while prefilling it: the store runs
    it again at full precision, so the blocks are those a prealloc conversation stores, byte for byte."""
    lossy, exact = tmp_path / mode, tmp_path / "prealloc"
    s = session(mode, cache_settings=SMALL)
    with open_chat(s, IDENT, lossy, prefix_cap_mb=64) as chat:
        run_turn(chat.send("Tell me about a cat."))
        assert s.caches[0].evicted > 0
        chat.after_turn()
        [note] = chat.take_notes()
    assert note.text.startswith("prefix store: stored ") and "run again at full precision" in note.text
    store_first_turn(exact)
    digest = {p.name: px.read_header(p)["data_sha256"] for p in blocks(exact)}
    assert {p.name: px.read_header(p)["data_sha256"] for p in blocks(lossy)} == digest


def test_the_system_prompt_alone_is_found_inside_the_first_prompt(tmp_path):
    s = session()
    store_first_turn(tmp_path, s)
    ns = px.namespace_for(s, IDENT.weights_fingerprint)
    alone = s.format.tokens(Conversation.start(SYSTEM), generation_prompt=False)
    store = px.PrefixStore(prefix_dir(tmp_path), 1 << 30)
    assert store.covered(ns, alone) == len(alone)


def test_write_failure_is_said_once_and_the_chat_goes_on(tmp_path):
    prefix_dir(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    prefix_dir(tmp_path).write_text("not a directory")
    s = session()
    with open_chat(s, IDENT, tmp_path, prefix_cap_mb=64) as chat:
        run_turn(chat.send("Tell me about a cat."))
        chat.after_turn()
        [note] = chat.take_notes()
        chat.new_chat()
        done = run_turn(chat.send("Tell me about a dog."))
        chat.after_turn()
        assert chat.take_notes() == []  # said once
    assert note.level == "error" and "could not write to the prefix store" in note.text
    assert done.text and done.stats.prefix_tokens == 0


# ---- damaged blocks -------------------------------------------------------------------------------------
def _damage(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[-7] ^= 0x5A
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 3]))
    elif how in ("foreign", "tampered"):
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        md = header["__metadata__"]
        if how == "foreign":
            md["format"] = "someone-else"
        else:
            tokens = json.loads(md["tokens"])
            md["tokens"] = json.dumps([(t + 1) % 256 for t in tokens])
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data[8 + n :]))


@pytest.mark.parametrize("how, which", [("corrupt", 0), ("truncated", 1), ("foreign", 1), ("tampered", 0)])
def test_a_damaged_block_is_skipped_removed_and_the_conversation_kept(how, which, tmp_path):
    store_first_turn(tmp_path)
    chain = sorted(blocks(tmp_path), key=lambda p: int(p.name.split("-")[0]))
    bad = chain[which]
    _damage(bad, how)
    s = session()
    chat, done = warm_turn(tmp_path, s)
    notes = chat.take_notes()
    assert len(notes) == 1 and notes[0].text.startswith(f"prefix store: skipped {bad.name} (")
    assert notes[0].text.endswith("; removed it: prefilling instead")
    assert not bad.exists()
    assert done.stats.prefix_tokens == px.BLOCK * which  # the prefix ends before the damaged block
    cold = session()
    assert done.text == run_turn(cold.send("Tell me about a dog.")).text
    cid = chat.conversation_id
    chat.after_turn()  # this conversation's first turn is stored again, damaged block included
    chat.close()
    with ChatStore.open(tmp_path, write=False) as store:
        assert [m.role for m in store.messages(cid)] == ["system", "user", "assistant"]
    assert bad.exists() and px.block_info(bad).hash == bad.name.split("-")[2].removesuffix(".safetensors")


# ---- the store on its own: bounds and exact matching -----------------------------------------------------
NS = px.Namespace("fp", "plain", "cfg", "float32", layers=2, kv_heads=1, head_dim=4)


def fake_kv(tokens: list[int]):
    """K/V whose every element encodes its token id and position, so slices can be checked."""
    ids = mx.array(tokens, dtype=mx.float32)[None, None, :, None]
    pos = mx.arange(len(tokens), dtype=mx.float32)[None, None, :, None]
    k = mx.broadcast_to(ids, (1, 1, len(tokens), 4)) + 0
    v = mx.broadcast_to(pos, (1, 1, len(tokens), 4)) + 0
    return [(k, v), (k * 2, v * 2)]


@pytest.fixture()
def small_blocks(monkeypatch):
    monkeypatch.setattr(px, "BLOCK", 4)
    monkeypatch.setattr(px, "MIN_REUSE", 1)


def test_prunes_to_its_cap_least_recently_used_first(small_blocks, tmp_path):
    store = px.PrefixStore(tmp_path, cap_bytes=1 << 30)
    shared = [7, 7, 7, 7]
    seqs = [shared + [i] * 8 for i in range(1, 6)]  # five prefixes sharing their first block
    for s in seqs:
        store.put(NS, s, fake_kv(s))
    sizes = {p: p.stat().st_size for p in tmp_path.iterdir()}
    assert len(sizes) == 1 + 2 * len(seqs)  # the shared block is stored once
    store.lookup(NS, seqs[0])  # the oldest prefix becomes the most recently used
    own = {p: size for p, size in sizes.items() if px.block_info(p).tokens[0] in (2, 3)}  # prefixes 2 and 3
    store.cap_bytes = sum(sizes.values()) - sum(own.values())  # room for all but two prefixes
    removed = store.prune()
    assert set(removed) == set(own)
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total <= store.cap_bytes and len(removed) == 4
    assert [store.covered(NS, s) for s in seqs] == [12, 4, 4, 12, 12]  # 2 and 3 went; the shared block stayed
    store.cap_bytes = 0
    store.prune()
    assert list(tmp_path.iterdir()) == []


def test_a_full_block_replaces_the_tails_it_contains(small_blocks, tmp_path):
    store = px.PrefixStore(tmp_path, cap_bytes=1 << 30)
    store.put(NS, [1, 2, 3, 4, 5, 6], fake_kv([1, 2, 3, 4, 5, 6]))
    assert len(list(tmp_path.iterdir())) == 2
    store.put(NS, [1, 2, 3, 4, 5], fake_kv([1, 2, 3, 4, 5]))  # contained in the stored tail: nothing new
    assert len(list(tmp_path.iterdir())) == 2
    store.put(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9], fake_kv([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    names = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert names == ["0", "4", "8"]  # the tail [5, 6] went: the full block [5, 6, 7, 8] holds it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stored=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=3),
       query=st.lists(st.integers(0, 2), min_size=1, max_size=14))
def test_lookup_finds_the_longest_common_prefix_token_exactly(small_blocks, tmp_path_factory, stored, query):
    store = px.PrefixStore(tmp_path_factory.mktemp("px"), cap_bytes=1 << 30)
    for s in stored:
        store.put(NS, s, fake_kv(s))
    best = max(common(s, query) for s in stored)
    assert store.covered(NS, query) == best
    kv, n, notes = store.lookup(NS, query)
    assert n == best and notes == []
    if best:
        expected = fake_kv(query[:best])
        for (k, v), (ek, ev) in zip(kv, expected):
            assert mx.array_equal(k, ek).item() and mx.array_equal(v, ev).item()
    else:
        assert kv is None
    assert store.covered(px.Namespace("other", "plain", "cfg", "float32", 2, 1, 4), query) == 0


def test_orphaned_blocks_are_pruned_first(small_blocks, tmp_path):
    store = px.PrefixStore(tmp_path, cap_bytes=1 << 30)
    b = [3, 3, 3, 3]
    store.put(NS, b, fake_kv(b))
    a = [1, 1, 1, 1, 2, 2, 2, 2]
    store.put(NS, a, fake_kv(a))
    first = next(p for p in tmp_path.iterdir() if px.block_info(p).tokens == [1, 1, 1, 1])
    first.unlink()  # its child can no longer be reached, though it is the most recently used block
    store.cap_bytes = sum(p.stat().st_size for p in tmp_path.iterdir()) - 1
    [removed] = store.prune()
    assert removed.name.startswith("4-")  # the orphan, not the least recently used block
    assert store.covered(NS, b) == 4


def test_blocks_survive_a_new_store_object_and_carry_their_metadata(small_blocks, tmp_path):
    px.PrefixStore(tmp_path, cap_bytes=1 << 30).put(NS, [5, 6, 7, 8, 9], fake_kv([5, 6, 7, 8, 9]))
    again = px.PrefixStore(tmp_path, cap_bytes=1 << 30, writable=False)
    infos = [b for b in again.blocks() if isinstance(b, px.BlockInfo)]
    assert sorted(b.tokens for b in infos) == [[5, 6, 7, 8], [9]]
    [prefix] = px.stored_prefixes(infos)
    assert (prefix.tokens, prefix.blocks, prefix.complete) == (5, 2, True)
    assert os.path.getsize(infos[0].path) == infos[0].size
