"""Backend-specific speed-ups.

`blas` must be usable before MLX is imported (it loads an optimised BLAS so that MLX's CPU
backend binds to it), so this package imports nothing from MLX at import time; `cpu` does.
"""
