"""Switch the model under a saved conversation (the TUI's switch-model dialog); engine thread.

The new model loads while the old one stays in use: a model that does not load leaves
everything as it was (the error is one line). Once it loads, the conversation is copied onto
a session of the new model and prefilled (engine/model_switch.py), the stored conversation
records the new model (so resuming it loads that one), and the old session is dropped and its
memory released by the next engine command (:func:`release_old_model`); the results say what the
switch cost and what was freed.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

from chatapp.engine.events import ModelReleased, ModelSwitch

from .chat import ModelIdentity, PersistentChat


def release_old_model(active_before: int) -> ModelReleased:
    """Free the old model's memory; call it from a later engine request than the switch (the
    request that switched still holds the old session in its frame)."""
    from chatapp.engine.model_switch import release_memory

    return ModelReleased(active_before, release_memory())


def switch_model(config, chat: PersistentChat, spec: str, on_slow_warm_up: Callable[[str], None] | None = None,
                 cancel=None) -> tuple[ModelSwitch, PersistentChat, object]:
    """Load ``spec`` (a folder, a repo id or a GGUF file) and move ``chat``'s conversation onto it.

    Returns (result, the chat to use from now on, the config that loaded it). On failure the
    old chat and config come back unchanged. ``on_slow_warm_up``: as load_engine's (the new
    model's kernels may compile: other bits, group size or K/V dtype than the old one's). ``cancel``:
    the cancel flag the new session is built on (the engine worker's, as the old session's was)."""
    from chatapp.engine.model_switch import active_memory, adopt_conversation
    from chatapp.engine.setup import load_engine, session_from_config

    spec = spec.strip()
    result = ModelSwitch(spec, False)
    if not spec:
        result.error = "give a model: a local folder, a Hugging Face repo id or a .gguf file"
        return result, chat, config
    new_config = copy.deepcopy(config)
    new_config.model.id = spec
    result.active_before = active_memory()
    t0 = time.perf_counter()
    try:
        loaded = load_engine(new_config, on_slow_warm_up=on_slow_warm_up)
        session = session_from_config(new_config, loaded, cancel=cancel)
    except Exception as e:  # noqa: BLE001 - any failure to load: one line, the old model stays
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        result.error = f"cannot load {spec}: {text}"
        return result, chat, config
    result.load_seconds = time.perf_counter() - t0
    result.prefill_tokens, result.prefill_seconds = adopt_conversation(session, chat.session)
    new_chat = chat.moved_to(session, ModelIdentity.from_loaded(loaded, spec))
    result.model_id = session.model_id or spec
    result.notes = list(session.notices)
    del loaded
    result.ok = True
    return result, new_chat, new_config


__all__ = ["ModelReleased", "ModelSwitch", "release_old_model", "switch_model"]
