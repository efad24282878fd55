"""Text <-> token ids on the episode side, straight through a fast tokenizer's Rust backend where
that gives exactly what transformers' wrapper gives.

Why: every turn of every episode encodes the env's text and decodes the model's reply in the
process that runs the episodes' event loop, and, in one process with an engine thread, under its
GIL. transformers' ``encode`` / ``decode`` wrap one Rust call in 15-40 µs of Python (argument
checks, a batch of one, a ``BatchEncoding``, id conversion): several times the call itself, and at
thousands of turns a second a visible share of the engine's time (``benchmarks/agentic.py``).

When: the backend is called directly only while its state is what the wrapper would set for this
call (no truncation, no padding, special tokens split as ``tokenizer.split_special_tokens`` says;
a call such as ``tokenizer(text, truncation=True)`` elsewhere leaves its state set, and then the
wrapper runs and resets it), and ``decode`` only when the tokenizer does not clean up spaces after
decoding. Slow (Python) tokenizers always take the wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerFast


class TextCodec:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer if isinstance(tokenizer, PreTrainedTokenizerFast) else None

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, no special tokens added."""
        backend = self._backend
        if (backend is not None and backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == bool(getattr(self.tokenizer, "split_special_tokens", False))):
            return backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool) -> str:
        if self._backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
