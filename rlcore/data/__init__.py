"""Data: prompt datasets read from jsonl/parquet files (checked row by row), the resumable loader
and prompt collation, and the synthetic arithmetic task written locally."""

from rlcore.data.arithmetic import (
    make_arithmetic_examples,
    make_split,
    write_arithmetic_jsonl,
    write_arithmetic_parquet,
    write_jsonl,
    write_parquet,
)
from rlcore.data.dataset import PromptDataset, PromptLoader, collate_prompts

__all__ = [
    "PromptDataset",
    "PromptLoader",
    "collate_prompts",
    "make_arithmetic_examples",
    "make_split",
    "write_arithmetic_jsonl",
    "write_arithmetic_parquet",
    "write_jsonl",
    "write_parquet",
]
