"""model/tokenizer_cache.py: a GGUF vocabulary is built once, then read from chatapp's cache;
a changed vocabulary builds afresh, a torn cache file is rebuilt, and a cache that cannot be
written costs nothing but the build."""

from __future__ import annotations

import pytest

from chatapp.model import gguf_tokenizer
from chatapp.model.gguf_file import read_header
from chatapp.model.gguf_tokenizer import build_tokenizer
from chatapp.model.tokenizer_cache import cached_tokenizer_path, vocabulary_digest
from tests.gguf_models import metadata, random_llama, write_model_gguf

TEXT = "<|im_start|>user\na t  t\n<|im_end|>"


@pytest.fixture(scope="module")
def model():
    return random_llama(seed=3)


@pytest.fixture
def gguf(model, tmp_path, monkeypatch):
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_model_gguf(path, model)
    return read_header(path)


def _built(monkeypatch) -> list:
    """The vocabularies built (not read from the cache) from here on."""
    calls: list = []
    real = gguf_tokenizer._pipeline

    def counting(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf_tokenizer, "_pipeline", counting)
    return calls


def test_a_vocabulary_is_built_once_then_read_from_the_cache(gguf, monkeypatch):
    built = _built(monkeypatch)
    first = build_tokenizer(gguf, "m.gguf")
    assert built == ["m.gguf"] and cached_tokenizer_path(gguf).is_file()
    second = build_tokenizer(gguf, "m.gguf")
    assert built == ["m.gguf"]  # not built again
    ids = first.encode(TEXT, add_special_tokens=False)
    assert second.encode(TEXT, add_special_tokens=False) == ids and second.decode(ids) == TEXT
    assert second.eos_token_ids == first.eos_token_ids and second.bos_token == first.bos_token
    assert second.get_vocab() == first.get_vocab()  # the vocabulary is the tokenizer's again


def test_another_vocabulary_gets_its_own_entry(gguf, model, tmp_path):
    other = tmp_path / "o.gguf"
    write_model_gguf(other, model, meta=metadata(**{"tokenizer.ggml.add_bos_token": True,
                                                    "tokenizer.ggml.bos_token_id": 257}))
    assert vocabulary_digest(read_header(other)) != vocabulary_digest(gguf)
    tok = build_tokenizer(read_header(other), "o.gguf")
    assert tok.encode("a")[0] == 257  # its own BOS, not the first file's tokenizer


def test_a_torn_cache_file_is_built_again(gguf, monkeypatch):
    build_tokenizer(gguf, "m.gguf")
    path = cached_tokenizer_path(gguf)
    path.write_text('{"version": "1.0", "model": ')
    built = _built(monkeypatch)
    tok = build_tokenizer(gguf, "m.gguf")
    assert built == ["m.gguf"] and tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
    assert path.read_text().startswith("{") and len(path.read_text()) > 1000  # written whole again


def test_a_cache_that_cannot_be_written_costs_only_the_build(gguf, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(blocker))
    tok = build_tokenizer(gguf, "m.gguf")
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
