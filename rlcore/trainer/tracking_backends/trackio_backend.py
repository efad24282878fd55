"""trackio (Hugging Face's local-first tracker): one run per Tracker in a SQLite file under the run
folder; completion tables as ``trackio.Table``. Local only: no Space, no server, no Hub call.

trackio fixes its folder when it is first imported (``TRACKIO_DIR``, read once into module
constants), so the folder is per process: the first Tracker to open trackio in a process sets
``TRACKIO_DIR`` to ``<run>/trackio`` (unless the user set it) before the import; a later run in the
same process logs into that same folder (a warning says where). See the dashboard with
``TRACKIO_DIR=<run>/trackio trackio show``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.trainer.tracking_backends import import_optional

REMOTE_VARIABLES = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")  # what would send trackio's records elsewhere


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Hugging Face Hub requests refused for the block. ``trackio.init`` labels a run with the Hub user
    name, asked of huggingface.co (``whoami``) whenever an HF token exists, over a client without a
    timeout; a local log needs neither the name nor the call, so it gets None instead. The switch is
    process-wide for that moment: a run opens its trackers at start, before its producer threads and
    requests of its own."""
    constants = import_optional("huggingface_hub.constants", "trackio")
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


class TrackioBackend:
    """One trackio run: project = trainer.project, name = trainer.run_name, config = the resolved config;
    no CPU/GPU monitor threads (our metrics are the run's)."""

    def __init__(self, project: str, experiment: str, log_dir: Path, config: dict[str, Any]) -> None:
        remote = [v for v in REMOTE_VARIABLES if os.environ.get(v)]
        if remote:
            raise ValueError(f"tracking backend 'trackio' logs locally, under the run folder, but {remote[0]} is set: "
                             "unset it (publish the local records later with `trackio sync`)")
        own, chosen = (log_dir / "trackio").resolve(), os.environ.get("TRACKIO_DIR")
        if "trackio.utils" not in sys.modules and not chosen:
            os.environ["TRACKIO_DIR"] = str(own)  # read once, at the import below; not left set for other runs
            try:
                self.trackio = import_optional("trackio", "trackio")
            finally:
                del os.environ["TRACKIO_DIR"]
        else:
            self.trackio = import_optional("trackio", "trackio")
        self.dir = Path(self.trackio.utils.TRACKIO_DIR)
        if not chosen and self.dir != own:
            warnings.warn(f"trackio: this process imported trackio for an earlier run, so this run's records go to "
                          f"{self.dir} (project {project!r}, run {experiment!r})", stacklevel=2)
        with _hub_offline():
            self.run = self.trackio.init(project=project, name=experiment, config=config, embed=False,
                                         auto_log_cpu=False, auto_log_gpu=False)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        self.run.log({name: self.trackio.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def close(self, failed: bool = False) -> None:
        """trackio has no failed state for a run; ``finish`` writes what is queued (trackio waits at most
        30 s for its writer thread). The run stops being trackio's current one, so its exit hook does not finish it again."""
        try:
            self.run.finish()
        finally:
            current = self.trackio.context_vars.current_run
            if current.get() is self.run:
                current.set(None)
