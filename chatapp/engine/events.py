"""Everything that crosses the engine thread, as plain dataclasses with no MLX in them.

The UI, the CLI and the distributed job import these without loading MLX (the BLAS preload must
come first). Turn events (PrefillProgress, TokenEvent, TurnDone), worker events (Loaded, Failed,
Switched, CompareResult, Idle), results of the session (SwitchReport, CompareRow, SessionInfo,
Admission) and
the loading screen's LoadProgress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatapp.engine.stats import CacheView, MemoryGauges, TurnStats


@dataclass
class SwitchReport:
    mode: str
    action: str  # "converted", "reprefilled", "stopped" (a cancel ended the re-prefill), "unchanged"
    reason: str
    seconds: float
    notes: list[str] = field(default_factory=list)

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


@dataclass
class Loaded:
    model_id: str
    notes: list[str]


@dataclass
class Failed:
    message: str  # one line for the user
    detail: str = ""  # traceback, for --verbose / logs


@dataclass
class Switched:
    report: SwitchReport


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
    settings: dict[str, int] = field(default_factory=dict)  # as asked: window, sinks, kv_bits, ...
    effective: dict[str, int] = field(default_factory=dict)  # as used, after fitting to the model
    has_system: bool = False
    messages: int = 0
    fmt: str = ""  # the prompt format, and why it was chosen
    memory: MemoryGauges = field(default_factory=MemoryGauges)  # MLX's allocator when this was read
