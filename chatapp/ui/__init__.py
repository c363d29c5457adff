"""The Textual terminal interface (``chatapp`` without ``--no-tui``).

The UI never imports MLX: every model operation runs on
:class:`chatapp.engine.worker.EngineWorker`'s thread, whose events come back here as Textual
messages. Entry point: :func:`chatapp.ui.app.run_tui`.
"""
