"""Which decode route serves a conversation's caches: the fused native step, or MLX's, and why."""

from __future__ import annotations


def decode_route(model, caches: list) -> str:
    """``fused`` when the fused native step (backend/fused_decode.py) serves ``caches``, else
    ``mlx (why)``: the line ``--verbose``, F5 and ``bench long`` show."""
    from chatapp.backend.fused_install import fused_decoder
    from chatapp.backend.fused_support import cache_refusal

    if fused_decoder(model) is None:
        return "mlx (no fused step installed)"
    why = cache_refusal(caches, len(caches))
    return "fused" if why is None else f"mlx ({why})"
