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
from dataclasses import dataclass, field

from .chat import MiB, ModelIdentity, PersistentChat


@dataclass
class ModelSwitch:
    spec: str
    ok: bool
    error: str = ""
    model_id: str = ""
    load_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    active_before: int = 0  # MLX active bytes before the switch (the old model loaded)
    active_after: int = 0  # after the old model was released (release_line, once nothing holds it)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        if not self.ok:
            return self.error
        cost = (f"re-prefilled {self.prefill_tokens} tokens in {self.prefill_seconds:.2f} s"
                if self.prefill_tokens else "nothing to re-prefill")
        return f"switched to {self.model_id}: loaded in {self.load_seconds:.1f} s, {cost}"

    def release_line(self) -> str:
        mib = lambda n: f"{n / MiB:.1f} MiB"  # noqa: E731
        return (f"old model released: MLX active memory {mib(self.active_before)} with it (before the switch), "
                f"{mib(self.active_after)} now")


def release_old_model(result: ModelSwitch) -> ModelSwitch:
    """Free the old model's memory; call it from a later engine command than the switch (the
    command that switched still holds the old session in its frame)."""
    from chatapp.engine.model_switch import release_memory

    result.active_after = release_memory()
    return result


def switch_model(config, chat: PersistentChat, spec: str, worker) -> tuple[ModelSwitch, PersistentChat, object]:
    """Load ``spec`` (a folder, a repo id or a GGUF file) and move ``chat``'s conversation onto it.

    Returns (result, the chat to use from now on, the config that loaded it). On failure the
    old chat and config come back unchanged. ``worker`` (the engine worker) gets the new session."""
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
        loaded = load_engine(new_config)
        session = session_from_config(new_config, loaded)
    except Exception as e:  # noqa: BLE001 - any failure to load: one line, the old model stays
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        result.error = f"cannot load {spec}: {text}"
        return result, chat, config
    result.load_seconds = time.perf_counter() - t0
    old = chat.session
    chat.save_snapshot()  # the old model's snapshot stays valid for that model
    session.prefix_source = None
    result.prefill_tokens, result.prefill_seconds = adopt_conversation(session, old)
    identity = ModelIdentity.from_loaded(loaded, spec)
    new_chat = PersistentChat(session, identity, chat.store, snapshot_cap_mb=chat.cap_bytes // MiB,
                              prefixes=chat.prefixes)
    new_chat.conversation_id, new_chat._mirror = chat.conversation_id, list(chat._mirror)
    if chat.conversation_id is not None and new_chat.saving:
        new_chat._write(lambda: chat.store.set_model(
            chat.conversation_id, model_id=identity.model_id, model_spec=identity.model_spec,
            weights_fingerprint=identity.weights_fingerprint, prompt_format=session.format.key))
    result.model_id = getattr(session, "model_id", spec) or spec
    result.notes = list(session.notices)
    worker.session = session
    chat.session = None  # the old session (and through it the old model) is referenced nowhere now
    del old, loaded
    result.ok = True
    return result, new_chat, new_config


__all__ = ["ModelSwitch", "release_old_model", "switch_model"]
