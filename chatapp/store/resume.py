"""Saving a chat's KV caches as a snapshot, and resuming a saved conversation from it.

:class:`SnapshotResume` is the half of :class:`~chatapp.store.chat.PersistentChat` that deals
with snapshots (``PersistentChat`` derives from it and holds the state used here: the session,
the store, the model identity, the conversation id and the last snapshot's key). A snapshot
is written after a turn, when idle, and on close; :meth:`SnapshotResume.resume` reads the
transcript and restores the caches from the snapshot when it fits, else lets the next turn
re-prefill the transcript, saying why.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from chatapp.prompt.conversation import Conversation, Message

from .db import StoreError
from .paths import prune_snapshots, snapshot_path

MiB = 1 << 20


@dataclass
class ResumeInfo:
    """How a conversation was resumed (the ``resume`` field of ``--stats-json``)."""

    conversation_id: int
    source: str  # "snapshot": caches restored; "transcript": the next turn re-prefills
    reason: str  # why the snapshot was not used ("" when it was)
    messages: int
    snapshot_tokens: int  # token ids the restored caches represent (0 for "transcript")
    load_seconds: float  # reading the transcript and restoring the caches
    switch: str = ""  # a cache-mode switch made after restoring (other settings asked for now)

    @property
    def from_snapshot(self) -> bool:
        return self.source == "snapshot"

    def line(self) -> str:
        if self.from_snapshot:
            text = (f"resumed conversation {self.conversation_id} ({self.messages} messages) from its KV "
                    f"snapshot: {self.snapshot_tokens} tokens restored in {self.load_seconds * 1000:.0f} ms, "
                    "no re-prefill")
            return text + (f"; {self.switch}" if self.switch else "")
        return (f"conversation {self.conversation_id}: KV snapshot not used ({self.reason}); "
                f"re-prefilling its {self.messages} messages from the transcript")

    def to_json(self) -> dict:
        return asdict(self)


def transcript_hash(session, messages: list[Message]) -> str:
    """sha256 of the token ids ``messages`` render to (no generation prompt)."""
    from .snapshot import token_hash

    return token_hash(session.format.tokens(Conversation(list(messages)), generation_prompt=False))


class SnapshotResume:
    """Snapshots and resuming, for :class:`~chatapp.store.chat.PersistentChat` (see the module docstring)."""

    # ---- snapshots --------------------------------------------------------------------------------
    def _snapshot_path(self) -> Path:
        return snapshot_path(self.store.data_dir, self.conversation_id)

    def _current_key(self) -> tuple:
        from .snapshot import token_hash

        s = self.session
        n = len(s.conversation.messages)
        return (token_hash(s.cached), s.settings, n, transcript_hash(s, s.conversation.messages))

    def save_snapshot(self) -> bool:
        """Write the caches to this conversation's snapshot when they changed since the last one.

        Call it when idle (after a turn) and on exit. Returns True when a snapshot was written.
        Skipped (False) when nothing is saved, the caches are mid-update, the size cap is 0 or
        too small (said once), or an earlier snapshot write failed (said then).
        """
        from .snapshot import SnapshotWriteError, save_snapshot, state_nbytes

        s = self.session
        if (not self.saving or self.conversation_id is None or self._snapshot_failed or self._turn is not None
                or not s.cached or self.cap_bytes <= 0 or not s.stores_kv
                or not s.cache_consistent()):
            return False
        key = self._current_key()
        if key == self._snapshot_key:
            return False
        estimate = state_nbytes(s.caches) + 4 * len(s.cached)
        if estimate > self.cap_bytes:
            if not self._cap_noted:
                self._cap_noted = True
                self._note("note", f"the KV snapshot ({estimate / MiB:.1f} MiB) is larger than data.snapshot_cap_mb "
                                   f"({self.cap_bytes // MiB} MiB), so it is not saved: resuming will re-prefill")
            return False
        path = self._snapshot_path()
        try:
            save_snapshot(
                path, caches=s.caches, tokens=s.cached, settings=s.settings, requested_mode=s.requested_mode,
                model_id=self.identity.model_id, weights_fingerprint=self.identity.weights_fingerprint,
                messages=key[2], transcript_sha256=key[3], prompt_format=s.format.key,
                conversation_id=self.conversation_id,
                renderings=[m.raw for m in s.conversation.messages[: key[2]]])
        except SnapshotWriteError as e:
            self._snapshot_failed = True
            self._note("error", f"could not save the KV snapshot to {path} ({e}): resuming will re-prefill; "
                                "what was saved before is intact")
            return False
        self._snapshot_key = key
        prune_snapshots(self.store.data_dir, self.cap_bytes, keep=path)
        return True

    # ---- resuming ---------------------------------------------------------------------------------
    def resume(self, ref: int | str | None = None) -> ResumeInfo:
        """Continue a saved conversation (``ref``: its id, or None / "latest").

        The transcript becomes the session's conversation. The snapshot is used when it was made
        by this model (id and weights fingerprint), its token ids and data are intact, and the
        transcript's first messages still render to the tokens it was made from; its caches are
        then restored and the next turn prefills only the new message. Otherwise the caches
        start empty and the next turn re-prefills the transcript; :attr:`ResumeInfo.reason` (and
        a note) says why. Raises :class:`~chatapp.store.db.NotFound` for an unknown id.
        """
        from .snapshot import SnapshotError

        if self.store is None:
            raise StoreError("there is no conversation store to resume from")
        self._close_open_turn()
        t0 = time.perf_counter()
        cid = self.store.resolve(ref)
        stored = self.store.messages(cid)
        s = self.session
        s.new_chat()
        s.load_conversation(Conversation([Message(m.role, m.content, m.interrupted) for m in stored]))
        self.conversation_id = cid
        self._mirror = [(m.role, m.content, m.status) for m in stored]
        self._snapshot_key = None
        info = self.store.get(cid)
        if self.saving and (info.model_id, info.model_spec, info.weights_fingerprint) != (
                self.identity.model_id, self.identity.model_spec, self.identity.weights_fingerprint):
            self._write(lambda: self.store.set_model(
                cid, model_id=self.identity.model_id, model_spec=self.identity.model_spec,
                weights_fingerprint=self.identity.weights_fingerprint, prompt_format=s.format.key))
        try:
            restored, switch = self._restore_snapshot(cid, s.conversation.messages)
            self.resume_info = ResumeInfo(cid, "snapshot", "", len(stored), restored,
                                          time.perf_counter() - t0, switch)
        except SnapshotError as e:
            s.new_chat()
            s.load_conversation(Conversation([Message(m.role, m.content, m.interrupted) for m in stored]))
            self.resume_info = ResumeInfo(cid, "transcript", str(e), len(stored), 0, time.perf_counter() - t0)
            self._note("note", self.resume_info.line())
        return self.resume_info

    def _restore_snapshot(self, cid: int, messages: list[Message]) -> tuple[int, str]:
        import mlx.core as mx

        from cache import CacheConfigError
        from cache.factory import restore_caches

        from .snapshot import SnapshotError, read_snapshot

        s = self.session
        snap = read_snapshot(snapshot_path(self.store.data_dir, cid))
        if snap.conversation_id != cid:
            raise SnapshotError(f"it belongs to conversation {snap.conversation_id}")
        if snap.model_id != self.identity.model_id:
            raise SnapshotError(f"it was made with model {snap.model_id}, not {self.identity.model_id}")
        if snap.weights_fingerprint != self.identity.weights_fingerprint:
            raise SnapshotError(f"the weights of {self.identity.model_id} have changed since it was made")
        if snap.prompt_format != s.format.key:
            # Another layout of the same messages: its cached tokens are not this format's.
            raise SnapshotError(
                f"it was made with the {snap.prompt_format} prompt format, this chat uses {s.format.key}")
        if snap.messages > len(messages):
            raise SnapshotError(f"it covers {snap.messages} messages, the transcript has only {len(messages)}")
        # Replies as the model saw them (Message.raw) are kept in the snapshot, not the database;
        # one is only used for the message it was made from.
        for m, raw in zip(messages, snap.renderings):
            if raw is not None and m.role == "assistant" and raw.strip() == m.content.strip():
                m.raw = raw
        if transcript_hash(s, messages[: snap.messages]) != snap.transcript_sha256:
            raise SnapshotError("the transcript renders to other tokens than the ones it holds")
        try:
            caches = restore_caches(s.model, snap.settings, snap.states, snap.metas, s.geometry)
            mx.eval([c.state for c in caches])
        except (CacheConfigError, ValueError) as e:  # CacheStateError is a ValueError
            raise SnapshotError(f"it does not fit this model ({e})") from None
        report = s.restore_state(caches, snap.tokens, snap.settings)
        if report is None:
            self._snapshot_key = self._current_key()  # nothing new to save until the next turn
        return len(snap.tokens), report.line() if report else ""

