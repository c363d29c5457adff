"""The engine worker owns the session it serves: a model switch (the store's ``ChatRequests``) hands
the new session to the worker through ``EngineWorker.adopt``, nothing sets it from outside, and the
worker takes only a session built on its own cancel flag (the one ``cancel`` sets)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from chatapp.engine.events import Idle, Loaded, ModelReleased, ModelSwitch, SessionInfo
from chatapp.engine.requests import Describe, SwitchModel
from chatapp.engine.stats import CacheView


class _Session:
    """A session as the worker sees it, built on ``cancel`` as real sessions are (``cancel_token``)."""

    def __init__(self, model_id: str, cancel: threading.Event) -> None:
        self.model_id = model_id
        self.cancel_token = cancel
        self.conversation = SimpleNamespace(messages=[])

    def load_lines(self) -> list[str]:
        return []

    def describe(self) -> SessionInfo:
        return SessionInfo(self.model_id, "prealloc", "prealloc", CacheView(mode="prealloc"))


class _Chat:
    def __init__(self, session) -> None:
        self.session = session

    def take_notes(self) -> list:
        return []

    def close(self) -> None:
        pass


def _switching_worker(monkeypatch, requests):
    """An EngineWorker with the store's ChatRequests attached, its model switch loading a fake
    session on the cancel flag it is given; runs ``requests`` and returns (worker, part, events)."""
    from chatapp.engine.worker import EngineWorker
    from chatapp.store import chat_requests

    def switch_model(config, chat, spec, on_slow_warm_up=None, cancel=None):
        return ModelSwitch(spec, True, model_id=spec), _Chat(_Session(spec, cancel)), config

    monkeypatch.setattr(chat_requests, "switch_model", switch_model)
    monkeypatch.setattr(chat_requests, "release_old_model", lambda before: ModelReleased(before, 0))
    got: list = []
    part = chat_requests.ChatRequests(SimpleNamespace(), got.append, save=False)

    def make_session(emit, cancel):
        session = _Session("old", cancel)
        part.chat = _Chat(session)
        return session

    worker = EngineWorker(make_session, got.append)
    part.attach(worker)
    worker.start()
    for request in requests:
        worker.submit(request)
    worker.stop()
    worker.join(10)
    assert not worker._thread.is_alive()
    return worker, part, got


def test_a_model_switch_hands_its_session_to_the_worker(monkeypatch):
    """The switch's new session reaches the worker (its report describes it, and the worker's own
    requests run on it afterwards), and it is the chat's session too: one session, the worker's."""
    worker, part, got = _switching_worker(monkeypatch, [SwitchModel("new"), Describe()])
    assert isinstance(got[0], Loaded) and got[0].model_id == "old"
    switched = next(e for e in got if isinstance(e, ModelSwitch))
    assert switched.ok and switched.info is not None and switched.info.model_id == "new"
    described = [e for e in got if type(e) is SessionInfo]
    assert [e.model_id for e in described] == ["new"]  # Describe: the worker's own dispatch
    assert worker.session is part.chat.session and worker.session.model_id == "new"
    assert worker.session.cancel_token is worker.cancel_token
    assert isinstance(got[-1], Idle)


def test_only_the_worker_sets_its_session(monkeypatch):
    """Nothing assigns the worker's session from outside; ``adopt`` takes a session on the worker's
    cancel flag and refuses one on another flag (a cancel could not stop it)."""
    worker, _, _ = _switching_worker(monkeypatch, [])
    served = worker.session
    with pytest.raises(AttributeError):
        worker.session = _Session("set from outside", worker.cancel_token)
    with pytest.raises(ValueError, match="cancel flag"):
        worker.adopt(_Session("another flag", threading.Event()))
    assert worker.session is served
    other = _Session("adopted", worker.cancel_token)
    worker.adopt(other)
    assert worker.session is other
