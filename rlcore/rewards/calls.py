"""One reward call (a function on one row, or a TRL-style function on many rows) and its checked
result; the manager (rlcore.rewards.manager) builds them, rlcore.rewards.running runs them.

A call's ``run`` returns one ``(score or None, extras)`` per row it covers. The checks live here, in
the process that ran the function, so only plain floats travel back from a forked worker.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcore.rewards.signatures import RewardCall

RowResult = tuple[float | None, dict[str, float]]  # (score, or None: not applicable; a dict form's extras)


class BadRow(ValueError):
    """A returned value that is not a score, at ``position`` among the call's rows (the manager maps it
    to the batch row; None: the return as a whole, a list of the wrong length). Carries its arguments
    in ``args`` so that it survives pickling from a fork."""

    def __init__(self, position: int | None, message: str) -> None:
        super().__init__(position, message)
        self.position, self.message = position, message

    def __str__(self) -> str:
        return self.message


def as_score(value: Any) -> RowResult:
    """A reward must be one finite real number, alone or as a dict's ``score`` (verl's form: the other
    numeric entries come back as extra metrics, the rest is dropped), or None ("not applicable to this
    row", TRL's convention); anything else would poison the advantages."""
    extras: dict[str, float] = {}
    if value is None:
        return None, extras
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"the reward function returned a dict without a 'score' entry: {sorted(map(str, value))}")
        extras = {str(k): float(v) for k, v in value.items()
                  if k != "score" and isinstance(v, numbers.Real) and math.isfinite(v)}
        value = value["score"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"the reward function returned {value!r} ({type(value).__name__}), "
                        "expected a real number (or None: not applicable)")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"the reward function returned {score}, expected a finite number")
    return score, extras


@dataclass(frozen=True)
class Component:
    """A resolved reward function as one term of a row's reward."""

    name: str  # in metrics and the reward_components column
    call: RewardCall
    weight: float = 1.0
    label: str = ""  # in messages: how the config named it (an import path, a registered name)

    @property
    def full_score(self) -> float:
        """The most this function gives on one row: its ``full_score`` attribute, 1.0 by default."""
        return float(getattr(self.call.fn, "full_score", 1.0))


@dataclass(frozen=True)
class RowCall:
    """One row scored by an rlcore- or verl-style function."""

    component: Component
    row: int
    response: str
    ground_truth: Any
    prompt: Any
    data_source: Any
    extra_info: Any
    kwargs: dict[str, Any]

    @property
    def rows(self) -> tuple[int, ...]:
        return (self.row,)

    @property
    def call(self) -> RewardCall:
        return self.component.call

    def run(self) -> list[RowResult]:
        return [as_score(self.call(self.response, self.ground_truth, prompt=self.prompt, data_source=self.data_source,
                                   extra_info=self.extra_info, kwargs=self.kwargs))]


@dataclass(frozen=True)
class BatchCall:
    """Rows ``rows`` scored by one call of a TRL-style function."""

    component: Component
    rows: tuple[int, ...]
    prompts: list[Any]
    completions: list[Any]
    columns: dict[str, Any]

    @property
    def call(self) -> RewardCall:
        return self.component.call

    def run(self) -> list[RowResult]:
        returned = self.call.call_batch(self.prompts, self.completions, self.columns)
        if isinstance(returned, np.ndarray):
            returned = returned.tolist()
        if isinstance(returned, (str, bytes, Mapping)) or not isinstance(returned, Sequence):
            raise BadRow(None, f"returned {type(returned).__name__}, expected a list of {len(self.rows)} scores "
                               "(one per completion; None: not applicable)")
        if len(returned) != len(self.rows):
            raise BadRow(None, f"returned {len(returned)} scores for {len(self.rows)} completions")
        results = []
        for position, value in enumerate(returned):
            if isinstance(value, Mapping):
                raise BadRow(position, f"returned a dict for one completion, expected a number or None: {value!r}")
            try:
                results.append(as_score(value))
            except (TypeError, ValueError) as exc:
                raise BadRow(position, str(exc)) from None
        return results


Call = RowCall | BatchCall
