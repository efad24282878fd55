import json

import numpy as np
import pytest
import torch

from rlcore.trainer.timing import Timer, throughput_metrics
from rlcore.trainer.tracking import (
    Tracker,
    plot_metric,
    read_jsonl_metrics,
    truncate_jsonl_after,
)


def test_console_line_has_selected_keys_with_4_significant_digits(tmp_path, capsys):
    with Tracker(["console"], log_dir=tmp_path, console_keys=["reward", "loss"]) as tracker:
        tracker.log({"reward": 0.123456, "loss": torch.tensor(12345.678), "lr": 1e-6}, step=3)
    assert capsys.readouterr().out == "step 3 | reward=0.1235 | loss=1.235e+04\n"


def test_console_with_progress_bar(tmp_path, capsys):
    with Tracker(["console"], log_dir=tmp_path, total_steps=4) as tracker:
        tracker.log({"x": 1}, step=1)
        tracker.log({"x": 2}, step=2)
        assert tracker.backends["console"].bar.n == 2
    captured = capsys.readouterr()
    assert captured.out == "step 1 | x=1\nstep 2 | x=2\n"
    assert "2/4" in captured.err


def test_jsonl_appends_across_runs_and_truncates_after_resume_step(tmp_path):
    with Tracker(["jsonl"], log_dir=tmp_path) as tracker:
        for step in (1, 2, 3):
            tracker.log({"reward": step / 4, "n": np.int64(step), "ok": True}, step=step)
    path = tmp_path / "metrics.jsonl"
    assert tracker.jsonl_path == path
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 1, "reward": 0.25, "n": 1,
                                                            "ok": 1}
    # the run crashed after step 3 with its last checkpoint at step 1: resume from there
    assert truncate_jsonl_after(path, 1) == 2
    with Tracker(["jsonl"], log_dir=tmp_path) as tracker:
        tracker.log({"reward": 0.9}, step=2)
    rows = read_jsonl_metrics(path)
    assert [(r["step"], r["reward"]) for r in rows] == [(1, 0.25), (2, 0.9)]
    assert truncate_jsonl_after(tmp_path / "absent.jsonl", 5) == 0


def test_non_scalar_metric_is_rejected(tmp_path):
    with Tracker(["jsonl"], log_dir=tmp_path) as tracker:
        with pytest.raises(ValueError, match="'vec'"):
            tracker.log({"vec": torch.ones(3)}, step=0)


def test_tensorboard_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(["tensorboard"], log_dir=tmp_path, config={"lr": 0.1}) as tracker:
        tracker.log({"reward/mean": 0.5}, step=1)
        tracker.log({"reward/mean": 0.75}, step=2)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]


# A missing wandb/mlflow/tensorboard package: tests/trainer/test_tracking_backends.py.


def test_unknown_backend_is_named(tmp_path):
    with pytest.raises(ValueError, match="'tensorbord'"):
        Tracker(["console", "tensorbord"], log_dir=tmp_path)


def test_plot_metric_writes_png(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(5)))
    out = plot_metric(path, "reward", tmp_path / "plots" / "reward.png", title="GSM8K reward")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="'loss' not found.*'reward'"):
        plot_metric(path, "loss", tmp_path / "loss.png")


def test_timer_accumulates_stages_and_throughput():
    timer = Timer()
    with timer("gen"):
        pass
    with timer("gen"):
        pass
    with pytest.raises(RuntimeError), timer("update"):
        raise RuntimeError("a failing stage is still timed")
    metrics = timer.metrics()
    assert set(metrics) == {"timing_s/gen", "timing_s/update"}
    assert all(0 <= v < 1 for v in metrics.values())

    timings = {"gen": 2.0, "update": 0.5, "ref": 0.0}
    assert throughput_metrics(timings, 1000) == {"throughput/gen": 500.0,
                                                 "throughput/update": 2000.0}
    assert throughput_metrics(timings, {"gen": 300}, num_devices=3) == {"throughput/gen": 50.0}
    timer.reset()
    assert timer.metrics() == {}


def test_timer_measures_real_time():
    import time

    timer = Timer()
    outer = time.perf_counter()
    with timer("sleep"):
        time.sleep(0.05)
    outer = time.perf_counter() - outer
    assert 0.05 <= timer.durations["sleep"] <= outer  # bounds that hold on a machine of any speed
