"""Metric logging to several backends at once, plus reading back and plotting the JSONL log.

The JSONL file is the record we rely on (plots in the README come from it); it is opened in append
mode so a resumed run continues the same file. A run resumed from step S should first call
`truncate_jsonl_after(path, S)`: the interrupted run may have logged steps after its last
checkpoint, and those steps are about to be run again.

tensorboard, wandb and mlflow are optional (the `tracking` extra: `pip install -e ".[tracking]"`).
A backend listed in `trainer.loggers` whose package is missing fails the run at start with an error
naming that extra: silently skipping it would lose the records the user asked for.

W&B and MLflow default to local records under the run folder, so nothing needs a network, an account
or a login: W&B runs in offline mode (unless WANDB_MODE says otherwise) in `<run>/wandb/`, synced
later with `wandb sync`; MLflow writes a file store in `<run>/mlruns/` (unless MLFLOW_TRACKING_URI
names another store). Every call that could wait on a service has a timeout.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
INSTALL_HINT = 'pip install -e ".[tracking]"'


def _import_optional(module: str, backend: str) -> Any:
    """`module`, or an ImportError that names the backend and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"tracking backend {backend!r} (in trainer.loggers) needs `{module}`, which failed to "
                          f"import ({e}); install the tracking extra: {INSTALL_HINT}") from e


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


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{name}."))
        else:
            out[name] = v
    return out


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


class _TensorBoard:
    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        tensorboard = _import_optional("torch.utils.tensorboard", "tensorboard")  # needs the tensorboard package
        self.writer = tensorboard.SummaryWriter(log_dir=str(log_dir))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str)
                                 + "\n```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


# W&B's blocking calls and their limits (seconds): starting its service process, `wandb.init`, an
# online login, and `finish` uploading the rest (offline data stays on disk for `wandb sync`).
WANDB_TIMEOUTS_S = {"x_service_wait": 30.0, "init_timeout": 90.0, "login_timeout": 30.0, "finish_timeout": 120.0}


class _Wandb:
    """One W&B run per Tracker: project = trainer.project, name = trainer.run_name, config = the
    resolved config. Offline unless WANDB_MODE is set; files under `<log_dir>/wandb/`.

    W&B runs a service process (wandb-core) for the whole Python process; it is stopped
    (`wandb.teardown`) when the last run opened here closes, so no process outlives the run.
    """

    open_runs = 0  # W&B runs opened by Trackers in this process and not closed yet

    def __init__(self, project: str, experiment: str, log_dir: Path, config: dict[str, Any]) -> None:
        self.wandb = _import_optional("wandb", "wandb")
        mode = os.environ.get("WANDB_MODE") or "offline"
        log_dir.mkdir(parents=True, exist_ok=True)
        settings = self.wandb.Settings(console="off", **WANDB_TIMEOUTS_S)  # our console line is the console log
        try:
            self.run = self.wandb.init(project=project, name=experiment, dir=str(log_dir), config=config,
                                       mode=mode, reinit="create_new", settings=settings)
        except BaseException:
            if _Wandb.open_runs == 0:
                self.wandb.teardown()  # the service it may have started
            raise
        _Wandb.open_runs += 1
        self.run_dir = Path(self.run.dir).parent  # <log_dir>/wandb/<offline-run-...>: the run's files

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, failed: bool = False) -> None:
        try:
            self.run.finish(exit_code=1 if failed else 0)  # a crashed run shows as failed
        finally:
            _Wandb.open_runs -= 1
            if _Wandb.open_runs == 0:
                self.wandb.teardown()


# MLflow refuses metric and param names with characters outside these (the colon it allows on POSIX
# only, so it is replaced too), names that a path normalisation would change ("a//b", "a/./b", "/a",
# "a/", "..x"), and names over 250 characters.
_MLFLOW_REFUSED_CHARS = re.compile(r"[^\w./\- ]")
MLFLOW_MAX_KEY_LENGTH = 250


