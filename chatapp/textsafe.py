"""Model output and user input are text, never markup or terminal control.

``printable`` turns control characters (ANSI escape sequences, carriage returns, bells, C1
controls) into visible escapes, so a reply cannot move the cursor, recolour or retitle the
terminal. Newlines and tabs are kept. Rich markup needs no escaping here: callers render
through ``rich.text.Text`` (never ``Text.from_markup``) or plain writes.
"""

from __future__ import annotations

_KEEP = {"\n", "\t"}


def _visible(ch: str) -> str:
    code = ord(ch)
    if code == 0x1B:
        return "␛"
    if code < 0x20:
        return chr(0x2400 + code)  # the Unicode "control picture" for C0 characters
    if code == 0x7F:
        return "␡"
    return f"\\x{code:02x}"  # C1 controls (0x80-0x9f)


def printable(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _KEEP or (code >= 0x20 and code != 0x7F and not 0x80 <= code <= 0x9F):
            out.append(ch)
        else:
            out.append(_visible(ch))
    return "".join(out)
