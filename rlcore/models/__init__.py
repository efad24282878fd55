"""Models without a download: the ``model`` section, and tiny character-level checkpoints built
from scratch for tests and the recipes' defaults."""

from rlcore.models.config import DTYPES, ModelConfig, TinyModelConfig, torch_dtype
from rlcore.models.tiny import DEFAULT_CHARS, TINY_PRESETS, TinyShape, build_char_tokenizer, build_tiny_model

__all__ = ["DEFAULT_CHARS", "DTYPES", "TINY_PRESETS", "ModelConfig", "TinyModelConfig", "TinyShape",
           "build_char_tokenizer", "build_tiny_model", "torch_dtype"]
