"""Re-positioning cached keys after eviction.

RoPE is a rotation by an angle proportional to the position, so moving a cached key from
position p to p - d is one more rotation by -d. ``rope(x, offset=-d)`` on a [..., N, D] tensor
would rotate token i by (i - d), so each token gets its own length-1 sequence axis instead:
``rope(k[..., None, :], offset=-d)[..., 0, :]``. The rotation runs in float32 and is done
once per eviction chunk, which bounds the accumulated rounding error (five bfloat16 shifts
were measured at 3x the error of one).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from .settings import CacheConfigError

RopeFn = Callable[..., mx.array]


class Repositioner:
    """Shifts the positions of already-rotated keys (or queries) using the model's own RoPE."""

    def __init__(self, rope: RopeFn):
        self.rope = rope

    def shift(self, x: mx.array, delta: int) -> mx.array:
        if delta == 0 or x.shape[-2] == 0:
            return x
        moved = self.rope(x.astype(mx.float32)[..., None, :], offset=delta)[..., 0, :]
        return moved.astype(x.dtype)


def check_pure_rotation(rope: RopeFn, head_dim: int) -> None:
    """Refuse RoPE variants that are not pure rotations (e.g. YaRN's magnitude scaling).

    Shifting keys is only exact when rope(x, p + d) == shift(rope(x, p), d).
    """
    x = mx.random.normal((1, 1, 3, head_dim), key=mx.random.key(7))
    direct = rope(x, offset=9)
    shifted = Repositioner(rope).shift(rope(x, offset=14), -5)
    err = mx.abs(direct - shifted).max().item()
    scale = mx.abs(direct).max().item() or 1.0
    if err > 1e-3 * scale:
        raise CacheConfigError(
            "mode: this model's positional encoding is not a pure rotation "
            f"(shift error {err:.3g}), so window modes cannot re-position cached keys; "
            "use prealloc or quantized"
        )
