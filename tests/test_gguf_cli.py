"""--model given a GGUF file, folder or hub repo: how the file is found, and the one-line refusals
(exit 2, nothing written to the data directory) of the app and of every bench."""

from __future__ import annotations

import pytest

from chatapp.cli import main
from chatapp.model.gguf_source import find_gguf
from chatapp.model.modelfiles import ModelLoadError
from tests.gguf_models import metadata, random_llama, write_model_gguf

HASH = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ggufs")
    model = random_llama(seed=3)
    write_model_gguf(d / "a.gguf", model)
    write_model_gguf(d / "b.gguf", model)
    return d


def _hub(tmp_path, monkeypatch, files: dict[str, bytes]):
    repo = tmp_path / "hub" / "models--org--tiny-gguf"
    snap = repo / "snapshots" / HASH
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HASH)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_file_a_folder_of_one_and_a_folder_of_several(gguf_dir, tmp_path):
    assert find_gguf(str(gguf_dir / "a.gguf"))[0].name == "a.gguf"
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files; choose one with --gguf-file NAME .*a.gguf, b.gguf"):
        find_gguf(str(gguf_dir))
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes((gguf_dir / "a.gguf").read_bytes())
    assert find_gguf(str(one))[0].name == "m.gguf"
    assert find_gguf(str(gguf_dir / "b.gguf"))[1] == "b"


def test_a_hub_repo_of_gguf_files_offline(gguf_dir, tmp_path, monkeypatch):
    data = (gguf_dir / "a.gguf").read_bytes()
    _hub(tmp_path, monkeypatch, {"x.Q4_1.gguf": data, "x.Q8_0.gguf": data})
    path, model_id = find_gguf("org/tiny-gguf:x.Q8_0.gguf")
    assert path.name == "x.Q8_0.gguf" and model_id == "org/tiny-gguf:x.Q8_0.gguf"
    with pytest.raises(ModelLoadError, match=r"org/tiny-gguf holds 2 GGUF files; .*x.Q4_1.gguf, x.Q8_0.gguf"):
        find_gguf("org/tiny-gguf")
    with pytest.raises(ModelLoadError, match="offline mode is on"):
        find_gguf("org/tiny-gguf:nope.gguf")


def test_gguf_file_flag_loads_the_chosen_file(gguf_dir, tmp_path, monkeypatch, capsys):
    _hub(tmp_path, monkeypatch, {"x.gguf": (gguf_dir / "a.gguf").read_bytes(), "y.gguf": b"junk"})
    data = tmp_path / "data"
    rc = main(["--model", "org/tiny-gguf", "--gguf-file", "x.gguf", "--no-tui", "-p", "hi", "--max-tokens", "2",
               "--temp", "0", "--data-dir", str(data), "--verbose"])
    assert rc == 0
    assert "GGUF tensors: F32 x" in capsys.readouterr().err
    rc = main(["--model", "org/tiny-gguf", "--show-config"])
    out = capsys.readouterr().out
    assert rc == 0 and "holds 2 GGUF files" not in out  # show-config never fails on a choice it cannot make


def _bad_files(gguf_dir, tmp_path):
    good = (gguf_dir / "a.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) // 3])
    write_model_gguf(tmp_path / "arch.gguf", random_llama(seed=3), meta=metadata(arch="mamba"))
    write_model_gguf(tmp_path / "vocab.gguf", random_llama(seed=3), meta=metadata(**{"tokenizer.ggml.model": "t5"}))
    return {"truncated": (str(tmp_path / "cut.gguf"), "is truncated"),
            "architecture": (str(tmp_path / "arch.gguf"), "unsupported GGUF architecture 'mamba'"),
            "vocabulary": (str(tmp_path / "vocab.gguf"), "'t5' vocabulary"),
            "several": (str(gguf_dir), "holds 2 GGUF files")}


def test_bad_gguf_input_is_one_line_exit_2_and_writes_nothing(gguf_dir, tmp_path, capsys):
    data = tmp_path / "data"
    for spec, expected in _bad_files(gguf_dir, tmp_path).values():
        assert main(["--model", spec, "--no-tui", "-p", "hi", "--data-dir", str(data)]) == 2
        err = capsys.readouterr().err.strip()
        assert expected in err and len(err.splitlines()) == 1, err
    assert not data.exists() or not any(data.iterdir())


@pytest.mark.parametrize("bench", [["quality", "--model"], ["decode", "--models"], ["turns", "--model"]])
def test_every_bench_given_a_model_that_does_not_load_says_one_line(bench, gguf_dir, tmp_path, capsys):
    spec, expected = _bad_files(gguf_dir, tmp_path)["truncated"]
    extra = ["--text", __file__] if bench[0] == "quality" else []
    assert main(["bench", *bench, spec, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
