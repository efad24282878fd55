"""A small code task: write a Python function from its signature and docstring, checked by tests.

It exists so that a recipe can train on the ``code`` reward (rlcore.rewards.registry, run in the
sandbox of rlcore.rewards.sandbox) without a download. A row is

    {"prompt": instruction + "def add(a, b):" + docstring,
     "answer": '[{"call": "add(3, -7)", "expected": -4}, ...]',   # JSON tests: the ground truth
     "data_source": "code",
     "solution": "```python\\ndef add(a, b): ...```"}              # a reference answer (for SFT)

Nine functions (add, reverse a string, max of a list, ...). Each row draws fresh test inputs for one
of them, cycling through the functions, and the expected values come from the reference solution run
here, so every row is consistent with it. Honest scope: a validation split from `write_code_tasks`
checks the same nine functions on other inputs, not unseen tasks; and the repository's tiny
character-level models cannot write Python, so a real run needs a code-capable model (model.path).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "code"
COLUMNS = ("prompt", "answer", "data_source", "solution")
INSTRUCTION = "Write the Python function below. Answer with the complete function in a ```python code block."


@dataclass(frozen=True)
class CodeTask:
    name: str
    signature: str  # "add(a, b)"
    doc: str
    body: str  # the reference solution's body, indented by four spaces
    inputs: Callable[[random.Random], tuple]  # one test's arguments

    def reference(self) -> Callable:
        namespace: dict[str, Any] = {}
        exec(self.source(), namespace)  # trusted: the solution written below, not a response
        return namespace[self.name]

    def source(self) -> str:
        return f'def {self.signature}:\n    """{self.doc}"""\n{self.body}'


def _word(rng: random.Random, low: int = 0, high: int = 8) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(low, high)))


def _maybe_palindrome(rng: random.Random) -> tuple:
    half = _word(rng, 0, 4)
    return (half + rng.choice(["", rng.choice(string.ascii_lowercase)]) + half[::-1],) if rng.random() < 0.5 \
        else (_word(rng, 1, 7),)


TASKS = (
    CodeTask("add", "add(a, b)", "Return the sum of the integers a and b.", "    return a + b\n",
             lambda r: (r.randint(-100, 100), r.randint(-100, 100))),
    CodeTask("reverse_string", "reverse_string(s)", "Return the string s with its characters in reverse order.",
             "    return s[::-1]\n", lambda r: (_word(r),)),
    CodeTask("max_of_list", "max_of_list(xs)", "Return the largest number in the non-empty list of integers xs.",
             "    return max(xs)\n", lambda r: ([r.randint(-50, 50) for _ in range(r.randint(1, 6))],)),
    CodeTask("is_even", "is_even(n)", "Return True if the integer n is even, else False.",
             "    return n % 2 == 0\n", lambda r: (r.randint(-50, 50),)),
    CodeTask("count_vowels", "count_vowels(s)", "Return how many characters of the lowercase string s are vowels "
             "(a, e, i, o, u).", "    return sum(c in 'aeiou' for c in s)\n", lambda r: (_word(r, 0, 10),)),
    CodeTask("factorial", "factorial(n)", "Return n! (the product 1 * 2 * ... * n; 0! is 1) for 0 <= n <= 12.",
             "    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result\n",
             lambda r: (r.randint(0, 12),)),
    CodeTask("sum_of_digits", "sum_of_digits(n)", "Return the sum of the decimal digits of the integer n >= 0.",
             "    return sum(int(d) for d in str(n))\n", lambda r: (r.randint(0, 10**6),)),
    CodeTask("fizzbuzz", "fizzbuzz(n)", 'Return "FizzBuzz" if the integer n > 0 is divisible by 15, "Fizz" if '
             'by 3, "Buzz" if by 5, else str(n).',
             '    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n        return "Fizz"\n'
             '    if n % 5 == 0:\n        return "Buzz"\n    return str(n)\n', lambda r: (r.randint(1, 100),)),
    CodeTask("is_palindrome", "is_palindrome(s)", "Return True if the string s reads the same backwards, "
             "else False.", "    return s == s[::-1]\n", _maybe_palindrome),
)


def make_code_examples(n: int, seed: int, *, tests_per_row: int = 5) -> list[dict[str, str]]:
    """`n` rows cycling through TASKS, each with `tests_per_row` test calls drawn from `seed`."""
    if n < 0 or tests_per_row < 1:
        raise ValueError(f"need n >= 0 and tests_per_row >= 1, got n={n}, tests_per_row={tests_per_row}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        fn = task.reference()
        tests = []
        for _ in range(tests_per_row):
            args = task.inputs(rng)
            tests.append({"call": f"{task.name}({', '.join(map(repr, args))})", "expected": fn(*args)})
        header = f'def {task.signature}:\n    """{task.doc}"""\n'
        rows.append({"prompt": f"{INSTRUCTION}\n\n{header}", "answer": json.dumps(tests),
                     "data_source": DATA_SOURCE, "solution": f"```python\n{task.source()}```"})
    return rows


def write_code_tasks(folder: str | Path, *, n_train: int = 180, n_val: int = 36, seed: int = 0,
                     tests_per_row: int = 5) -> tuple[Path, Path]:
    """Write train.parquet and val.parquet (columns: COLUMNS) under `folder`; returns their paths."""
    rows = make_code_examples(n_train + n_val, seed, tests_per_row=tests_per_row)
    folder = Path(folder)
    return (_write_parquet(folder / "train.parquet", rows[:n_train]),
            _write_parquet(folder / "val.parquet", rows[n_train:]))


def _write_parquet(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({c: pa.array([r[c] for r in rows], type=pa.string()) for c in COLUMNS}), path)
    return path
