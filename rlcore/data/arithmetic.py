"""Synthetic arithmetic problems: the task the default recipes learn on, with no download.

A row is {"prompt": "12+3=", "answer": "15", "data_source": "arithmetic"}. The format is made
for a character-level model of 0.3M-2M parameters: no spaces, operands of one or two digits by
default, subtraction ordered so the result is never negative unless asked. SFT trains on
prompt + answer + eos; RL scores the sampled continuation with the "arithmetic" reward
(rlcore.rewards.registry), which wants exactly the answer string before the first newline/eos.

Prompts within one call are distinct, so `make_split` can cut one draw into train and validation
sets that share no prompt.
"""

from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "arithmetic"
COLUMNS = ("prompt", "answer", "data_source")
_SUPPORTED_OPS = "+-*"


def _num_distinct_prompts(max_operand: int, ops: str, allow_negative: bool) -> int:
    pairs = (max_operand + 1) ** 2
    ordered_pairs = (max_operand + 1) * (max_operand + 2) // 2  # a >= b
    return sum(ordered_pairs if (op == "-" and not allow_negative) else pairs for op in ops)


def make_arithmetic_examples(n: int, seed: int, *, max_operand: int = 99, ops: str = "+-",
                             allow_negative: bool = False) -> list[dict[str, str]]:
    """`n` distinct problems `a<op>b=` with 0 <= a, b <= max_operand, the same for the same seed.

    Each problem draws its operator uniformly from `ops` (a subset of "+-*"), then both operands.
    With allow_negative=False a subtraction puts the larger operand first.
    """
    if not ops or set(ops) - set(_SUPPORTED_OPS) or len(set(ops)) != len(ops):
        raise ValueError(f"ops must be distinct characters from {_SUPPORTED_OPS!r}, got {ops!r}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    capacity = _num_distinct_prompts(max_operand, ops, allow_negative)
    if not 0 <= n <= capacity:
        raise ValueError(f"cannot draw {n} distinct problems: ops={ops!r} with "
                         f"max_operand={max_operand} allow only {capacity}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < n:
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and not allow_negative and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": prompt, "answer": str(answer), "data_source": DATA_SOURCE})
    return rows


def make_split(n_train: int, n_val: int, seed: int,
               **kwargs) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Train and validation sets with no prompt in common (kwargs as make_arithmetic_examples)."""
    rows = make_arithmetic_examples(n_train + n_val, seed, **kwargs)
    return rows[:n_train], rows[n_train:]


def write_arithmetic_jsonl(path: str | Path, n: int, seed: int, **kwargs) -> Path:
    """Write `n` problems (kwargs as make_arithmetic_examples) as JSON lines."""
    return write_jsonl(path, make_arithmetic_examples(n, seed, **kwargs))


def write_arithmetic_parquet(path: str | Path, n: int, seed: int, **kwargs) -> Path:
    """Write `n` problems (kwargs as make_arithmetic_examples) as a parquet table."""
    return write_parquet(path, make_arithmetic_examples(n, seed, **kwargs))


def write_jsonl(path: str | Path, rows: list[dict[str, str]]) -> Path:
    """One JSON object per line: each row whole (prompt, answer, data_source, and any other column,
    such as a word problem's worked solution), e.g. a make_split half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # written beside it, then renamed: a run reading the file (another run sharing the output folder,
    # writing the same generated task at the same moment) sees the whole file or none, never a part
    part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    with part.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(part, path)
    return path


def write_parquet(path: str | Path, rows: list[dict[str, str]]) -> Path:
    """A parquet table with string columns prompt, answer, data_source (e.g. a make_split half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {c: pa.array([r[c] for r in rows], type=pa.string()) for c in COLUMNS}
    pq.write_table(pa.table(columns), path)
    return path
