"""The W&B and MLflow adapters against their real local backends, read back through the backends' own
records: MLflow's file store through `MlflowClient.get_metric_history`, W&B's offline run through
the records of its `run-<id>.wandb` file. Each must hold exactly the values and steps that
metrics.jsonl holds. Plus one tiny GRPO run logging to MLflow, and the error a missing package gives.
"""

import json
import math
import re
import struct
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.tracking import INSTALL_HINT, Tracker, mlflow_key, read_jsonl_metrics

try:  # not skipped when missing: scripts/setup.sh installs the extra, and a skip would hide a broken install
    import mlflow.tracking as mlflow_tracking
    import wandb.proto.wandb_internal_pb2 as wandb_pb
except ImportError as e:
    raise ImportError(f"these tests need the tracking extra ({e}): {INSTALL_HINT}, or bash scripts/setup.sh") from e

CONFIG = {"actor": {"lr": 1e-3, "betas": [0.9, 0.99]}, "trainer": {"project": "proj", "seed": None}}
# What a run logs: floats that must round-trip exactly, an int, a bool, a tensor, a skipped step, a
# key only at some steps, and keys MLflow refuses as they are (":" and "@", a doubled slash).
ROWS = [(0, {"val/reward_mean": 0.175, "val/acc@1": 0.25}),
        (1, {"actor/pg_loss": 1 / 3, "response_length/max": 4, "actor/clipped": True,
             "timing_s/gen": torch.tensor(0.0123456789), "perf:tokens//s": 1234.5}),
        (3, {"actor/pg_loss": -2.5e-7, "response_length/max": 2, "actor/clipped": False,
             "timing_s/gen": torch.tensor(7.0), "perf:tokens//s": 99.0, "val/acc@1": 1.0})]


def log_rows(tracker: Tracker) -> list[dict]:
    with tracker:
        for step, metrics in ROWS:
            tracker.log(metrics, step=step)
    return read_jsonl_metrics(tracker.jsonl_path)


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl rows as {key: [(step, value), ...]}, the shape a backend's history has."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step":
                out.setdefault(key, []).append((row["step"], value))
    return out


# ---------------------------------------------------------------------------------------- MLflow
def mlflow_series(client, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    return {k: [(m.step, m.value) for m in client.get_metric_history(run_id, mlflow_key(k))] for k in keys}


def the_run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    [run] = client.search_runs([exp.experiment_id])
    return run


def test_mlflow_key_keeps_accepted_names_and_fixes_refused_ones():
    assert mlflow_key("actor/pg_loss") == "actor/pg_loss"
    assert mlflow_key("a b-c.d_e") == "a b-c.d_e"
    assert mlflow_key("val/acc@1") == "val/acc_1"
    assert mlflow_key("perf:tokens//s") == "perf_tokens/s"
    assert mlflow_key("/a/./b/") == "a/_/b"
    assert mlflow_key("..x/..") == "_.x/__"
    assert mlflow_key("x" * 300) == "x" * 250


def test_mlflow_file_store_holds_the_logged_steps_values_config_and_names(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    rows = log_rows(Tracker(["jsonl", "mlflow"], project="proj", experiment="run-a", log_dir=tmp_path,
                            config=CONFIG))
    client = mlflow_tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = the_run(client, "proj")
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    expected = series(rows)
    assert expected["actor/pg_loss"] == [(1, 1 / 3), (3, -2.5e-7)]  # the jsonl itself, by hand
    assert expected["timing_s/gen"] == [(1, torch.tensor(0.0123456789).item()), (3, 7.0)]
    assert expected["actor/clipped"] == [(1, 1), (3, 0)]
    assert mlflow_series(client, run.info.run_id, expected) == expected
    assert run.data.params == {"actor.lr": "0.001", "actor.betas": "[0.9, 0.99]", "trainer.project": "proj",
                               "trainer.seed": "None"}
    [artifact] = client.list_artifacts(run.info.run_id)
    assert artifact.path == "config.json"
    local = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path / "download"))
    assert json.loads(Path(local).read_text()) == CONFIG


