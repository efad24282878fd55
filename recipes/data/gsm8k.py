"""GSM8K -> train/test parquet files in the layout `PromptDataset` reads.

Nothing is downloaded (these machines cannot reach a dataset hub): point `--input` at a local copy
of GSM8K in its original JSON-lines form, one {"question": ..., "answer": ...} per line, where the
answer is the worked solution ending in "#### <number>" (the files `train.jsonl` / `test.jsonl`
of github.com/openai/grade-school-math, or an export of the `openai/gsm8k` dataset).

    python -m recipes.data.gsm8k --input gsm8k/train.jsonl --test_input gsm8k/test.jsonl \
        --output_dir data/gsm8k

Without `--test_input`, a seeded random `--test_size` fraction of `--input` becomes the test set.
Output columns: `prompt` (a one-message chat list), `answer` (the final number as a string,
thousands separators removed) and `data_source` ("gsm8k", which picks the reward function).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = "Let's think step by step and output the final answer after '####'."
DATA_SOURCE = "gsm8k"


def extract_final_answer(solution: str) -> str:
    """The number after the last '####' of a GSM8K solution, without thousands separators."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '####' final answer: {solution[-80:]!r}")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError(f"GSM8K answer has nothing after '####': {solution[-80:]!r}")
    return final


def to_row(example: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "answer": extract_final_answer(example["answer"]),
        "data_source": DATA_SOURCE,
    }


def read_gsm8k(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            example = json.loads(line)
            missing = [k for k in ("question", "answer") if k not in example]
            if missing:
                raise ValueError(f"{path}:{line_no}: missing field {missing[0]!r}; "
                                 f"fields present: {sorted(example)}")
            try:
                rows.append(to_row(example))
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: {e}") from e
    if not rows:
        raise ValueError(f"{path} holds no examples")
    return rows


def split(rows: list[dict[str, Any]], test_size: float, seed: int) -> tuple[list, list]:
    """A seeded random split; the test set gets round(n * test_size) rows, at least one."""
    if not 0 < test_size < 1:
        raise ValueError(f"--test_size must be a fraction in (0, 1), got {test_size}")
    n_test = max(1, round(len(rows) * test_size))
    if n_test >= len(rows):
        raise ValueError(f"{len(rows)} examples are too few to split off a test set")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test_idx = set(order[:n_test])
    train = [r for i, r in enumerate(rows) if i not in test_idx]
    test = [r for i, r in enumerate(rows) if i in test_idx]
    return train, test


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, type=Path, help="local GSM8K jsonl (train split)")
    parser.add_argument("--test_input", type=Path, help="local GSM8K test jsonl (optional)")
    parser.add_argument("--output_dir", required=True, type=Path)
    parser.add_argument("--test_size", type=float, default=0.1,
                        help="fraction of --input held out when --test_input is not given")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.test_input is not None:
        train, test = read_gsm8k(args.input), read_gsm8k(args.test_input)
    else:
        train, test = split(read_gsm8k(args.input), args.test_size, args.seed)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, rows in (("train", train), ("test", test)):
        out[name] = args.output_dir / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), out[name])
        print(f"wrote {len(rows)} rows to {out[name]}")
    return out


if __name__ == "__main__":
    main()
