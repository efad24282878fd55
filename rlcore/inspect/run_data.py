"""What the inspector shows, read from a run folder: metrics.jsonl, trajectories/step_N.jsonl, config.yaml,
check.jsonl (the consistency check's verdicts: rlcore.trainer.verdicts).

Why a reader of its own: the page must open a run that is still going (the last line of a file
may be half written: it is left out) and hand the browser strict JSON (NaN and inf, which
metrics may hold, become null; the page shows them as gaps).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from rlcore.trainer.jsonl_rows import read_jsonl_metrics
from rlcore.trainer.trajectory_files import ENV_VERSION, TRAJECTORY_DIR, file_step
from rlcore.trainer.verdicts import CHECK_FILE

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
CONFIG_SHOWN = ("model.path", "algorithm.adv_estimator", "data.train_batch_size", "rollout.n", "rollout.backend",
                "actor.lr", "trainer.total_steps", "trainer.trajectory_groups", "env.name", "agent.path")


class RunFolderError(ValueError):
    """The folder is not a run folder, or one of its records is not valid JSON."""


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, in nested lists and dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [finite(v) for v in value]
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    return value


def read_records(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file, non-finite floats as None; a last line that does not parse
    is one being written and is left out, any other bad line is an error naming the file and line."""
    try:
        return [finite(record) for record in read_jsonl_metrics(path, partial_last_line=True)]
    except ValueError as exc:
        raise RunFolderError(str(exc)) from None


def config_summary(folder: Path) -> dict[str, Any]:
    """A few keys of the run's resolved config that tell runs apart (CONFIG_SHOWN), those it has."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return {}
    cfg = OmegaConf.load(path)
    found = {key: OmegaConf.select(cfg, key, default=None) for key in CONFIG_SHOWN}
    return {k: v for k, v in found.items() if v is not None and not OmegaConf.is_config(v)}


def trajectory_files(folder: Path) -> list[tuple[int, Path]]:
    """(step, file) of the run's trajectory sample, by step."""
    directory = folder / TRAJECTORY_DIR
    if not directory.is_dir():
        return []
    found = [(file_step(p), p) for p in directory.iterdir()]
    return sorted((step, p) for step, p in found if step is not None)


def sample_metrics(step: int, records: list[dict]) -> dict[str, Any]:
    """What the sample itself says of a step, over its policy tokens in the loss: the trainer's vs the
    sampler's log-prob (mean and max |diff|, when both are there) and the version lag (step's policy
    minus the token's). A curve even for a run that logs no ``check/*`` keys; only the sample's rows."""
    diffs, lags = [], []
    for r in records:
        sampler, trainer = r.get("sampler_logprob"), r.get("trainer_logprob")
        version = r.get("policy_version")
        for j, (m, v) in enumerate(zip(r.get("mask") or [], r.get("versions") or [])):
            if not m or v == ENV_VERSION:
                continue
            if sampler and trainer and sampler[j] is not None and trainer[j] is not None:
                diffs.append(abs(trainer[j] - sampler[j]))
            if isinstance(version, int):
                lags.append(version - v)
    out: dict[str, Any] = {"step": step}
    if diffs:
        out["sample/logprob_abs_diff_mean"] = sum(diffs) / len(diffs)
        out["sample/logprob_abs_diff_max"] = max(diffs)
    if lags:
        out["sample/version_lag_mean"] = sum(lags) / len(lags)
    return out


def load_run(folder: str | Path, last: int | None = None) -> dict[str, Any]:
    """The page's data: ``{"run", "folder", "config", "metrics": [row], "sample_metrics": [row], "checks":
    [row], "steps": [{"step", "records"}]}``, the trajectory sample of the ``last`` steps (all when None);
    sample_metrics (``sample_metrics``) cover every sampled step; checks: check.jsonl's rows, every
    step's (empty for a run from before the file, or with the check off). A folder with neither
    metrics nor trajectories is refused, naming what it lacks."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise RunFolderError(f"{folder} is not a directory: pass a run folder "
                             "(<trainer.output_dir>/<trainer.project>/<trainer.run_name>)")
    metrics_path = folder / METRICS_FILE
    files = trajectory_files(folder)
    if not metrics_path.is_file() and not files:
        raise RunFolderError(f"{folder} holds neither {METRICS_FILE} nor {TRAJECTORY_DIR}/step_*.jsonl: not a run "
                             "folder, or a run that has not finished a step yet (trainer.loggers needs jsonl for "
                             "the curves, trainer.trajectory_groups > 0 for the trajectories)")
    if last is not None and last < 1:
        raise ValueError(f"last must be >= 1 (steps of trajectories to show), got {last}")
    steps = [{"step": step, "records": read_records(path)} for step, path in files]
    checks_path = folder / CHECK_FILE
    return {
        "run": f"{folder.parent.name}/{folder.name}",  # <project>/<run_name>
        "folder": str(folder),
        "config": config_summary(folder),
        "metrics": read_records(metrics_path) if metrics_path.is_file() else [],
        "sample_metrics": [sample_metrics(s["step"], s["records"]) for s in steps],
        "checks": read_records(checks_path) if checks_path.is_file() else [],
        "steps": steps[-last:] if last is not None else steps,
    }