def test_a_run_ended_by_an_exception_is_marked_failed(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(RuntimeError, match="boom"):
        with Tracker(["mlflow"], project="proj", experiment="crashed", log_dir=tmp_path) as tracker:
            tracker.log({"loss": 1.0}, step=1)
            raise RuntimeError("boom")
    client = mlflow_tracking.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = the_run(client, "proj")
    assert run.info.run_name == "crashed" and run.info.status == "FAILED"


def test_mlflow_uses_the_users_tracking_uri_and_an_existing_experiment(tmp_path, monkeypatch):
    store = (tmp_path / "elsewhere").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    for name in ("first", "second"):
        with Tracker(["mlflow"], project="shared", experiment=name, log_dir=tmp_path / name) as tracker:
            tracker.log({"loss": 2.0}, step=7)
    assert not (tmp_path / "first" / "mlruns").exists()
    client = mlflow_tracking.MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["first", "second"]
    assert all([(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "loss")] == [(7, 2.0)]
               for r in runs)


def test_mlflow_refuses_two_keys_that_would_share_a_name(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with Tracker(["mlflow"], log_dir=tmp_path) as tracker:
        tracker.log({"acc@1": 0.5}, step=1)
        with pytest.raises(ValueError, match=r"'acc:1' and 'acc@1' would both be logged as 'acc_1'"):
            tracker.log({"acc:1": 0.5}, step=2)


# ------------------------------------------------------------------------------------------- W&B
def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file: after a 7-byte header (":W&B", magic, version) it is
    a LevelDB-format log: 32 KiB blocks of chunks (crc32c 4 bytes, length 2, type 1: full, first,
    middle, last), a record split across chunks where it crosses a block."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pos, pending = [], 7, b""
    block = 32 * 1024
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """No account, key or W&B folder of the user's: W&B's own folders go under tmp_path."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # were anything sent, it would go nowhere
    assert not wandb_children()


def test_wandb_offline_run_holds_the_logged_steps_values_and_config(tmp_path, offline_wandb):
    start = time.perf_counter()
    tracker = Tracker(["jsonl", "wandb"], project="proj", experiment="run-a", log_dir=tmp_path, config=CONFIG)
    run_dir = tracker.backends["wandb"].run_dir
    rows = log_rows(tracker)
    seconds = time.perf_counter() - start
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    [log] = run_dir.glob("run-*.wandb")
    records = wandb_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("proj", "run-a")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert {k: config[k] for k in CONFIG} == CONFIG
    logged: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    logged.setdefault(key, []).append((r.history.step.num, json.loads(item.value_json)))
    assert logged == series(rows)
    deadline = time.monotonic() + 10
    while wandb_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not wandb_children(), "wandb's service process outlived the Tracker"
    print(f"W&B offline: init + 3 steps + finish + teardown in {seconds:.2f} s")


# -------------------------------------------------------------------------------- missing packages
@pytest.mark.parametrize("backend, modules", [("wandb", ["wandb"]),
                                              ("mlflow", ["mlflow", "mlflow.tracking", "mlflow.entities"]),
                                              ("tensorboard", ["torch.utils.tensorboard"]),
                                              ("trackio", ["trackio"])])
def test_a_missing_package_is_an_error_naming_the_extra(tmp_path, monkeypatch, backend, modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(ImportError, match=rf"{backend!r}.*install the tracking extra: {re.escape(INSTALL_HINT)}$"):
        Tracker(["jsonl", backend], log_dir=tmp_path)
    (tmp_path / "metrics.jsonl").unlink()  # the jsonl backend opened first was closed, not leaked


# ------------------------------------------------------------------------------- a real recipe run
@pytest.mark.slow
def test_grpo_run_logs_the_same_metrics_to_mlflow_as_to_metrics_jsonl(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl,mlflow]", "trainer.total_steps=2",
                 "trainer.val_freq=1", "trainer.run_name=mlflow-check", "trainer.backend=local",
                 f"model.path={model}", "data.train_batch_size=4", "data.arithmetic.n_train=16",
                 "data.arithmetic.n_val=6", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=2",
                 "rollout.max_new_tokens=4", "trainer.completion_table.every=1"]
    with initialize_config_dir(config_dir=str(Path(recipes.grpo.__file__).parent / "config"), version_base=None):
        cfg = compose("grpo", overrides=overrides)
    run = recipes.grpo.train(cfg)
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    expected = series(rows)
    assert "actor/pg_loss" in expected and "val/reward_mean" in expected
    assert all(math.isfinite(v) for points in expected.values() for _, v in points)
    client = mlflow_tracking.MlflowClient(tracking_uri=(run.dir / "mlruns").as_uri())
    mlflow_run = the_run(client, cfg.trainer.project)
    assert mlflow_run.info.run_name == "mlflow-check" and mlflow_run.info.status == "FINISHED"
    assert mlflow_series(client, mlflow_run.info.run_id, expected) == expected
    params = mlflow_run.data.params
    assert params["trainer.loggers"] == "['jsonl', 'mlflow']" and params["model.path"] == model
    assert params["rollout.n"] == "2" and params["trainer.total_steps"] == "2"
    # the completion table of each step: rows (16) exceed the batch (4 prompts x 2), so it is the whole batch and
    # its rewards average to the step's reward/score/mean
    for row in rows[1:]:
        local = client.download_artifacts(mlflow_run.info.run_id, f"completions/step_{row['step']:06d}.json",
                                          str(tmp_path / "tables"))
        table = json.loads(Path(local).read_text())
        assert table["columns"] == ["step", "data_source", "policy_version", "prompt", "response", "reward", "advantage"]
        cells = [dict(zip(table["columns"], r)) for r in table["data"]]
        assert len(cells) == 8 and {(c["step"], c["policy_version"]) for c in cells} == {(row["step"], row["step"] - 1)}
        assert all(c["prompt"] and c["data_source"] for c in cells)
        assert math.isclose(sum(c["reward"] for c in cells) / 8, row["reward/score/mean"], rel_tol=1e-6)
