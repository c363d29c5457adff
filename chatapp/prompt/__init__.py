"""Prompts: the conversation, the prompt formats and the choice among them (no MLX)."""
