"""Tasks for a real chat model, written locally: arithmetic asked in words, and GSM8K-style
multi-step word problems.

Why generated: nothing can be downloaded here, and a task made from templates has exact answers,
any size and a held-out split that shares no question with the training one. Both are meant for a
small pretrained instruct model (SmolLM2-135M-Instruct answers 22% of ``arithmetic_words`` and 9%
of ``multi_step`` right greedily): hard enough that RL has something to improve, and for the first
task easy enough that sampling finds right answers. ``multi_step`` is too hard for the base model
to learn from its own samples (its right samples are 1-6%); its rows carry a worked ``solution`` so
a short SFT warm start can teach the form of a multi-step answer first.

- ``arithmetic_words``: one operation asked in a sentence, several phrasings ("What is 17 plus
  25?", "Subtract 18 from 43.", "What is 6 times 7?"), operands up to 30 (products up to 10 x 10).
- ``multi_step``: two operations in a short story ("Mia has 12 apples. She buys 3 bags
  with 4 apples in each bag. How many apples does she have now?"), results never negative.

A row is ``{"prompt": [chat messages], "answer": "42", "solution": "...", "data_source": ...}``: the prompt goes
through the policy's own chat template (``PromptDataset``), the answer is an integer string, and
both data sources are scored by the ``final_number`` reward (``rlcore.rewards.registry``: the
number after "answer is", else the response's last number). The instruction in the user message
says which form is wanted (``instruction``); it is part of the task, so the same checker scores
a model that follows it and one that does not.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from rlcore.data.arithmetic import write_jsonl

ARITHMETIC_WORDS = "arithmetic_words"
MULTI_STEP = "multi_step"
TASKS = (ARITHMETIC_WORDS, MULTI_STEP)
ROW_LAYOUT = 2  # bumped when a row gains or changes a column (2: "solution"), so cached files are rewritten
INSTRUCTIONS = {
    ARITHMETIC_WORDS: "Answer with the number only.",
    MULTI_STEP: "Give the final answer as a number at the end, like this: The answer is 7.",
}

_NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Eli", "Ivy", "Max", "Lily", "Noah", "Emma", "Ben", "Ruby")
_HE_SHE = {"Mia": "She", "Ava": "She", "Zoe": "She", "Ivy": "She", "Lily": "She", "Emma": "She", "Ruby": "She"}
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "stamps", "shells", "coins")


def _pronoun(name: str) -> str:
    return _HE_SHE.get(name, "He")


def _words_problem(rng: random.Random) -> tuple[str, int, str]:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 10), rng.randint(2, 10)
        forms = ("What is {a} times {b}?", "What is {a} multiplied by {b}?", "What is the product of {a} and {b}?")
        return rng.choice(forms).format(a=a, b=b), a * b, str(a * b)
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    if op == "+":
        forms = ("What is {a} plus {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?",
                 "What do you get when you add {b} to {a}?")
        return rng.choice(forms).format(a=a, b=b), a + b, str(a + b)
    a, b = max(a, b), min(a, b)
    forms = ("What is {a} minus {b}?", "Subtract {b} from {a}.", "What is {a} take away {b}?",
             "What is the difference between {a} and {b}?")
    return rng.choice(forms).format(a=a, b=b), a - b, str(a - b)


# Each story returns (question, answer, worked solution). The solution shows every step as one
# "x op y = z" equation and ends in the instructed form, so SFT on it teaches the format and the
# decomposition, never a shortcut; the arithmetic inside stays the model's to get right.
def _story_buy(rng: random.Random) -> tuple[str, int, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 5), rng.randint(2, 5)
    total = a + b * c
    return (f"{name} has {a} {item}. {_pronoun(name)} buys {b} bags with {c} {item} in each bag. "
            f"How many {item} does {name} have now?", total,
            f"The {b} bags hold {b} * {c} = {b * c} {item}.\n{name} has {a} + {b * c} = {total} {item} now.")


def _story_spend(rng: random.Random) -> tuple[str, int, str]:
    name = rng.choice(_NAMES)
    b, c = rng.randint(1, 15), rng.randint(1, 15)
    a = b + c + rng.randint(0, 20)
    left = a - b - c
    return (f"{name} had {a} dollars. {_pronoun(name)} spent {b} dollars on lunch and {c} dollars on a book. "
            f"How many dollars does {name} have left?", left,
            f"{name} spent {b} + {c} = {b + c} dollars.\n{name} has {a} - {b + c} = {left} dollars left.")


def _story_boxes(rng: random.Random) -> tuple[str, int, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 10), rng.randint(2, 5), rng.randint(1, 9)
    total = a * b + c
    return (f"{name} puts {a} {item} in each box. {_pronoun(name)} fills {b} boxes and has {c} {item} left over. "
            f"How many {item} did {name} have?", total,
            f"The {b} boxes hold {a} * {b} = {a * b} {item}.\nWith the {c} left over, {name} had "
            f"{a * b} + {c} = {total} {item}.")


def _story_pages(rng: random.Random) -> tuple[str, int, str]:
    name = rng.choice(_NAMES)
    a, b, c = rng.randint(2, 10), rng.randint(2, 5), rng.randint(1, 10)
    total = a * b + c
    return (f"{name} reads {a} pages every day for {b} days, and then {c} more pages. "
            f"How many pages does {name} read in all?", total,
            f"In {b} days {name} reads {a} * {b} = {a * b} pages.\nWith {c} more, {name} reads "
            f"{a * b} + {c} = {total} pages in all.")


def _story_class(rng: random.Random) -> tuple[str, int, str]:
    a = rng.randint(6, 20)
    b, c = rng.randint(1, a - 1), rng.randint(2, 4)
    girls = a - b
    return (f"There are {a} children in a class. {b} of them are boys. Each girl has {c} pencils. "
            f"How many pencils do the girls have?", girls * c,
            f"There are {a} - {b} = {girls} girls.\nThe girls have {girls} * {c} = {girls * c} pencils.")


def _story_share(rng: random.Random) -> tuple[str, int, str]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    each, friends, extra = rng.randint(2, 6), rng.randint(2, 5), rng.randint(1, 10)
    a = each * friends
    return (f"{name} has {a} {item} and shares them equally among {friends} friends. Then each friend gets "
            f"{extra} more {item}. How many {item} does each friend have?", each + extra,
            f"Each friend first gets {a} / {friends} = {each} {item}.\nThen each friend has "
            f"{each} + {extra} = {each + extra} {item}.")


def _story_wage(rng: random.Random) -> tuple[str, int, str]:
    name = rng.choice(_NAMES)
    a, b = rng.randint(2, 10), rng.randint(2, 5)
    c = rng.randint(1, a * b - 1)
    return (f"{name} earns {a} dollars an hour and works for {b} hours. Then {_pronoun(name).lower()} pays "
            f"{c} dollars for a ticket. How many dollars does {name} have left?", a * b - c,
            f"{name} earns {a} * {b} = {a * b} dollars.\nAfter the ticket, {name} has {a * b} - {c} = "
            f"{a * b - c} dollars left.")


_STORIES: tuple[Callable[[random.Random], tuple[str, int, str]], ...] = (
    _story_buy, _story_spend, _story_boxes, _story_pages, _story_class, _story_share, _story_wage)


def make_word_problems(task: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct problems of ``task`` (``arithmetic_words`` or ``multi_step``), the same for the same seed.

    Each row also carries ``solution``: the reply the instruction asks for, worked step by step for
    ``multi_step`` (SFT's target with ``data.response_key=solution``; the RL recipes ignore it)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    draw = _words_problem if task == ARITHMETIC_WORDS else (lambda r: r.choice(_STORIES)(r))
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct {task} problems (found {len(rows)})")
        question, answer, steps = draw(rng)
        if question in seen:
            continue
        seen.add(question)
        content = f"{question} {INSTRUCTIONS[task]}"
        solution = steps if task == ARITHMETIC_WORDS else f"{steps}\nThe answer is {answer}."
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": str(answer),
                     "solution": solution, "data_source": task})
    return rows


def write_word_problems(out_dir: str | Path, task: str, n_train: int, n_val: int, seed: int = 0) -> tuple[Path, Path]:
    """``<out_dir>/<task>_train.jsonl`` and ``_val.jsonl``: disjoint splits of one draw."""
    rows = make_word_problems(task, n_train + n_val, seed)
    out_dir = Path(out_dir)
    return (write_jsonl(out_dir / f"{task}_train.jsonl", rows[:n_train]),
            write_jsonl(out_dir / f"{task}_val.jsonl", rows[n_train:]))
