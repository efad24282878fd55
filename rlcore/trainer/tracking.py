"""Metric logging to several backends at once, plus reading back and plotting the JSONL log.

The JSONL file is the record we rely on (plots in the README come from it); it is opened in append
mode so a resumed run continues the same file. A run resumed from step S should first call
`truncate_jsonl_after(path, S)`: the interrupted run may have logged steps after its last
checkpoint, and those steps are about to be run again.

tensorboard, wandb, mlflow and trackio are optional (the `tracking` extra: `pip install -e ".[tracking]"`),
one module each in `rlcore.trainer.tracking_backends`. A backend listed in `trainer.loggers` whose
package is missing fails the run at start with an error naming that extra: silently skipping it
would lose the records the user asked for.

W&B, MLflow and trackio default to local records under the run folder, so nothing needs a network,
an account or a login: W&B runs in offline mode (unless WANDB_MODE says otherwise) in `<run>/wandb/`,
synced later with `wandb sync`; MLflow writes a file store in `<run>/mlruns/` (unless
MLFLOW_TRACKING_URI names another store); trackio writes SQLite in `<run>/trackio/` (local only).
Every call that could wait on a service has a timeout. Besides scalars, the backends that can show
one take a table (`Tracker.log_table`: the completion table, `rlcore.trainer.completion_table`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rlcore.trainer.jsonl_rows import read_jsonl_metrics, truncate_jsonl_after  # noqa: F401 (re-exported)
from rlcore.trainer.tracking_backends import INSTALL_HINT  # noqa: F401 (re-exported: the extra's install line)
from rlcore.trainer.tracking_backends.mlflow_backend import MlflowBackend, mlflow_key  # noqa: F401 (re-exported)
from rlcore.trainer.tracking_backends.tensorboard_backend import TensorBoardBackend
from rlcore.trainer.tracking_backends.trackio_backend import TrackioBackend
from rlcore.trainer.tracking_backends.wandb_backend import WandbBackend

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "trackio")
TABLE_BACKENDS = ("tensorboard", "wandb", "mlflow", "trackio")  # the ones that show a completion table


def _scalar(key: str, value: Any) -> float | int:
    """A Python number from an int/float/bool, numpy scalar or one-element array/tensor."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    raise ValueError(f"metric {key!r} must be a scalar number, got {value!r}")


def _plain_config(config: Any) -> dict[str, Any]:
    """An OmegaConf/Hydra config or mapping as a plain dict (what every backend can store)."""
    if config is None:
        return {}
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True)
    if isinstance(config, Mapping):
        return dict(config)
    raise ValueError(f"config must be a mapping or an OmegaConf DictConfig, got "
                     f"{type(config).__name__}")


