"""Cache markers on the transcript (ui/markers.py): each message shows what the KV cache holds of
it, updated after every turn and mode switch; one notice when the policy first evicts; the legend
in the help screen; and a snapshot of one screen with held, quantised and evicted markers.

The model is a random-weight Llama with head_dim 32 and stories260K's tokenizer
(tests/kvquant_folder.py), in window-quant mode with a small window, so a few turns quantise and
evict. Skipped without ../shared."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from test_ui import (  # noqa: E402
    async_test,  # noqa: E402
    make_app,
    ready,
    screen_text,
    turn,
    wait_until,
)

from chatapp.ui.markers import CacheNotice  # noqa: E402
from chatapp.ui.screens import HelpScreen  # noqa: E402
from tests.kvquant_folder import kvquant_model  # noqa: E402

pytestmark = pytest.mark.shared

SMALL_WINDOW = {"cache.mode": "window-quant", "cache.window": 32, "cache.sinks": 4, "cache.max_kv_tokens": 96,
                "cache.evict_chunk": 16, "cache.kv_group_size": 32, "chat.system": "You are a storyteller."}
QUESTIONS = ["Tell me about a cat.", "What did the cat eat?", "Where did it go?", "Who was its friend?"]


def states(app) -> list[str]:
    return [e.widget.cache_state for e in app.transcript.entries]


@async_test
async def test_markers_follow_the_cache_and_the_first_eviction_is_noted_once():
    app = make_app(kvquant_model(), **SMALL_WINDOW)
    async with app.run_test(size=(100, 40)) as pilot:
        await ready(pilot)
        assert states(app) == ["pending"]  # the system prompt: not prefilled before the first turn
        await turn(pilot, QUESTIONS[0])
        assert set(states(app)) <= {"held", "quantised"} and not list(app.query(CacheNotice))
        for q in QUESTIONS[1:]:
            await turn(pilot, q)
        rows = app.engine.cache_view.messages
        assert [m.state for m in rows] == states(app)
        assert {"evicted", "quantised", "held"} <= set(states(app)) and states(app)[-1] == "held"
        for entry, row in zip(app.transcript.entries, rows):
            w = entry.widget
            assert w.has_class("kv-" + row.state.replace(" ", "-"))
            if row.state != "evicted":  # the text form is in the header (evicted ones say EVICTED_TAG)
                assert row.text() in w.tags
        text = await screen_text(pilot)
        assert "kv 8-bit" in text and "kv held" in text
        [notice] = app.query(CacheNotice)
        assert "outside the window" in str(notice.render()) and "tokens are kept" in str(notice.render())
        await turn(pilot, "And then?")
        assert len(app.query(CacheNotice)) == 1  # once per conversation

        # A switch to prealloc re-prefills every token: every marker turns to held.
        app.action_cache_mode("prealloc")
        await wait_until(pilot, lambda: not app.engine.busy and app.engine.info.mode == "prealloc", what="the switch")
        assert set(states(app)) == {"held"}

        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        app.screen.query_one("#help-box").scroll_end(animate=False)  # the legend is below the keys
        await pilot.pause()
        help_text = await screen_text(pilot)
        assert "Cache markers" in help_text and "partly evicted" in help_text and "not yet prefilled" in help_text


def test_markers_snapshot(snap_compare):
    pytest.importorskip("pytest_textual_snapshot")
    app = make_app(kvquant_model(), **SMALL_WINDOW)

    async def run_before(pilot):
        await ready(pilot)
        for q in QUESTIONS[:3]:
            await turn(pilot, q)
        pilot.app.clear_notifications()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(100, 48), run_before=run_before)


@async_test
async def test_a_resumed_conversation_is_marked_restored(stories4_path, tmp_path):
    from test_ui import make_config

    from chatapp.ui.app import ChatApp

    config = make_config(stories4_path, **{"data.dir": str(tmp_path)})
    first = ChatApp(config, freeze_stats=True)
    async with first.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await turn(pilot, "Once upon a time")
        assert states(first) == ["held", "held"]
        await pilot.press("ctrl+q")
    first.engine.bridge.worker.join(30)
    app = ChatApp(config, freeze_stats=True, resume="latest")
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await wait_until(pilot, lambda: len(app.transcript.entries) == 2 and not app.engine.busy, what="the resume")
        await wait_until(pilot, lambda: states(app) == ["restored", "restored"], what="the markers")
        assert "kv restored" in await screen_text(pilot)
        await turn(pilot, "The cat")
        assert states(app) == ["restored", "restored", "held", "held"]


@async_test
async def test_side_panel_shows_what_each_policy_evicted_and_quantised_and_the_attention_share():
    from chatapp.ui.widgets import SidePanel

    app = make_app(kvquant_model(), **SMALL_WINDOW)
    async with app.run_test(size=(110, 48)) as pilot:
        await ready(pilot)
        for q in QUESTIONS[:3]:
            await turn(pilot, q)
        await pilot.press("f2")
        await pilot.pause()
        view = app.engine.cache_view
        assert view.evicted_by_policy["window-quant"] == view.evicted > 0
        assert view.quantised_by_policy["window-quant"] > 0
        assert view.attention_sparsity is not None and 0 <= view.attention_sparsity <= 1
        text = str(app.query_one(SidePanel).query_one("#policies").render())
        row = next(line for line in text.splitlines() if line.startswith("window-quant"))
        assert row.split() == ["window-quant", f"{view.evicted:,}", f"{view.quantised_by_policy['window-quant']:,}"]
        assert f"attn on evictable {view.attention_sparsity:.0%} of the last turn's" in text
