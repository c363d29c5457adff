"""A chat session that is saved as it goes, and resumed from its KV snapshot.

:class:`PersistentChat` wraps an engine :class:`~chatapp.engine.session.Session`:

* every message is committed to the transcript store as soon as it is complete (the user's
  message when it is sent, the reply when it ends);
* while a reply streams, what has been shown so far is written as an ``in_progress`` row every
  :data:`PARTIAL_SECONDS` seconds or :data:`PARTIAL_TOKENS` tokens; when the reply ends the row
  becomes ``complete`` or ``interrupted`` (cancelled); a row still ``in_progress`` when the
  store is next opened was cut off by a kill or crash and is marked ``interrupted`` then;
* :meth:`PersistentChat.save_snapshot` (after a turn, when idle, and on :meth:`close`) writes
  the session's KV caches to a snapshot; :meth:`PersistentChat.resume` reads the transcript and
  restores the caches from the snapshot when it fits, else lets the next turn re-prefill the
  transcript, saying why (both in :mod:`chatapp.store.resume`);
* a failing write (disk full, read-only file system, ...) is reported once as a
  :class:`Note` and the chat goes on in memory; nothing committed before is touched.

Everything runs on the thread that drives the session (MLX work included).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from chatapp.engine.events import TokenEvent, TurnDone
from chatapp.engine.requests import EditLast, Regenerate, Send
from chatapp.prompt.conversation import Conversation, common_prefix

from .db import ChatStore, StoreError, describe_sqlite_error
from .lock import StoreBusy
from .paths import prefix_dir
from .resume import MiB, ResumeInfo, SnapshotResume, transcript_hash
from .textio import clean_text, is_blank

PARTIAL_SECONDS = 0.5
PARTIAL_TOKENS = 64


@dataclass
class Note:
    """A one-line message for the user: ``level`` is "note" or "error"."""

    level: str
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class ModelIdentity:
    """Which model a conversation and its snapshots belong to."""

    model_id: str
    model_spec: str  # what to load to continue: a local folder's absolute path, or the repo id
    weights_fingerprint: str

    @classmethod
    def from_loaded(cls, loaded, spec: str | None = None) -> "ModelIdentity":
        """From a :class:`~chatapp.model.loader.LoadedModel` and what the user asked to load."""
        spec = spec if spec is not None else loaded.model_id
        local = Path(spec).expanduser()
        model_spec = str(local.resolve()) if local.is_dir() else spec
        return cls(loaded.model_id, model_spec, loaded.weights_fingerprint)


@dataclass
class Prepared:
    """A message checked before sending (see :meth:`PersistentChat.prepare`)."""

    text: str  # the text as it will be sent and stored
    send: bool  # False: blank (ignored) or refused
    refusal: str = ""  # why it is refused (one line); "" for a blank message
    notes: list[str] = field(default_factory=list)


@dataclass
class TurnResult:
    """How :meth:`PersistentChat.turn` ended: the reply's TurnDone, or why the message was refused."""

    done: TurnDone | None = None
    refusal: str = ""  # not "": the message was not sent, and this says why (one line)


@dataclass
class _Turn:
    seq: int  # index the reply will take in the conversation
    text: str = ""
    tokens: int = 0
    written: bool = False
    tokens_at_write: int = 0
    time_at_write: float = 0.0


