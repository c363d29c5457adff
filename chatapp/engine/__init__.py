"""Model loading, generation, conversation and the session manager (no UI)."""
