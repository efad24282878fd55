"""Where a run's trajectory sample lives: ``<run>/trajectories/step_<step:06d>.jsonl``.

Apart from the writer (``rlcore.trainer.trajectories``, which needs torch and a tokenizer) so that
the inspector, which only reads the files, starts without importing either.
"""

from __future__ import annotations

from pathlib import Path

TRAJECTORY_DIR = "trajectories"
ENV_VERSION = -1  # a record's "versions" value on env / tool tokens (token_versions' in rlcore.agentic.episode)


def step_file(folder: Path, step: int) -> Path:
    return folder / f"step_{step:06d}.jsonl"


def file_step(path: Path) -> int | None:
    """The step of a ``step_<n>.jsonl`` file name, None for any other name."""
    stem = path.stem
    if path.suffix != ".jsonl" or not stem.startswith("step_") or not stem[5:].isdigit():
        return None
    return int(stem[5:])
