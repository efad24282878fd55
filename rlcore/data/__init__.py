"""Datasets built locally: synthetic arithmetic problems and writers for their files."""

from rlcore.data.arithmetic import (
    make_arithmetic_examples,
    make_split,
    write_arithmetic_jsonl,
    write_arithmetic_parquet,
    write_jsonl,
    write_parquet,
)

__all__ = [
    "make_arithmetic_examples",
    "make_split",
    "write_arithmetic_jsonl",
    "write_arithmetic_parquet",
    "write_jsonl",
    "write_parquet",
]
