"""Model builders that need no download: tiny character-level checkpoints for tests and recipes."""

from rlcore.models.tiny import (
    DEFAULT_CHARS,
    TINY_PRESETS,
    TinyShape,
    build_char_tokenizer,
    build_tiny_model,
)

__all__ = ["DEFAULT_CHARS", "TINY_PRESETS", "TinyShape", "build_char_tokenizer", "build_tiny_model"]
