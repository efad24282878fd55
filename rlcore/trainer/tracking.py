"""Metric logging to several backends at once, plus reading back and plotting the JSONL log.

The JSONL file is the record we rely on (plots in the README come from it); it is opened in append
mode so a resumed run continues the same file. A run resumed from step S should first call
`truncate_jsonl_after(path, S)`: the interrupted run may have logged steps after its last
checkpoint, and those steps are about to be run again.

wandb and mlflow are optional: when not installed, the backend is skipped with a warning, because
losing a dashboard should never stop a training run.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


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

    def close(self) -> None:
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

    def close(self) -> None:
        self.file.close()


class _TensorBoard:
    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional dependency (the tensorboard package)

        self.writer = SummaryWriter(log_dir=str(log_dir))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str)
                                 + "\n```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, wandb: Any, project: str, experiment: str, log_dir: Path,
                 config: dict[str, Any]) -> None:
        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, dir=str(log_dir), config=config)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, mlflow: Any, project: str, experiment: str, config: dict[str, Any]) -> None:
        self.mlflow = mlflow
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=experiment)
        if config:
            mlflow.log_params({k: str(v) for k, v in _flatten(config).items()})

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics(dict(metrics), step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Tracker:
    """Log a dict of scalar metrics per step to every chosen backend.

    Files go under `log_dir`: `metrics.jsonl` and `tensorboard/`. `console_keys` picks the keys
    printed on the console line (default: all). `total_steps` adds a tqdm progress bar.
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
        for name in dict.fromkeys(backends):  # drop duplicates, keep order
            if name == "console":
                self.backends[name] = _Console(console_keys, total_steps)
            elif name == "jsonl":
                self.backends[name] = _Jsonl(self.jsonl_path)
            elif name == "tensorboard":
                self.backends[name] = _TensorBoard(self.log_dir / "tensorboard", config)
            else:
                try:
                    module = __import__(name)
                except ImportError:
                    warnings.warn(f"tracking backend {name!r} skipped: `import {name}` failed "
                                  f"(pip install {name} to enable it)", stacklevel=2)
                    continue
                if name == "wandb":
                    self.backends[name] = _Wandb(module, project, experiment, self.log_dir, config)
                else:
                    self.backends[name] = _Mlflow(module, project, experiment, config)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        values = {k: _scalar(k, v) for k, v in metrics.items()}
        for backend in self.backends.values():
            backend.log(values, step)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends = {}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
