"""Model loading (GGUF files here; the folder loaders move in from chatapp.engine)."""