def mlflow_key(key: str) -> str:
    """`key` as a name MLflow accepts: refused characters become `_`, empty path segments are
    dropped, `.`/`..` segments become underscores, cut at 250 characters. Accepted names are unchanged."""
    segments = [seg if seg.strip(".") else "_" * len(seg)
                for seg in _MLFLOW_REFUSED_CHARS.sub("_", key).split("/") if seg]
    name = "/".join(segments)[:MLFLOW_MAX_KEY_LENGTH].rstrip("/")
    if name.startswith(".."):
        name = "_" + name[1:]
    return name or "_"


class _KeyMap:
    """Our keys to a backend's names, remembered; two keys that would share a name are an error."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.names: dict[str, str] = {}
        self.owners: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        name = self.names.get(key)
        if name is None:
            name = mlflow_key(key)
            owner = self.owners.setdefault(name, key)
            if owner != key:
                raise ValueError(f"MLflow {self.what} {key!r} and {owner!r} would both be logged as {name!r} "
                                 "(MLflow refuses some characters in names): rename one of them")
            self.names[key] = name
        return name


class _Mlflow:
    """One MLflow run per Tracker: experiment = trainer.project, run name = trainer.run_name, the
    resolved config as params (flattened, `actor.lr`) and as the artifact `config.json`.

    The store is MLFLOW_TRACKING_URI when set, else a file store in `<log_dir>/mlruns` (MLflow 3
    keeps file stores behind MLFLOW_ALLOW_FILE_STORE, which this sets unless the user set it). A
    client of its own, not mlflow's global active run, so two Trackers in a process do not mix.
    Remote servers are reached with MLflow's own HTTP timeout (MLFLOW_HTTP_REQUEST_TIMEOUT, 120 s).
    """

    def __init__(self, project: str, experiment: str, log_dir: Path, config: dict[str, Any]) -> None:
        tracking = _import_optional("mlflow.tracking", "mlflow")
        self.entities = _import_optional("mlflow.entities", "mlflow")
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (log_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        self.metric_name = _KeyMap("metric")
        self.run_id = self.client.create_run(self._experiment_id(project), run_name=experiment).info.run_id
        if config:
            param_name = _KeyMap("param")
            params = [self.entities.Param(param_name(k), str(v)) for k, v in _flatten(config).items()]
            self.client.log_batch(self.run_id, params=params)
            try:
                self.client.log_dict(self.run_id, config, "config.json")
            except Exception as e:  # an artifact store the client cannot reach: the params still hold the config
                warnings.warn(f"MLflow: config.json not logged as an artifact ({e})", stacklevel=2)

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # created meanwhile by another run
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        ms = int(time.time() * 1000)
        rows = [self.entities.Metric(self.metric_name(k), float(v), ms, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=rows)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Tracker:
    """Log a dict of scalar metrics per step to every chosen backend.

    Files go under `log_dir`: `metrics.jsonl`, `tensorboard/`, `wandb/` (offline W&B runs) and
    `mlruns/` (the MLflow file store). `project` and `experiment` name the W&B project and run, the
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
                self.backends[name] = _TensorBoard(self.log_dir / "tensorboard", config)
            elif name == "wandb":
                self.backends[name] = _Wandb(project, experiment, self.log_dir, config)
            else:
                self.backends[name] = _Mlflow(project, experiment, self.log_dir, config)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        for backend in self.backends.values():
            backend.log(values, step)

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


def read_jsonl_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics JSONL file, in file order."""
    rows = []
    with Path(path).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from e
    return rows


def truncate_jsonl_after(path: str | Path, step: int) -> int:
    """Drop rows with "step" > `step` (rewritten atomically); returns how many were dropped.

    A missing file is fine (nothing was logged yet) and drops nothing.
    """
    path = Path(path)
    if not path.exists():
        return 0
    rows = read_jsonl_metrics(path)
    kept = [r for r in rows if r["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
    return len(rows) - len(kept)


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
