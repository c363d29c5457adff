"""Snapshot tests (pytest-textual-snapshot) of the main screen, the side panel and the mode dialog.

The content is deterministic: greedy decoding with a fixed seed on the real stories260K-4bit
model, and ``freeze_stats=True`` replaces wall-clock timings (and the machine's memory size)
with fixed functions of the token counts. Regenerate the baselines with
``pytest tests/test_ui_snapshots.py --snapshot-update`` and review the SVGs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from test_ui import make_app, ready, turn, wait_until  # noqa: E402

pytestmark = pytest.mark.shared


async def _settle(pilot) -> None:
    pilot.app.clear_notifications()  # toasts carry timings and expire on their own
    await pilot.pause()


def test_main_screen(snap_compare, stories4_path):
    app = make_app(stories4_path)

    async def run_before(pilot):
        await ready(pilot)
        await turn(pilot, "Tell me about a cat.")
        await turn(pilot, "What did the cat eat?")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_side_panel(snap_compare, stories4_path):
    app = make_app(stories4_path)

    async def run_before(pilot):
        await ready(pilot)
        await turn(pilot, "Tell me about a cat.")
        await pilot.press("f3")  # auto -> concat, so the mode table has two modes
        await wait_until(pilot, lambda: app.engine.info.requested_mode == "concat" and not app.engine.busy,
                         what="the switch")
        await turn(pilot, "What did the cat eat?")
        await pilot.press("f2")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=(110, 34), run_before=run_before)


def test_mode_dialog(snap_compare, stories4_path):
    app = make_app(stories4_path)

    async def run_before(pilot):
        await ready(pilot)
        await turn(pilot, "Tell me about a cat.")
        await _settle(pilot)  # the main screen's toasts, which the dialog would not cover all of
        await pilot.press("f4")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_side_panel_policies(snap_compare):
    """The side panel of a window-quant conversation that evicted and quantised: the policies
    section at its foot shows both tallies and the share of the last turn's attention."""
    from test_ui_markers import QUESTIONS, SMALL_WINDOW

    from tests.kvquant_folder import kvquant_model

    app = make_app(kvquant_model(), **SMALL_WINDOW)

    async def run_before(pilot):
        await ready(pilot)
        for q in QUESTIONS[:3]:
            await turn(pilot, q)
        await pilot.press("f2")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=(110, 48), run_before=run_before)
