"""Remember one setting in the user's config file (``config.toml`` in the user config dir).

Only the one line changes: comments and every other setting stay as the user wrote them. The
new text is parsed before it replaces the file (written to a temporary file, then renamed), so
a failure leaves the file as it was. Used for what the TUI remembers (the theme).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .config import user_config_path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ConfigWriteError(Exception):
    """The setting could not be written; ``str()`` is one line for the user."""


def _header(line: str) -> str | None:
    m = re.match(r"\s*\[\s*([A-Za-z0-9_.-]+)\s*\]\s*(#.*)?$", line)
    return m.group(1) if m else None


def with_value(text: str, section: str, key: str, value: str) -> str:
    """``text`` (a TOML document) with ``[section] key = "value"`` set, only that line changed."""
    new = f"{key} = {json.dumps(value, ensure_ascii=False)}"  # a JSON string is a TOML basic string
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if _header(ln) == section), None)
    if at is None:
        sep = [""] if lines and lines[-1].strip() else []
        return "\n".join(lines + sep + [f"[{section}]", new]) + "\n"
    end = next((i for i in range(at + 1, len(lines)) if _header(lines[i]) is not None), len(lines))
    key_re = re.compile(rf"\s*{re.escape(key)}\s*=")
    for i in range(at + 1, end):
        if key_re.match(lines[i]):
            lines[i] = new
            break
    else:
        lines.insert(at + 1, new)
    return "\n".join(lines) + "\n"


def remember(section: str, key: str, value: str, path: Path | None = None) -> Path:
    """Set ``[section] key = value`` in the user's config file (created when missing)."""
    path = Path(path) if path is not None else user_config_path()
    try:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigWriteError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    new = with_value(text, section, key, value)
    try:
        parsed = tomllib.loads(new)
    except tomllib.TOMLDecodeError as e:
        raise ConfigWriteError(f"{path} is not valid TOML ({e}); not changed") from None
    if parsed.get(section, {}).get(key) != value:
        raise ConfigWriteError(f"{path}: cannot set {section}.{key} there (unusual layout); not changed")
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ConfigWriteError(f"cannot write {path}: {e.strerror or e}") from None
    return path


__all__ = ["ConfigWriteError", "remember", "with_value"]
