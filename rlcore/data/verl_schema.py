"""verl's data files, read as they are: where their rows keep the ground truth, and the chat check.

verl's preprocessing scripts (examples/data_preprocess/gsm8k.py and the others) write one row per
problem with the columns

    data_source    "openai/gsm8k"; routes the row to its reward function
    prompt         [{"role": "user", "content": "..."}]: chat messages, rendered by the chat template
    ability        "math"
    reward_model   {"style": "rule", "ground_truth": "72"}: the answer the reward checks
    extra_info     {"split": "train", "index": 0, "answer": ..., "question": ...}: passed to the reward

A row is read this way when it has a ``reward_model`` column and no column named like
``data.answer_key``: then ``reward_model.ground_truth`` is the ground truth and ``extra_info`` travels
with the row to the reward function. Both are checked when the file is read, so a bad row is an
error naming the file, the row and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.errors import DataError

GROUND_TRUTH_KEY = "reward_model.ground_truth"


def is_verl_row(row: dict[str, Any], answer_key: str | None) -> bool:
    """True for a row laid out as verl's: a ``reward_model`` column and no ``answer_key`` column."""
    return "reward_model" in row and (answer_key is None or answer_key not in row)


def verl_ground_truth(row: dict[str, Any], path: str | Path, index: int) -> Any:
    """``row["reward_model"]["ground_truth"]``, or an error naming the file, the row and the key."""
    spec = row["reward_model"]
    if not isinstance(spec, dict):
        raise DataError(f"{path} row {index}: 'reward_model' must be a dict like "
                         f"{{'style': 'rule', 'ground_truth': ...}} (verl's layout), got {spec!r}")
    if spec.get("ground_truth") is None:
        present = sorted(k for k, v in spec.items() if v is not None)
        raise DataError(f"{path} row {index}: {GROUND_TRUTH_KEY!r} is missing or null (verl's layout: "
                         f"reward_model = {{'style': 'rule', 'ground_truth': ...}}); reward_model has {present}")
    return spec["ground_truth"]


def verl_extra_info(row: dict[str, Any], path: str | Path, index: int) -> dict[str, Any] | None:
    """The row's ``extra_info`` dict (None when the file has no such column or the value is null)."""
    info = row.get("extra_info")
    if info is not None and not isinstance(info, dict):
        raise DataError(f"{path} row {index}: 'extra_info' must be a dict (or null), got "
                         f"{type(info).__name__} {info!r}")
    return info


def check_messages(prompt: Any, path: str | Path, index: int) -> None:
    """A chat prompt: a non-empty list of {"role": str, "content": str} messages; the error names the
    message and the key that is wrong."""
    if not isinstance(prompt, list):
        raise DataError(f"{path} row {index}: prompt must be a string or a list of "
                         f"{{'role', 'content'}} messages, got {type(prompt).__name__} {prompt!r}")
    if not prompt:
        raise DataError(f"{path} row {index}: prompt is an empty list of messages")
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DataError(f"{path} row {index}: prompt[{j}] must be a {{'role', 'content'}} message, "
                             f"got {type(message).__name__} {message!r}")
        for key in ("role", "content"):
            value = message.get(key)
            if not isinstance(value, str) or (key == "role" and not value.strip()):
                what = "missing" if key not in message else f"{type(value).__name__} {value!r}"
                raise DataError(f"{path} row {index}: prompt[{j}].{key} must be a "
                                 f"{'non-empty ' if key == 'role' else ''}string, got {what}")
