"""The driver's own checkpoint: step, dataloader position, controller states and RNG states.

Model and optimizer weights are saved by the workers into the same `global_step_{N}/` folder;
this module writes the driver's part, `trainer_state.pt`, and writes it LAST. Its presence is the
marker that step N is complete: a folder without it is a save that crashed midway (or is still
being written) and is never resumed from. The file itself appears atomically (written to a
temporary name, then renamed), so it is either absent or whole.

Layout:
    ckpt_dir/
        latest_checkpointed_step.txt     "N" of the newest complete checkpoint (for humans/tools)
        global_step_N/
            trainer_state.pt             this module's dict
            actor/ critic/ ...           written by the workers
            hf/                          the policy (or trained reward model) as a HF model directory, with
                                         trainer.export_hf (TrainingRun); python -m rlcore.trainer.export
                                         writes it for a checkpoint without one

`trainer_state.pt` is a pickle (numpy RNG state, arbitrary controller dicts): load only
checkpoints your own runs wrote.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest_checkpointed_step.txt"
HF_DIR = "hf"  # a HF model directory: in a step folder (that step's weights) and in the run folder (the last)
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU, and CUDA when present) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Undo `capture_rng_state`: the next random draws repeat those after the capture."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write(path: Path, write: Any) -> None:
    """``write(tmp)`` then rename to ``path``. A failure leaves no partial file and names the file and the
    cause: torch's own message ("unexpected pos ...", "file write failed") names neither."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(f"writing checkpoint {path} failed: {type(exc).__name__}: {exc} (disk full?)") from exc


def save_run_state(ckpt_dir: str | Path, step: int, state: dict[str, Any], rng: dict[str, Any] | None = None) -> Path:
    """Write `state` plus "global_step" and "rng" (`rng`, or the generators' states now) to
    global_step_{step}/trainer_state.pt.

    Call after the workers have saved their weights for this step. Returns the step folder.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    reserved = {"global_step", "rng"} & state.keys()
    if reserved:
        raise ValueError(f"state keys {sorted(reserved)} are reserved: save_run_state adds them")
    step_dir = Path(ckpt_dir) / f"global_step_{step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    payload = {**state, "global_step": step, "rng": capture_rng_state() if rng is None else rng}
    _atomic_write(step_dir / STATE_FILE, lambda p: torch.save(payload, p))
    _atomic_write(Path(ckpt_dir) / LATEST_FILE, lambda p: p.write_text(f"{step}\n"))
    return step_dir


def _complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for child in ckpt_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def find_latest_checkpoint(ckpt_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint as (step, folder), or None.

    Found by scanning for the marker rather than trusting latest_checkpointed_step.txt, which a
    crash between the two writes of `save_run_state` could leave one step behind.
    """
    found = _complete_checkpoints(Path(ckpt_dir))
    return found[-1] if found else None


def load_run_state(path: str | Path) -> dict[str, Any]:
    """Read a trainer state from a step folder or the trainer_state.pt file itself.

    RNG states are returned, not applied: call `restore_rng_state(state["rng"])` when ready.
    """
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no {STATE_FILE} at {path}: not a complete checkpoint")
    return torch.load(file, map_location="cpu", weights_only=False)


def resolve_resume(resume_mode: str | Path, ckpt_dir: str | Path) -> tuple[int, Path] | None:
    """Which checkpoint to resume from: "disable" -> None, "auto" -> the latest complete one
    (None when there is none), anything else is a path to a step folder or its trainer_state.pt.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return find_latest_checkpoint(ckpt_dir)
    path = Path(resume_mode)
    step_dir = path.parent if path.name == STATE_FILE else path
    if not (step_dir / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume path {resume_mode!r} is not a complete checkpoint (no "
                                f"{STATE_FILE}); resume_mode must be 'disable', 'auto' or a path")
    match = _STEP_DIR.match(step_dir.name)
    if not match:
        raise ValueError(f"resume path {resume_mode!r}: folder name {step_dir.name!r} is not "
                         f"global_step_<N>")
    return int(match.group(1)), step_dir


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints; returns the deleted steps.

    Incomplete folders are left alone: one newer than the latest may be a save in progress.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    found = _complete_checkpoints(Path(ckpt_dir))
    doomed = found[:-keep_last]
    for _, folder in doomed:
        (folder / STATE_FILE).unlink()  # unmark first: a crash mid-delete leaves no false marker
        shutil.rmtree(folder)
    return [step for step, _ in doomed]
