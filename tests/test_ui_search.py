"""The search box of the sessions screen (F7, then /): results as you type; Enter opens one.

A pilot test on the real stories260K-4bit model (skipped without ../shared)."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from test_ui import async_test, make_config, ready, screen_text, wait_until  # noqa: E402

from chatapp.store import ChatStore  # noqa: E402
from chatapp.ui.app import ChatApp  # noqa: E402
from chatapp.ui.screens import SessionsScreen  # noqa: E402
from chatapp.ui.search_screen import SearchScreen  # noqa: E402

pytestmark = pytest.mark.shared


@async_test
async def test_search_box_finds_and_opens_a_conversation(stories4_path, tmp_path):
    with ChatStore.open(tmp_path) as store:
        a = store.create_conversation(title="Fish", model_id="stories")
        store.replace_messages(a, 0, [("user", "Tell me about a fish.", "complete"),
                                      ("assistant", "The fish swam\nto the blue sea.", "complete")])
        b = store.create_conversation(title="Dogs", model_id="stories")
        store.replace_messages(b, 0, [("user", "Tell me about a dog.", "complete")])
    app = ChatApp(make_config(stories4_path, **{"data.dir": str(tmp_path)}), freeze_stats=True)
    async with app.run_test(size=(100, 30)) as pilot:
        await ready(pilot)
        await pilot.press("f7")
        assert isinstance(app.screen, SessionsScreen)
        await pilot.press("slash")
        screen = app.screen
        assert isinstance(screen, SearchScreen)
        await pilot.press(*"blue se")  # every word, the last one as a prefix
        assert [(h.conversation_id, h.seq) for h in screen.hits] == [(a, 1)]
        text = await screen_text(pilot)
        assert "Fish" in text and "to the blue sea." in text and "1 match" in text
        await pilot.press(*" zebra")
        assert screen.hits == [] and "no saved message holds" in await screen_text(pilot)
        for _ in range(6):
            await pilot.press("backspace")
        await pilot.press("ctrl+u")  # clear the box: FTS syntax characters are searched as text
        await pilot.press(*'"AND(*')
        assert screen.hits == [] and "no saved message holds" in await screen_text(pilot)
        await pilot.press("ctrl+u")
        await pilot.press(*"tell")
        assert {h.conversation_id for h in screen.hits} == {a, b}
        await pilot.press("ctrl+u")
        await pilot.press(*"fish")
        await pilot.press("enter")  # to the results
        await pilot.press("enter")  # open the first
        await wait_until(pilot, lambda: app.engine.conversation_id == a and not app.engine.busy,
                         what="the conversation to open")
        assert not isinstance(app.screen, (SearchScreen, SessionsScreen))
        assert [e.role for e in app.transcript.entries] == ["user", "assistant"]
        assert app.transcript.entries[1].text == "The fish swam\nto the blue sea."
