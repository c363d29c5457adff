"""The one-line errors of the front ends and the engine's start-up (no MLX: the CLI catches them
before and after the BLAS preload)."""


class UserError(Exception):
    """A mistake the user can fix; printed as one line, no traceback."""


class SetupError(Exception):
    """A one-line, user-fixable reason the engine could not start."""
