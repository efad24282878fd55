"""Weights & Biases: one run per Tracker, offline by default; completion tables as ``wandb.Table``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.trainer.tracking_backends import import_optional

# W&B's blocking calls and their limits (seconds): starting its service process, `wandb.init`, an
# online login, and `finish` uploading the rest (offline data stays on disk for `wandb sync`).
WANDB_TIMEOUTS_S = {"x_service_wait": 30.0, "init_timeout": 90.0, "login_timeout": 30.0, "finish_timeout": 120.0}


class WandbBackend:
    """One W&B run per Tracker: project = trainer.project, name = trainer.run_name, config = the
    resolved config. Offline unless WANDB_MODE is set; files under `<log_dir>/wandb/`. A completion
    table is a `wandb.Table` logged at its step (offline: `files/media/table/<name>_<step>_<hash>.table.json`).

    W&B runs a service process (wandb-core) for the whole Python process; it is stopped
    (`wandb.teardown`) when the last run opened here closes, so no process outlives the run.
    """

    open_runs = 0  # W&B runs opened by Trackers in this process and not closed yet

    def __init__(self, project: str, experiment: str, log_dir: Path, config: dict[str, Any]) -> None:
        self.wandb = import_optional("wandb", "wandb")
        mode = os.environ.get("WANDB_MODE") or "offline"
        log_dir.mkdir(parents=True, exist_ok=True)
        settings = self.wandb.Settings(console="off", **WANDB_TIMEOUTS_S)  # our console line is the console log
        try:
            self.run = self.wandb.init(project=project, name=experiment, dir=str(log_dir), config=config,
                                       mode=mode, reinit="create_new", settings=settings)
        except BaseException:
            if WandbBackend.open_runs == 0:
                self.wandb.teardown()  # the service it may have started
            raise
        WandbBackend.open_runs += 1
        self.run_dir = Path(self.run.dir).parent  # <log_dir>/wandb/<offline-run-...>: the run's files

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        # mixed types: a reward component may be a number in one row and text in another
        table = self.wandb.Table(columns=list(columns), data=[list(r) for r in rows], allow_mixed_types=True)
        self.run.log({name: table}, step=step)

    def close(self, failed: bool = False) -> None:
        try:
            self.run.finish(exit_code=1 if failed else 0)  # a crashed run shows as failed
        finally:
            WandbBackend.open_runs -= 1
            if WandbBackend.open_runs == 0:
                self.wandb.teardown()
