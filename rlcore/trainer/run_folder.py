"""A run folder is one run's: claimed (locked) for the run's life, refused when another run holds it.

``<trainer.output_dir>/<trainer.project>/<trainer.run_name>/`` holds a run's records (see
``rlcore.trainer.loop``). A second live run in it fails at once, naming the holder's pid (the lock,
``run.lock``, is an ``flock`` that goes with the process, however it ends). A folder holding an
earlier run's records is refused too, since new rows would be appended to the old ones, unless
``trainer.resume`` continues that run or ``trainer.overwrite=true`` deletes its records first.

``check_run_folder`` asks the same questions without keeping the lock or deleting anything: the
pre-flight (``rlcore.trainer.preflight``) asks them before any worker starts, ``claim_run_folder``
again when the run takes the folder.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from rlcore.errors import UserError
from rlcore.trainer.run_checkpoint import HF_DIR
from rlcore.trainer.trajectory_files import TRAJECTORY_DIR
from rlcore.trainer.verdicts import CHECK_FILE

LOCK_FILE = "run.lock"
RUN_RECORDS = ("metrics.jsonl", "tensorboard", "checkpoints", HF_DIR, "wandb", "mlruns", TRAJECTORY_DIR,
               CHECK_FILE)  # what a run leaves


class RunFolderError(UserError, RuntimeError):
    """The run folder is in use by a live run, or holds another run's records."""


def _lock(folder: Path, mode: str = "a+") -> IO:
    """The folder's lock file, locked by this process; RunFolderError naming the holder's pid if live.
    Mode ``r`` opens an existing lock file only (a check that leaves nothing behind)."""
    if mode != "r":
        folder.mkdir(parents=True, exist_ok=True)
    lock = open(folder / LOCK_FILE, mode)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise RunFolderError(f"run folder {folder} is in use by a live run (pid {holder}): two runs cannot share "
                             "a folder; give this one another trainer.run_name") from None
    return lock


def _records(folder: Path, resume: str, overwrite: bool) -> list[str]:
    """The earlier run's records this run may replace (none unless overwrite); RunFolderError otherwise."""
    found = [name for name in RUN_RECORDS if (folder / name).exists()]
    if found and resume == "disable" and not overwrite:
        raise RunFolderError(f"run folder {folder} holds another run ({', '.join(found)}): set trainer.resume=auto "
                             "to continue it, trainer.overwrite=true to replace it, or another trainer.run_name")
    return found if resume == "disable" else []


def check_run_folder(folder: Path, resume: str, overwrite: bool) -> None:
    """Raise RunFolderError now if ``claim_run_folder`` would; keeps no lock, creates and deletes nothing."""
    if not (folder / LOCK_FILE).is_file():
        if folder.is_dir():
            _records(folder, resume, overwrite)
        return
    lock = _lock(folder, "r")
    try:
        _records(folder, resume, overwrite)
    finally:
        lock.close()


def claim_run_folder(folder: Path, resume: str, overwrite: bool) -> IO:
    """Lock ``folder`` for this run and check it holds no other run (module docstring). Returns the
    open lock file: closing it (or the process ending) releases the folder."""
    lock = _lock(folder)
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    try:
        doomed = _records(folder, resume, overwrite)
    except RunFolderError:
        lock.close()
        raise
    for name in doomed:
        path = folder / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return lock