class _Console:
    """One line per step: `step 3 | reward=0.5 | loss=1.234`, with an optional tqdm bar."""

    def __init__(self, keys: Sequence[str] | None, total_steps: int | None) -> None:
        self.keys = list(keys) if keys is not None else None
        self.bar = None
        if total_steps is not None:
            self.bar = tqdm(total=total_steps, desc="training", file=sys.stderr, dynamic_ncols=True)

    def format(self, metrics: Mapping[str, float], step: int) -> str:
        keys = self.keys if self.keys is not None else list(metrics)
        parts = [f"{k}={metrics[k]:.4g}" for k in keys if k in metrics]
        return " | ".join([f"step {step}", *parts])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        line = self.format(metrics, step)
        if self.bar is None:
            print(line, flush=True)
            return
        self.bar.write(line, file=sys.stdout)
        self.bar.update(max(0, step - self.bar.n))

    def close(self, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()


class _Jsonl:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        # json writes NaN/inf as bare tokens, which Python's json reads back.
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()  # a crash loses at most the line being written

    def close(self, failed: bool = False) -> None:
        self.file.close()


class Tracker:
    """Log a dict of scalar metrics per step to every chosen backend.

    Files go under `log_dir`: `metrics.jsonl`, `tensorboard/`, `wandb/` (offline W&B runs),
    `mlruns/` (the MLflow file store) and `trackio/` (trackio's SQLite). `project` and `experiment` name the W&B project and run, the
    MLflow experiment and run; `config` (resolved) is logged as their config / params. Each backend
    gets the step as given. `console_keys` picks the keys printed on the console line (default: all).
    `total_steps` adds a tqdm progress bar.
    """

    def __init__(
        self,
        backends: Sequence[str] = ("console", "jsonl"),
        project: str = "rlcore",
        experiment: str = "run",
        log_dir: str | Path = "logs",
        config: Any = None,
        total_steps: int | None = None,
        console_keys: Sequence[str] | None = None,
    ) -> None:
        if isinstance(backends, str):
            backends = [backends]
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"unknown tracking backend {unknown[0]!r}; choose from {BACKENDS}")
        self.log_dir = Path(log_dir)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        config = _plain_config(config)
        self.backends: dict[str, Any] = {}
        try:
            self._open(list(dict.fromkeys(backends)), project, experiment, config, total_steps, console_keys)
        except BaseException:
            self.close()  # the backends opened before the one that failed
            raise

    def _open(self, backends: list[str], project: str, experiment: str, config: dict[str, Any],
              total_steps: int | None, console_keys: Sequence[str] | None) -> None:
        for name in backends:  # duplicates dropped, order kept
            if name == "console":
                self.backends[name] = _Console(console_keys, total_steps)
            elif name == "jsonl":
                self.backends[name] = _Jsonl(self.jsonl_path)
            elif name == "tensorboard":
                self.backends[name] = TensorBoardBackend(self.log_dir / "tensorboard", config)
            elif name == "wandb":
                self.backends[name] = WandbBackend(project, experiment, self.log_dir, config)
            elif name == "mlflow":
                self.backends[name] = MlflowBackend(project, experiment, self.log_dir, config)
            else:
                self.backends[name] = TrackioBackend(project, experiment, self.log_dir, config)

    @property
    def shows_tables(self) -> bool:
        """Whether a backend shows completion tables (else ``log_table`` is not worth a table's making)."""
        return any(name in TABLE_BACKENDS for name in self.backends)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        for backend in self.backends.values():
            backend.log(values, step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        """A table (``columns``, ``rows`` of str / number / None cells) at ``step`` to every backend that
        shows tables (TABLE_BACKENDS): a W&B / trackio Table, TensorBoard markdown text, an MLflow JSON
        artifact. The console and metrics.jsonl leave it out (the inspector reads <run>/trajectories/)."""
        width = len(columns)
        for i, row in enumerate(rows):
            if len(row) != width:
                raise ValueError(f"table {name!r}: row {i} has {len(row)} cells for {width} columns")
        for key, backend in self.backends.items():
            if key in TABLE_BACKENDS:
                backend.log_table(name, columns, rows, step)

    def close(self, failed: bool = False) -> None:
        """Close every backend, even when one fails (the first failure is raised after). ``failed``:
        the run ended by an exception, which W&B and MLflow record as the run's state."""
        backends, self.backends = self.backends, {}
        failure = None
        for backend in backends.values():
            try:
                backend.close(failed)
            except Exception as e:
                failure = failure or e
        if failure is not None:
            raise failure

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def plot_metric(jsonl_path: str | Path, key: str, out_png: str | Path,
                title: str | None = None) -> Path:
    """Plot `key` against step from a metrics JSONL file into a PNG (no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional dependency: plots only
    from matplotlib.figure import Figure

    rows = read_jsonl_metrics(jsonl_path)
    points = [(r["step"], r[key]) for r in rows if key in r and not
              (isinstance(r[key], float) and math.isnan(r[key]))]
    if not points:
        present = sorted({k for r in rows for k in r} - {"step"})
        raise ValueError(f"metric {key!r} not found in {jsonl_path}; metrics present: {present}")
    steps, values = zip(*points)
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas; no global pyplot backend involved
    ax = fig.add_subplot()
    ax.plot(steps, values, marker="." if len(points) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title if title is not None else key)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    return out_png
