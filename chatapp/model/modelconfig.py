"""Reading a model's config.json (no MLX import, so the distributed launcher can use it)."""

from __future__ import annotations


def config_value(config: dict, *keys: str):
    """The first of ``keys`` set in ``config`` or its ``text_config`` (multimodal configs)."""
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            if source.get(key) is not None:
                return source[key]
    return None
