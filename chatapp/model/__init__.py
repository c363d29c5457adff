"""Loading a model: hub resolution, model files and configs, the dtype/device choice (no session, no cache)."""
