import json
import re

import pyarrow.parquet as pq
import pytest

from rlcore.data import (
    make_arithmetic_examples,
    make_split,
    write_arithmetic_jsonl,
    write_arithmetic_parquet,
    write_parquet,
)
from rlcore.models.tiny import DEFAULT_CHARS

PROBLEM = re.compile(r"(\d+)([+\-*])(\d+)=")


def _solve(prompt: str) -> tuple[int, str, int, int]:
    a, op, b = PROBLEM.fullmatch(prompt).groups()
    a, b = int(a), int(b)
    return a, op, b, {"+": a + b, "-": a - b, "*": a * b}[op]


def test_rows_have_correct_answers_and_format():
    rows = make_arithmetic_examples(500, seed=0, ops="+-*")
    assert len(rows) == 500
    for row in rows:
        assert set(row) == {"prompt", "answer", "data_source"}
        assert row["data_source"] == "arithmetic"
        a, op, b, value = _solve(row["prompt"])
        assert 0 <= a <= 99 and 0 <= b <= 99
        assert row["answer"] == str(value)
        assert value >= 0  # subtraction keeps the larger operand first by default
        assert set(row["prompt"] + row["answer"]) <= set(DEFAULT_CHARS)
    assert {_solve(r["prompt"])[1] for r in rows} == {"+", "-", "*"}


def test_negative_results_when_allowed():
    rows = make_arithmetic_examples(60, seed=1, ops="-", max_operand=9, allow_negative=True)
    answers = [int(r["answer"]) for r in rows]
    assert min(answers) < 0
    assert all(r["answer"] == str(_solve(r["prompt"])[3]) for r in rows)


def test_same_seed_same_rows_other_seed_differs():
    assert make_arithmetic_examples(50, seed=3) == make_arithmetic_examples(50, seed=3)
    assert make_arithmetic_examples(50, seed=3) != make_arithmetic_examples(50, seed=4)


def test_prompts_are_distinct_and_capacity_is_exact():
    # max_operand=2: '+' has 3*3 = 9 prompts, non-negative '-' has 3*4/2 = 6.
    rows = make_arithmetic_examples(15, seed=0, max_operand=2, ops="+-")
    assert len({r["prompt"] for r in rows}) == 15
    with pytest.raises(ValueError, match="allow only 15"):
        make_arithmetic_examples(16, seed=0, max_operand=2, ops="+-")


def test_split_is_disjoint_and_deterministic():
    train, val = make_split(2000, 300, seed=0)
    assert (len(train), len(val)) == (2000, 300)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert make_split(2000, 300, seed=0) == (train, val)


@pytest.mark.parametrize("kwargs", [dict(ops="/"), dict(ops=""), dict(ops="++"),
                                    dict(max_operand=-1)])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        make_arithmetic_examples(5, seed=0, **kwargs)


def test_jsonl_and_parquet_hold_the_same_rows(tmp_path):
    expected = make_arithmetic_examples(64, seed=5, max_operand=20)
    jsonl = write_arithmetic_jsonl(tmp_path / "a.jsonl", 64, seed=5, max_operand=20)
    with open(jsonl) as f:
        assert [json.loads(line) for line in f] == expected
    parquet = write_arithmetic_parquet(tmp_path / "sub" / "a.parquet", 64, seed=5, max_operand=20)
    table = pq.read_table(parquet)
    assert table.column_names == ["prompt", "answer", "data_source"]
    assert table.to_pylist() == expected


def test_write_split_halves(tmp_path):
    train, val = make_split(30, 10, seed=2)
    write_parquet(tmp_path / "train.parquet", train)
    write_parquet(tmp_path / "val.parquet", val)
    assert pq.read_table(tmp_path / "val.parquet").to_pylist() == val
