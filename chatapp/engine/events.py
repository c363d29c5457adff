"""Every event that crosses the engine thread, as plain dataclasses with no MLX in them: the one
home of what the engine thread tells a front end.

Producers sit in three layers: the engine (the worker, the session), the store (a system prompt
set, a model switched, which run on the engine thread) and the TUI's bridge (store notes, a
transcript resumed, an engine that cannot start). They all may import this module because it
sits in the lowest of those layers (engine <- store <- UI, tests/test_lint.py); it imports
nothing but the statistics dataclasses, so the UI, the CLI and the distributed job load it
without MLX (the BLAS preload must come first).

State changes carry the session description they produce (``info``: a :class:`SessionInfo` read on
the engine thread right after the change), so a front end never asks again with ``Describe``.
Adding an event: its dataclass here, its message in ``ui/messages.py`` and its handler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatapp.engine.stats import CacheView, MemoryGauges, TurnStats


@dataclass
class Switched:
    """A cache-mode switch (``Session.switch``): what it did, and, once it crosses the engine thread,
    the session it produced (``info``, set by the worker: the UI's figures come from it). One
    dataclass is the switch's report and its event; ``--no-tui``'s ``/mode`` and the auto policy
    read the report alone."""

    mode: str
    action: str  # "converted", "reprefilled", "stopped" (a cancel ended the re-prefill), "unchanged"
    reason: str
    seconds: float
    notes: list[str] = field(default_factory=list)
    info: SessionInfo | None = None  # the session in its new mode (None: not described)

    def line(self) -> str:
        verb = {"converted": "converted the live cache", "reprefilled": "re-prefilled the conversation",
                "stopped": "stopped re-prefilling", "unchanged": "nothing to do"}[self.action]
        extra = f"; {'; '.join(self.notes)}" if self.notes else ""
        return f"cache mode {self.mode}: {verb} in {self.seconds * 1000:.0f} ms ({self.reason}){extra}"


@dataclass
class Admission:
    """Whether a user message may be sent as it is (:meth:`Session.admit`), and what to tell the user."""

    send: bool
    refusal: str = ""  # why it is refused (one line)
    notes: list[str] = field(default_factory=list)


@dataclass
class CompareRow:
    mode: str
    context: int  # tokens in the cache when the last turn started
    prompt_tokens: int
    ttft: float
    prefill_tps: float
    decode_tps: float
    generated: int
    reply: str
    error: str = ""
    kv_held: int = 0  # KV bytes the mode holds after the turn (what the policy buys)
    kv_allocated: int = 0  # and its buffers' bytes
    route: str = ""  # "fused", or "mlx (why)" (engine/route.py)


@dataclass
class PrefillProgress:
    done: int
    total: int
    stats: TurnStats


@dataclass
class TokenEvent:
    text: str  # newly decoded text (may be "" while a multi-byte character or stop string is pending)
    token: int
    stats: TurnStats


@dataclass
class TurnDone:
    text: str  # the whole reply as kept in the conversation
    stats: TurnStats
    # The saved conversation the turn went into (a first turn creates it); set by the store's turn
    # driver, None when nothing is saved. The UI keeps its own copy from here rather than reading
    # the engine thread's chat object.
    conversation_id: int | None = None
    # Not "": the reply failed part-way (one line saying why; ``stats.finish`` is "error"). ``text``
    # is what was shown of it, which the conversation keeps as an interrupted reply. A Failed event
    # follows with the traceback; the TurnDone lets every front end end the turn all the same.
    error: str = ""

    @classmethod
    def failed(cls, error: BaseException, shown: str, stats: TurnStats | None,
               conversation_id: int | None = None) -> "TurnDone":
        """The TurnDone of a reply that raised part-way (every turn driver sends it before the
        exception goes on): ``shown``, the text streamed before it, the statistics so far."""
        stats = stats if stats is not None else TurnStats()
        stats.finish = "error"
        line = str(error).splitlines()[0] if str(error) else type(error).__name__
        return cls(shown, stats, conversation_id=conversation_id, error=line)


@dataclass
class Loaded:
    model_id: str
    notes: list[str]
    info: SessionInfo | None = None  # the session as loaded


@dataclass
class Failed:
    message: str  # one line for the user
    detail: str = ""  # traceback, for --verbose / logs
    info: SessionInfo | None = None  # the session after the failed request (it may have changed part-way)


@dataclass
class CompareResult:
    row: CompareRow
    done: bool = False


@dataclass
class Idle:
    pass


@dataclass
class LoadProgress:
    """What the loading screen shows. ``percent`` is None while the length is unknown."""

    phase: str  # "import", "load", "download", "kernels" (compiling on a first start), "session"
    detail: str = ""
    percent: float | None = None


@dataclass
class SessionInfo:
    """A plain description of the session, read on the engine thread after load and switches."""

    model_id: str
    mode: str  # the cache mode in use
    requested_mode: str  # what was asked for ("auto" included)
    cache: CacheView
    settings: dict[str, int | str] = field(default_factory=dict)  # as asked: window, sinks, kv_bits, ...
    effective: dict[str, int | str] = field(default_factory=dict)  # as used, after fitting to the model
    has_system: bool = False
    messages: int = 0
    fmt: str = ""  # the prompt format, and why it was chosen
    memory: MemoryGauges = field(default_factory=MemoryGauges)  # MLX's allocator when this was read


# ---- state changes made by the store on the engine thread -------------------------------------------
@dataclass
class SystemChange:
    """A system prompt set or removed (store/system_prompt.py)."""

    text: str
    changed: bool
    reprefill: int = 0  # conversation tokens the next turn prefills
    kept: int = 0  # leading tokens the old cache shared with the new conversation (the template's header)
    stored: int = 0  # of the new prompt, tokens the prefix store holds (a warm start)
    info: SessionInfo | None = None

    def line(self) -> str:
        if not self.changed:
            return "the system prompt is unchanged"
        what = "system prompt set" if self.text else "system prompt removed"
        if not self.reprefill:
            return f"{what}; it is prefilled with the first message"
        warm = f", {self.stored} of them from the prefix store" if self.stored else ""
        return (f"{what}: every later token attends to it, so the next turn prefills the conversation again "
                f"({self.reprefill} tokens{warm})")


@dataclass
class ModelSwitch:
    """The result of loading another model under the conversation (store/model_switch.py)."""

    spec: str
    ok: bool
    error: str = ""
    model_id: str = ""
    load_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    active_before: int = 0  # MLX active bytes before the switch (the old model loaded)
    notes: list[str] = field(default_factory=list)
    info: SessionInfo | None = None  # the new session (None when the switch failed: nothing changed)
    config: Any = None  # the configuration that loaded the new model (chatapp.config.Config)

    def line(self) -> str:
        if not self.ok:
            return self.error
        cost = (f"re-prefilled {self.prefill_tokens} tokens in {self.prefill_seconds:.2f} s"
                if self.prefill_tokens else "nothing to re-prefill")
        return f"switched to {self.model_id}: loaded in {self.load_seconds:.1f} s, {cost}"


@dataclass
class ModelReleased:
    """What freeing the old model gave back (MLX's active bytes before the switch and now)."""

    active_before: int
    active_after: int

    def line(self) -> str:
        mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
        return (f"old model released: MLX active memory {mib(self.active_before)} with it (before the switch), "
                f"{mib(self.active_after)} now")


# ---- the TUI bridge's own (emitted on the engine thread, or by the thread that starts it) -------------
@dataclass
class ChatNotes:
    """One-line notes and errors from the conversation store (``(level, text)``, level "note" or "error")."""

    notes: list[tuple[str, str]]


@dataclass
class TranscriptLoaded:
    """A saved conversation became the session's (sessions screen or ``--resume``)."""

    conversation_id: int
    title: str
    messages: list[tuple[str, str, bool]]  # (role, content, interrupted)
    from_snapshot: bool
    line: str  # how it was resumed: from the KV snapshot, or re-prefilled and why
    info: SessionInfo | None = None  # the session with the conversation in it


@dataclass
class ConversationChanged:
    """A saved conversation was renamed (``title``) or deleted (``deleted``)."""

    conversation_id: int
    title: str = ""
    deleted: bool = False
    current: bool = False  # it was the conversation on screen
    info: SessionInfo | None = None  # the session after deleting the current conversation (a new chat)


@dataclass
class StartupFailed:
    """The engine could not even be imported (e.g. MLX is missing); like ``Failed`` at load."""

    message: str
    detail: str = ""
