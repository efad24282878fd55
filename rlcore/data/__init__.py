"""Data: prompt datasets read from jsonl/parquet files (checked row by row), the resumable loader
and prompt collation, the synthetic arithmetic task written locally, and preference pairs (files
of prompt/chosen/rejected, and pairs built from the arithmetic task) for reward models."""

from rlcore.data.arithmetic import (
    make_arithmetic_examples,
    make_split,
    write_arithmetic_jsonl,
    write_arithmetic_parquet,
    write_jsonl,
    write_parquet,
)
from rlcore.data.dataset import PromptDataset, PromptLoader, collate_prompts
from rlcore.data.preference import (
    PairDataset,
    collate_pairs,
    make_arithmetic_pairs,
    write_pairs_jsonl,
    write_pairs_parquet,
)

__all__ = [
    "PairDataset",
    "PromptDataset",
    "PromptLoader",
    "collate_pairs",
    "collate_prompts",
    "make_arithmetic_pairs",
    "make_arithmetic_examples",
    "make_split",
    "write_arithmetic_jsonl",
    "write_arithmetic_parquet",
    "write_jsonl",
    "write_pairs_jsonl",
    "write_pairs_parquet",
    "write_parquet",
]
