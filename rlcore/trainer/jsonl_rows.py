"""Rows of a run's JSONL files (metrics.jsonl, check.jsonl): read them, and cut them back to a step when
a run resumes. Standard library only, so that the inspector (which reads a run folder) and the check's
verdict file can use it without the trainer's torch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Metrics that measure the machine, not the run: time, throughput, memory. Everything else a run logs
# is a function of its config and seeds, so a resumed run logs it equal to an uninterrupted one.
MACHINE_METRICS = ("timing_s/", "throughput/", "rollout/gen_time_s", "rollout/tokens_per_s", "memory/")


def without_machine_metrics(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the keys of ``MACHINE_METRICS``: what two runs of the same config must log alike."""
    return [{k: v for k, v in row.items() if not k.startswith(MACHINE_METRICS)} for row in rows]


def _parse(path: Path, partial_last_line: bool) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSONL file and how many non-blank lines it has. With ``partial_last_line``
    a last line that does not parse (being written by a live run, or cut short by a kill) is left
    out; any other bad line, or one that is not an object, is an error naming the file and line."""
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if line.strip()]
    rows = []
    for position, (line_no, line) in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if partial_last_line and position == len(lines):
                break
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows, len(lines)


def read_jsonl_metrics(path: str | Path, partial_last_line: bool = False) -> list[dict[str, Any]]:
    """All rows of a metrics JSONL file, in file order (a half-written last line left out with
    ``partial_last_line``: a run that is still going)."""
    return _parse(Path(path), partial_last_line)[0]


def truncate_jsonl_after(path: str | Path, step: int, partial_last_line: bool = False) -> int:
    """Drop rows with "step" > `step` (rewritten atomically); returns how many were dropped.

    A missing file is fine (nothing was logged yet) and drops nothing. With ``partial_last_line``
    a last line that does not parse (a write cut short by a kill, in a file written line by line
    while the run goes: the check's verdicts) is dropped too; any other bad line is an error.
    """
    path = Path(path)
    if not path.exists():
        return 0
    rows, line_count = _parse(path, partial_last_line)
    kept = [r for r in rows if r["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return line_count - len(kept)
