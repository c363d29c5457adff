"""Text at the edges: user input that may hold invalid UTF-8, and text meant for a terminal.

Decision (see docs/persistence.md): input is decoded as UTF-8 with ``errors="replace"``, so
each invalid byte sequence becomes U+FFFD. That text is what the model sees and exactly what is
stored; control characters and escape sequences are kept as they are (the model and the
transcript get them intact) and only made visible when shown on a terminal
(:func:`chatapp.textsafe.printable`). Python hands command-line arguments over with invalid
bytes as lone surrogates (``surrogateescape``); :func:`clean_text` turns those into U+FFFD the
same way, because a tokenizer or SQLite cannot take lone surrogates.
"""

from __future__ import annotations

import re
from typing import BinaryIO, Iterator

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD (bytes smuggled in by
    ``surrogateescape`` are re-decoded, so ``b"\\xff"`` gives one U+FFFD as stdin would)."""
    if not _SURROGATE.search(text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates outside the escape range (U+DC80..U+DCFF)
        return _SURROGATE.sub("\ufffd", text)


def decode_line(raw: bytes) -> str:
    """One input line: UTF-8 with invalid bytes replaced, the line ending (LF or CRLF) removed."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    return raw.decode("utf-8", "replace")


def read_lines(stream: BinaryIO) -> Iterator[str]:
    """Lines of a binary stream (e.g. ``sys.stdin.buffer``), each returned as soon as it is
    complete, decoded by :func:`decode_line`."""
    for raw in iter(stream.readline, b""):
        yield decode_line(raw)


def is_blank(text: str) -> bool:
    """Empty or whitespace only: such messages are ignored, never sent."""
    return not text.strip()
