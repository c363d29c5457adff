"""chatapp: a terminal chat app for local LLMs on MLX."""

__version__ = "0.1.0"