class PersistentChat(SnapshotResume):
    """A :class:`Session` whose conversation is stored as it goes; see the module docstring.

    ``store`` is None (nothing saved) or a :class:`ChatStore`; one opened read-only can be
    resumed from but nothing is written to it.
    """

    def __init__(self, session, identity: ModelIdentity, store: ChatStore | None = None, *,
                 snapshot_cap_mb: int = 2048, prefixes=None):
        self.session = session
        self.identity = identity
        self.store = store
        self.cap_bytes = int(snapshot_cap_mb) * MiB
        self.conversation_id: int | None = None
        self.resume_info: ResumeInfo | None = None
        self._notes: list[Note] = []
        self._mirror: list[tuple[str, str, str]] = []  # what the store holds for this conversation
        self._failed = False
        self._snapshot_failed = False
        self._cap_noted = False
        self._snapshot_key: tuple | None = None  # what the last snapshot written (or restored) holds
        self._turn: _Turn | None = None
        self.prefixes = prefixes  # the shared-prefix KV store (chatapp.store.prefixes.PrefixStore), or None
        self._prefix_failed = False
        self._prefixes_seen: set[str] = set()  # token hashes already stored or found stored in this run
        if prefixes is not None:
            from .prefixes import StoreSource, namespace_for

            self.namespace = namespace_for(session, identity.weights_fingerprint, identity.model_id)
            prefixes.writable = self.saving  # only the lock holder writes, touches and removes blocks
            session.attach_prefixes(StoreSource(prefixes, self.namespace, lambda text: self._note("note", text)))

    def moved_to(self, session, identity: ModelIdentity) -> "PersistentChat":
        """The same conversation continued on ``session`` (another model's, already holding it):
        the stored conversation records the new model, so resuming it loads that one. This chat
        saves its snapshot (still valid for its own model) and lets go of its session."""
        self.save_snapshot()
        new = PersistentChat(session, identity, self.store, snapshot_cap_mb=self.cap_bytes // MiB,
                             prefixes=self.prefixes)
        new.conversation_id, new._mirror = self.conversation_id, list(self._mirror)
        if self.conversation_id is not None and new.saving:
            new._write(lambda: self.store.set_model(
                self.conversation_id, model_id=identity.model_id, model_spec=identity.model_spec,
                weights_fingerprint=identity.weights_fingerprint, prompt_format=session.format.key))
        self.session = None  # nothing here references the old model any more
        return new

    # ---- state ----------------------------------------------------------------------------------
    @property
    def saving(self) -> bool:
        """True while messages are being written (a writable store that has not failed)."""
        return self.store is not None and self.store.writable and not self.store.closed and not self._failed

    def take_notes(self) -> list[Note]:
        """The messages for the user since the last call (each shown once)."""
        notes, self._notes = self._notes, []
        return notes

    def _note(self, level: str, text: str) -> None:
        self._notes.append(Note(level, text))

    # ---- sending --------------------------------------------------------------------------------
    def prepare(self, text: str) -> Prepared:
        """Check a message before sending: blank ones are ignored; the rest go through the
        session's admission policy (:meth:`~chatapp.engine.session.Session.admit`: past the
        trained context, longer than an evicting cache keeps)."""
        text = clean_text(text)
        if is_blank(text):
            return Prepared(text, False)
        admission = self.session.admit(text)
        return Prepared(text, admission.send, admission.refusal, admission.notes)

    def turn(self, request, emit: Callable[[object], None], notes: Callable[[list[Note]], None], *,
             admit: bool = True, started: Callable[[], None] | None = None) -> TurnResult:
        """One turn, as every front end runs it (the TUI's engine worker, ``--no-tui``, a
        distributed run): ``request`` is a :class:`~chatapp.engine.requests.Send`,
        ``Regenerate`` or ``EditLast``.

        A message is first admitted (:meth:`prepare`; ``admit=False`` sends it as it is); the
        reply's events go to ``emit`` as they come, each message saved; once the reply is over
        the idle work runs (:meth:`after_turn`: the snapshot, the prefix store). A reply that
        raises part-way still ends with a TurnDone, its ``error`` set, before the exception goes
        on to the caller. The store's notes go to ``notes`` after the admission, after the reply
        (also when it fails) and after the idle work. ``started()`` runs once the message is
        admitted, as the reply begins.
        """
        match request:
            case Send(text):
                if admit:
                    prepared = self.prepare(text)
                    if prepared.notes:
                        notes([Note("note", n) for n in prepared.notes] + self.take_notes())
                    if not prepared.send:
                        return TurnResult(refusal=prepared.refusal or "an empty message is not sent")
                    text = prepared.text
                events = self.send(text)
            case Regenerate():
                events = self.regenerate()
            case EditLast(text):
                events = self.edit_last(text)
            case _:
                raise ValueError(f"{request!r} is not a turn")
        if started is not None:
            started()
        done, shown, stats = None, "", None
        try:
            for ev in events:
                if isinstance(ev, TurnDone):
                    done = ev
                elif isinstance(ev, TokenEvent):
                    shown += ev.text
                stats = getattr(ev, "stats", stats)
                emit(ev)
        except Exception as e:
            if done is None:  # the reply failed part-way: the turn still ends, marked failed
                emit(TurnDone.failed(e, shown, stats, self.conversation_id))
            raise
        finally:
            notes(self.take_notes())
        self.after_turn()  # the turn is over, the caches idle: the snapshot, then the prefix store
        notes(self.take_notes())
        return TurnResult(done)

    def send(self, text: str) -> Iterator:
        """Add a user message and stream the reply (the session's events), saving both."""
        text = clean_text(text)
        if is_blank(text):
            raise ValueError("an empty message is not sent")
        self._close_open_turn()
        events = self.session.send(text)
        self._sync()
        return self._record(events)

    def regenerate(self) -> Iterator:
        self._close_open_turn()
        events = self.session.regenerate()
        self._sync()
        return self._record(events)

    def edit_last(self, text: str) -> Iterator:
        self._close_open_turn()
        events = self.session.edit_last(clean_text(text))
        self._sync()
        return self._record(events)

    def new_chat(self) -> None:
        """Start a new conversation (the current one is kept, with its snapshot)."""
        self._close_open_turn()
        self.save_snapshot()
        self.session.new_chat()
        self.conversation_id = None
        self._mirror = []
        self._snapshot_key = None
        self.resume_info = None

    def commit(self) -> None:
        """Save the session's conversation as it stands (after the caller changed
        ``session.conversation`` directly, e.g. to load or edit a history)."""
        self._sync()

    def rename(self, title: str) -> None:
        """Rename the current conversation (it must have been saved)."""
        if self.conversation_id is None or not self.saving:
            raise StoreError("this conversation is not saved")
        if is_blank(clean_text(title)):
            raise StoreError("the new name is empty")
        self._write(lambda: self.store.rename(self.conversation_id, title))

    def _record(self, events) -> Iterator:
        turn = _Turn(seq=len(self.session.conversation.messages))
        self._turn = turn
        try:
            for ev in events:
                if isinstance(ev, TokenEvent):
                    turn.tokens += 1
                    if ev.text:
                        turn.text += ev.text
                        now = time.monotonic()
                        if (not turn.written or turn.tokens - turn.tokens_at_write >= PARTIAL_TOKENS
                                or now - turn.time_at_write >= PARTIAL_SECONDS):
                            self._write_partial(turn, now)
                elif isinstance(ev, TurnDone):
                    self._end_turn(turn, finished=True)
                    ev.conversation_id = self.conversation_id  # a first turn's sync just created it
                yield ev
        finally:
            if self._turn is turn:
                self._end_turn(turn, finished=False)

    def _close_open_turn(self) -> None:
        """A reply the caller stopped reading without closing it ends here, as interrupted."""
        if self._turn is not None:
            self._end_turn(self._turn, finished=False)

    def _write_partial(self, turn: _Turn, now: float) -> None:
        turn.tokens_at_write, turn.time_at_write = turn.tokens, now
        if self._ensure_conversation() and self._write(
                lambda: self.store.put_message(self.conversation_id, turn.seq, "assistant", turn.text, "in_progress")):
            turn.written = True

    def _end_turn(self, turn: _Turn, finished: bool) -> None:
        self._turn = None
        if not finished:
            # The reply was abandoned mid-way (an exception, or the caller stopped reading): keep
            # what was shown as an interrupted reply, in the session as in the store.
            self.session.keep_interrupted(turn.text, turn.seq)
        self._sync(from_seq=turn.seq if turn.written else None)

    # ---- the transcript ---------------------------------------------------------------------------
    def _write(self, fn) -> bool:
        """Run one store write; on failure report it once and go on in memory."""
        if not self.saving:
            return False
        try:
            fn()
            return True
        except (sqlite3.Error, OSError, StoreError) as e:
            self._failed = True
            reason = describe_sqlite_error(e) if isinstance(e, sqlite3.Error) else (
                getattr(e, "strerror", None) or str(e))
            self._note("error", f"could not save the conversation to {self.store.path} ({reason}): the chat goes "
                                "on in memory, and what was saved before is intact")
            return False

    def _ensure_conversation(self) -> bool:
        if self.conversation_id is not None:
            return True
        if not self.saving:
            return False
        created: list[int] = []
        ok = self._write(lambda: created.append(self.store.create_conversation(
            model_id=self.identity.model_id, model_spec=self.identity.model_spec,
            weights_fingerprint=self.identity.weights_fingerprint, prompt_format=self.session.format.key)))
        if ok:
            self.conversation_id = created[0]
            self._mirror = []
        return ok

    def _sync(self, from_seq: int | None = None) -> None:
        """Make the stored messages equal the session's (rewriting from the first difference)."""
        if not self.saving:
            return
        msgs = [(m.role, clean_text(m.content), "interrupted" if m.interrupted else "complete")
                for m in self.session.conversation.messages]
        if self.conversation_id is None:
            if not any(role == "user" for role, _, _ in msgs) or not self._ensure_conversation():
                return
        k = common_prefix(msgs, self._mirror)
        if from_seq is not None:
            k = min(k, from_seq)
        elif k == len(msgs) == len(self._mirror):
            return
        if self._write(lambda: self.store.replace_messages(self.conversation_id, k, msgs[k:])):
            self._mirror = msgs

    def after_turn(self) -> None:
        """Idle work once a turn is over: the KV snapshot, then the prefix store."""
        self.save_snapshot()
        self.store_prefix()

    # ---- the prefix store -------------------------------------------------------------------------
    def store_prefix(self) -> int:
        """After a conversation's first turn, keep the K/V of its prompt (system prompt plus first
        message) and of the system prompt alone in the prefix store, for later conversations.

        Prefixes already stored are only marked used. The K/V come from the live caches when they
        hold the prompt at full precision (prealloc, concat, or any mode before it quantised or
        evicted anything); otherwise the prompt is run again into a full-precision cache, and a
        note says what that cost. Returns the tokens newly stored."""
        from chatapp.engine.prefix import full_precision_kv

        from .prefixes import MIN_REUSE, PrefixWriteError
        from .snapshot import token_hash

        store, s = self.prefixes, self.session
        if store is None or not self.saving or self._prefix_failed or self._turn is not None or not s.stores_kv:
            return 0
        stored = 0
        for tokens in self._first_turn_prefixes():
            key = token_hash(tokens)
            if len(tokens) < MIN_REUSE or key in self._prefixes_seen:
                continue
            self._prefixes_seen.add(key)
            if store.covered(self.namespace, tokens) >= len(tokens):
                continue
            t0 = time.perf_counter()
            kv, ran = full_precision_kv(s, tokens)
            try:
                store.put(self.namespace, tokens, kv)
            except PrefixWriteError as e:
                self._prefix_failed = True
                self._note("error", f"could not write to the prefix store in {store.dir} ({e}): new conversations "
                                    "will prefill their prompts; what was stored before is intact")
                return stored
            stored += len(tokens)
            if ran:
                self._note("note", f"prefix store: stored {len(tokens)} prompt tokens; the {s.mode} cache had "
                                   f"quantised or evicted them, so {ran} were run again at full precision "
                                   f"({(time.perf_counter() - t0) * 1000:.0f} ms)")
        return stored

    def _first_turn_prefixes(self) -> list[list[int]]:
        """The prompt of the conversation's first turn, and its system prompt alone; [] unless
        the conversation is exactly one finished turn."""
        s = self.session
        msgs = s.conversation.messages
        users = [i for i, m in enumerate(msgs) if m.role == "user"]
        if len(users) != 1 or not msgs or msgs[-1].role != "assistant":
            return []
        out = [s.format.tokens(Conversation(msgs[: users[0] + 1]))]
        if msgs[0].role == "system":
            try:
                out.append(s.format.tokens(Conversation(msgs[:1]), generation_prompt=False))
            except Exception:  # noqa: BLE001 - a chat template may refuse a system message alone
                pass
        return out

    # ---- closing ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish: keep a reply still streaming as interrupted, save the snapshot, close the store."""
        self._close_open_turn()
        try:
            self.save_snapshot()
        finally:
            if self.store is not None:
                self.store.close()

    def __enter__(self) -> "PersistentChat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_chat(session, identity: ModelIdentity, data_dir: str | Path, *, save: bool = True,
              resume: int | str | None = None, snapshot_cap_mb: int = 2048,
              prefix_cap_mb: int = 0) -> PersistentChat:
    """A :class:`PersistentChat` on the store in ``data_dir``.

    ``save=True`` opens the store for writing. When another process holds the data directory,
    or it cannot be written (read-only, disk full, not a directory), the chat runs in memory and
    a note says so (:meth:`PersistentChat.take_notes`); a busy store is still read for ``resume``.
    ``resume`` (an id, or "latest") continues a saved conversation (see
    :meth:`PersistentChat.resume`); it raises :class:`~chatapp.store.db.NotFound` /
    :class:`StoreError` when there is nothing to resume. ``prefix_cap_mb`` > 0 attaches the
    shared-prefix KV store (``<data dir>/prefixes``, see prefixes.py), bounded to that size:
    written only by a chat that saves, read by any.
    """
    data_dir = Path(data_dir).expanduser()
    notes: list[Note] = []
    store: ChatStore | None = None
    if save:
        try:
            store = ChatStore.open(data_dir, write=True)
            if store.recovered:
                n = store.recovered
                notes.append(Note("note", f"{n} repl{'y' if n == 1 else 'ies'} left unfinished by an earlier run "
                                          f"(killed, crashed or out of disk space) {'was' if n == 1 else 'were'} "
                                          "kept as saved, marked interrupted"))
        except StoreBusy as e:
            notes.append(Note("note", f"{e}: this conversation will not be saved"))
        except (OSError, StoreError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            notes.append(Note("error", f"cannot save conversations in {data_dir} ({reason}): this chat is kept "
                                       "in memory only"))
    if store is None and resume is not None:
        store = ChatStore.open(data_dir, write=False)
    prefixes = None
    if prefix_cap_mb > 0:
        from .prefixes import PrefixStore

        prefixes = PrefixStore(prefix_dir(data_dir), prefix_cap_mb * MiB, writable=False)
    chat = PersistentChat(session, identity, store, snapshot_cap_mb=snapshot_cap_mb, prefixes=prefixes)
    chat._notes.extend(notes)
    if resume is not None:
        try:
            chat.resume(resume)
        except BaseException:
            if store is not None:
                store.close()
            raise
    return chat


__all__ = [
    "ModelIdentity", "Note", "PARTIAL_SECONDS", "PARTIAL_TOKENS", "PersistentChat", "Prepared", "ResumeInfo",
    "TurnResult", "open_chat", "transcript_hash",
]
