"""The consistency check's verdicts, kept: ``<run>/check.jsonl``, one JSON object a line.

Why a file of its own: the check's warnings went to stderr only, said once per cause, and were
gone with the terminal. Here every judged step leaves a row, so the file also says that the check
ran (and on which steps it compared the weights), and ``python -m rlcore.inspect`` marks the steps
that warned. Rows::

    {"step": 6, "kind": "verdict", "cause": "ok", "message": "", "numbers": {check/* of the step}, "tensors": []}
    {"step": 7, "kind": "warning", "cause": "weights_partial", "message": "...", "numbers": {...},
     "tensors": ["model.layers.1.mlp.up_proj.weight", ...]}
    {"step": 7, "kind": "verdict", "cause": "weights_partial", "message": "...", "numbers": {...}, "tensors": []}
    {"step": 1, "kind": "info", "cause": "weights_unreadable", "message": "...", "numbers": {}, "tensors": [...]}

kind ``verdict``: one per judged step (a step whose update scored sampled tokens), ``cause`` "ok"
or the step's likely cause (``rlcore.trainer.consistency.diagnose``'s keys) with its warning's
message; ``warning``: each time a measure leaves its band (every step it happens, while stderr
says it once per cause); ``info``: the check's once-said notes (weight checksums off, tensors that
cannot be read back).

Each row is one ``os.write`` of a whole line to a file opened with O_APPEND: a reader (the
inspector on a live run) sees whole rows or, at worst, one last line still being written, never two
rows mixed. A resumed run keeps the rows of the steps up to its checkpoint and drops the later
ones, which it runs again (as metrics.jsonl); a fresh run in the folder starts the file anew.

No torch here: the inspector imports ``CHECK_FILE`` without the trainer's dependencies.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.trainer.jsonl_rows import truncate_jsonl_after

CHECK_FILE = "check.jsonl"
KINDS = ("verdict", "warning", "info")
OK = "ok"
NUMBER_PREFIX = "check/"  # the numbers a row carries: the step's check/* metrics


def _number(value: Any) -> float | None:
    """A metric as JSON can hold it: non-finite floats (which JSON has not) as null."""
    value = float(value)
    return value if math.isfinite(value) else None


def check_numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(NUMBER_PREFIX) and isinstance(v, (int, float))}


def judged(enabled: bool, metrics: Mapping[str, Any]) -> bool:
    """Whether the check judged a step with these metrics: on, and the update scored sampled tokens
    (``check/tokens``; an SFT or reward-model step has none, and nothing was to be synced)."""
    return enabled and "check/tokens" in metrics


class VerdictLog:
    """Writes ``<folder>/check.jsonl`` (module docstring). ``start_step``: the step a resumed run
    continues after (0: a fresh run); the rows of later steps are dropped at once.

    The consistency check calls ``warning`` and ``info`` (its ``record`` hook); the run calls
    ``verdict`` after the check judged a step, which closes that step with "ok" or the cause of the
    step's last warning."""

    def __init__(self, folder: Path, start_step: int = 0) -> None:
        self.path = Path(folder) / CHECK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a resumed run redoes the steps after its checkpoint; a killed run may have cut its last row short
        truncate_jsonl_after(self.path, start_step if start_step > 0 else -1, partial_last_line=True)
        self._causes: dict[int, tuple[str, str]] = {}  # step -> its last warning's (cause, message), until its verdict
        self._numbers: tuple[int, dict] = (-1, {})  # the step being judged and its check/* numbers

    def write(self, step: int, kind: str, cause: str, message: str = "", numbers: Mapping[str, Any] | None = None,
              tensors: Sequence[str] = ()) -> dict:
        """Append one row; returns it."""
        if kind not in KINDS:
            raise ValueError(f"a check row's kind must be one of {KINDS}, got {kind!r}")
        row = {"step": int(step), "kind": kind, "cause": str(cause), "message": str(message),
               "numbers": {k: _number(v) for k, v in (numbers or {}).items()}, "tensors": [str(t) for t in tensors]}
        data = (json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write of the whole line: appended whole (O_APPEND)
        finally:
            os.close(fd)
        return row

    # the consistency check's hook
    def warning(self, step: int, cause: str, message: str, tensors: Sequence[str] = ()) -> None:
        """A measure out of its band at ``step``; written at once (a strict run raises right after)."""
        self._causes[step] = (cause, message)
        numbers = self._numbers[1] if self._numbers[0] == step else {}
        self.write(step, "warning", cause, message, numbers, tensors)

    def info(self, step: int, cause: str, message: str, tensors: Sequence[str] = ()) -> None:
        self.write(step, "info", cause, message, None, tensors)

    # the run's
    def begin(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Before the check judges ``step``: its check/* numbers, for the rows the step writes."""
        self._numbers = (step, check_numbers(metrics))

    def verdict(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """The step's verdict row: the cause and message of its last warning, else "ok"; with the step's
        check/* numbers (those the check added, e.g. check/weights_*, included)."""
        cause, message = self._causes.pop(step, (OK, ""))
        return self.write(step, "verdict", cause, message, check_numbers(metrics))
