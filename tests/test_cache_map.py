"""The per-message cache map (engine/cache_map.py): arithmetic on token spans, checked against
the real caches of a session in every mode, and the first-eviction notice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.engine.cache_map import CacheLayout, MessageCache, eviction_notice, message_map, message_starts


def test_window_quant_layout_by_hand():
    # sinks 4 | evicted 10 | quantised 20 | recent 16 : 50 tokens; messages start at 0, 8, 30, 40
    layout = CacheLayout(tokens=50, sinks=4, evicted=10, quant=20, quant_bits=8)
    rows = message_map(layout, [0, 8, 30, 40])
    assert [(m.full, m.quant, m.evicted) for m in rows] == [(4, 0, 4), (0, 16, 6), (6, 4, 0), (10, 0, 0)]
    assert [m.state for m in rows] == ["partly evicted", "partly evicted", "quantised", "held"]
    assert [m.text() for m in rows] == ["kv 4/8 tok evicted", "kv 6/22 tok evicted", "kv 8-bit 4/10 tok",
                                        "kv held"]


def test_pending_restored_and_scored():
    rows = message_map(CacheLayout(tokens=10, restored=6), [0, 6, 10], end=14)
    assert [m.state for m in rows] == ["restored", "held", "pending"]
    assert rows[2].text() == "kv not yet prefilled" and rows[2].pending == 4
    # scored: 6 of the 20 middle tokens [4, 24) evicted, somewhere: each message gets its share
    rows = message_map(CacheLayout(tokens=40, sinks=4, evicted=6, scattered_end=24), [0, 14, 24])
    assert [m.evicted for m in rows] == [3, 3, 0] and rows[0].approximate and rows[0].text().startswith("kv ~3/")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_token_is_counted_once(data):
    tokens = data.draw(st.integers(0, 300))
    sinks = data.draw(st.integers(0, min(8, tokens)))
    evicted = data.draw(st.integers(0, tokens - sinks))
    quant = data.draw(st.integers(0, tokens - sinks - evicted))
    restored = data.draw(st.integers(0, tokens))
    cuts = sorted(data.draw(st.lists(st.integers(1, tokens + 20), max_size=8, unique=True)))
    starts = [0] + cuts
    end = max(tokens, starts[-1]) + data.draw(st.integers(0, 10))
    layout = CacheLayout(tokens=tokens, sinks=sinks, evicted=evicted, quant=quant, quant_bits=4, restored=restored)
    rows = message_map(layout, starts, end=end)
    for m in rows:
        assert m.full + m.quant + m.evicted + m.pending == m.tokens
        assert 0 <= m.restored <= m.full + m.quant
    assert sum(m.evicted for m in rows) == evicted
    assert sum(m.quant for m in rows) == quant
    assert sum(m.full for m in rows) == tokens - evicted - quant
    assert sum(m.pending for m in rows) == end - tokens


def test_eviction_notice_names_the_turns():
    def row(i, evicted, n=10):
        return MessageCache(index=i, start=10 * i, end=10 * i + n, full=n - evicted, evicted=evicted)

    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    assert eviction_notice([row(i, 0) for i in range(6)], roles, 50) == ""
    rows = [row(0, 0), row(1, 10), row(2, 10), row(3, 10), row(4, 4), row(5, 0)]
    assert eviction_notice(rows, roles, 1234) == (
        "turns 1-2 are now outside the window (turn 2 partly); the system prompt and the last 1,234 tokens are kept")
    rows = [row(0, 3), row(1, 10), row(2, 10), row(3, 0), row(4, 0), row(5, 0)]
    assert eviction_notice(rows, roles, 9) == (
        "turn 1 is now outside the window; the first tokens (attention sinks) and the last 9 tokens are kept")


def test_message_starts_rerender_only_what_changed():
    class M:
        def __init__(self, role, content):
            self.role, self.content = role, content

    class Owner:
        pass

    calls = []
    owner, msgs = Owner(), [M("user", "a"), M("assistant", "bb")]
    assert message_starts(owner, msgs, lambda i: calls.append(i) or 5 * i) == [0, 5]
    msgs += [M("user", "c")]
    assert message_starts(owner, msgs, lambda i: calls.append(i) or 5 * i) == [0, 5, 10]
    msgs[1].content = "changed"
    assert message_starts(owner, msgs, lambda i: calls.append(i) or 7 * i) == [0, 7, 14]
    assert calls == [1, 2, 1, 2]


@pytest.mark.parametrize("mode", ["prealloc", "quantized", "window", "window-quant", "scored"])
def test_map_matches_the_real_caches(mode):
    """On a real session, the map's totals are the caches' own counts, and the spans cover the conversation."""
    from cache import CacheSettings
    from chatapp.engine.generate import GenerationSettings
    from chatapp.engine.session import Session
    from chatapp.model.synthetic import byte_tokenizer
    from tests.conftest import tiny_llama

    settings = CacheSettings(sinks=4, window=32, evict_chunk=16, max_kv_tokens=80, quant_start=32)
    s = Session(tiny_llama(layers=2), byte_tokenizer(), generation=GenerationSettings(temp=0.0, max_tokens=12),
                mode=mode, cache_settings=settings, system="be brief")
    for q in ["hello there, model", "another line of text", "and a third one", "four"]:
        for _ in s.send(q):
            pass
    view = s.cache_view()
    rows = view.messages
    assert len(rows) == len(s.conversation.messages) and rows[0].start == 0
    assert all(a.end == b.start for a, b in zip(rows, rows[1:]))
    assert sum(m.evicted for m in rows) == view.evicted
    assert sum(m.full + m.quant for m in rows) == view.tokens
    assert sum(m.quant for m in rows) == view.quant_tokens
    if mode in ("window", "window-quant", "scored"):
        assert view.evicted and any(m.state in ("evicted", "partly evicted") for m in rows)
        assert rows[-1].state in ("held", "quantised")
    if mode == "quantized":
        assert any(m.state == "quantised" for m in rows)
    if mode == "prealloc":
        assert {m.state for m in rows} == {"held"}
    s.new_chat()
    assert [m.state for m in s.cache_view().messages] == ["pending"]  # the system prompt, not yet prefilled
