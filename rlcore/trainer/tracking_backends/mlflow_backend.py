"""MLflow: one run per Tracker in a file store under the run folder by default; completion tables
as JSON artifacts."""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.trainer.tracking_backends import flatten, import_optional

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


def table_artifact(name: str, step: int) -> str:
    """Where a completion table goes in the run's artifacts: one file per logged step."""
    return f"{mlflow_key(name)}/step_{step:06d}.json"


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


class MlflowBackend:
    """One MLflow run per Tracker: experiment = trainer.project, run name = trainer.run_name, the
    resolved config as params (flattened, `actor.lr`) and as the artifact `config.json`.

    The store is MLFLOW_TRACKING_URI when set, else a file store in `<log_dir>/mlruns` (MLflow 3
    keeps file stores behind MLFLOW_ALLOW_FILE_STORE, which this sets unless the user set it). A
    client of its own, not mlflow's global active run, so two Trackers in a process do not mix.
    Remote servers are reached with MLflow's own HTTP timeout (MLFLOW_HTTP_REQUEST_TIMEOUT, 120 s).

    A completion table is the artifact `<name>/step_<step:06d>.json`, `{"columns": [...], "data":
    [[...], ...]}`: the layout `MlflowClient.log_table` writes (pandas' "split" JSON), without needing
    pandas, which mlflow-skinny does not install, and one file per step instead of one file
    downloaded, extended and uploaded again at every step.
    """

    def __init__(self, project: str, experiment: str, log_dir: Path, config: dict[str, Any]) -> None:
        tracking = import_optional("mlflow.tracking", "mlflow")
        self.entities = import_optional("mlflow.entities", "mlflow")
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (log_dir / "mlruns").resolve().as_uri()
        if self.tracking_uri.startswith("file:") or "://" not in self.tracking_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        self.metric_name = _KeyMap("metric")
        self.run_id = self.client.create_run(self._experiment_id(project), run_name=experiment).info.run_id
        if config:
            param_name = _KeyMap("param")
            params = [self.entities.Param(param_name(k), str(v)) for k, v in flatten(config).items()]
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

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        table = {"columns": list(columns), "data": [list(r) for r in rows]}
        self.client.log_dict(self.run_id, table, table_artifact(name, step))

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
