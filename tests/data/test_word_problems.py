"""The generated chat tasks: distinct questions, disjoint splits, and worked solutions that are right
at every step and end in the form the checker reads."""

import json
import re

import pytest

from rlcore.data.word_problems import INSTRUCTIONS, make_word_problems, write_word_problems
from rlcore.rewards.registry import final_number_reward

EQUATION = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_every_multi_step_solution_is_right_at_every_step_and_scores_one():
    rows = make_word_problems("multi_step", 700, seed=3)
    for row in rows:
        question = row["prompt"][0]["content"]
        assert question.endswith(INSTRUCTIONS["multi_step"])
        steps = EQUATION.findall(row["solution"])
        assert len(steps) == 2, row["solution"]
        for a, op, b, result in steps:
            a, b, result = int(a), int(b), int(result)
            expected = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
            assert result == expected and (op != "/" or a % b == 0), (row["solution"], a, op, b)
        assert int(steps[-1][3]) == int(row["answer"])  # the last step computes the answer
        assert row["solution"].endswith(f"\nThe answer is {row['answer']}.")
        assert final_number_reward(row["solution"], row["answer"]) == 1.0
        assert int(row["answer"]) >= 0
    for kind in ("buys", "spent", "in each box", "pages every day", "children in a class", "shares them", "earns"):
        assert sum(kind in r["prompt"][0]["content"] for r in rows) > 50, kind  # every story kind is drawn


def test_an_arithmetic_words_solution_is_the_bare_number_the_instruction_asks_for():
    for row in make_word_problems("arithmetic_words", 200, seed=4):
        assert row["solution"] == row["answer"]
        assert final_number_reward(row["solution"], row["answer"]) == 1.0


def test_the_same_seed_gives_the_same_rows_and_the_splits_share_no_question(tmp_path):
    assert make_word_problems("multi_step", 50, seed=1) == make_word_problems("multi_step", 50, seed=1)
    assert make_word_problems("multi_step", 50, seed=1) != make_word_problems("multi_step", 50, seed=2)
    train, val = write_word_problems(tmp_path, "multi_step", 300, 100, seed=0)
    train_q = {json.loads(line)["prompt"][0]["content"] for line in train.read_text().splitlines()}
    val_q = {json.loads(line)["prompt"][0]["content"] for line in val.read_text().splitlines()}
    assert len(train_q) == 300 and len(val_q) == 100 and not train_q & val_q


def test_an_unknown_task_is_refused_by_name():
    with pytest.raises(ValueError, match="task must be one of"):
        make_word_problems("gsm8k", 3, seed=0)
