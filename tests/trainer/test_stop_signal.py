"""SIGTERM / SIGINT during a run: the step under way finishes (or, still generating, is abandoned:
tests/trainer/test_stop_abandon.py), a checkpoint is saved (save_freq 0 too), and the process exits with
128 + the signal's number. In-process on TrainingRun's bookkeeping, and end to end
on a real GRPO run in a process of its own, resumed from what it left."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer import loop
from rlcore.trainer.run_checkpoint import find_latest_checkpoint
from rlcore.trainer.stop_signal import RunStopped, exit_during_startup
from rlcore.trainer.tracking import read_jsonl_metrics

from run_stubs import bookkeeping_run

REPO = Path(recipes.grpo.__file__).resolve().parent.parent



@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_step_saves_that_step_and_exits_with_its_code(tmp_path, capsys, sig, code):
    before = signal.getsignal(sig)
    run = bookkeeping_run(tmp_path)
    with pytest.raises(RunStopped) as stopped:
        with run:
            for step in run.steps():
                if step == 3:
                    os.kill(os.getpid(), sig)  # arrives mid-step: the step still finishes and is logged
                run.end_step(step, {"x": float(step)})
    assert stopped.value.code == code
    assert [r["step"] for r in read_jsonl_metrics(run.dir / "metrics.jsonl")] == [1, 2, 3]
    assert find_latest_checkpoint(run.ckpt_dir) == (3, run.ckpt_dir / "global_step_3")
    assert f"stopped by {sig.name} after step 3; checkpoint {run.ckpt_dir / 'global_step_3'}" in capsys.readouterr().out
    assert signal.getsignal(sig) is before  # the previous handler is back once the run closed


def test_a_signal_between_steps_gives_the_next_step_up_at_its_first_stage(tmp_path, capsys, monkeypatch):
    """The signal lands after the loop checked for one and before step 3 began (while its start state is
    captured): nothing is abandonable then, so the handler says it finishes the step; the step's first
    stage finds it not begun and gives it up: step 2 is saved, with the data position step 3 began at."""
    capture = loop.capture_rng_state

    def capture_and_signal():
        if run._step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return capture()

    monkeypatch.setattr(loop, "capture_rng_state", capture_and_signal)
    run = bookkeeping_run(tmp_path)
    with pytest.raises(RunStopped) as stopped:
        with run:
            for step in run.steps():
                with run.timer("gen"):
                    pass
                run.end_step(step, {"x": float(step)})
    assert stopped.value.code == 143
    assert [r["step"] for r in read_jsonl_metrics(run.dir / "metrics.jsonl")] == [1, 2]
    assert find_latest_checkpoint(run.ckpt_dir) == (2, run.ckpt_dir / "global_step_2")
    assert "stopped by SIGTERM during step 3 (abandoned)" in capsys.readouterr().out


def test_a_second_signal_exits_at_once_and_none_leaves_the_run_alone(tmp_path):
    run = bookkeeping_run(tmp_path)
    with pytest.raises(RunStopped) as stopped:
        with run:
            for step in run.steps():
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # raises here: the step is not finished
                run.end_step(step, {"x": 1.0})
    assert stopped.value.code == 143
    assert find_latest_checkpoint(run.ckpt_dir) is None and not (run.dir / "metrics.jsonl").read_text()
    quiet = bookkeeping_run(tmp_path / "other")
    with quiet:
        for step in quiet.steps():
            quiet.end_step(step, {"x": 1.0})
    assert find_latest_checkpoint(quiet.ckpt_dir) is None  # save_freq 0 and no signal: no checkpoint


def logged_steps(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_a_real_grpo_run_with_a_usable_checkpoint(tmp_path, preloaded_python):
    """``python -m recipes.grpo`` in a process of its own (a child of the preloaded interpreter,
    tests/preloaded_python.py: its own signal handlers and exit status), sent SIGTERM once step 2 is logged."""
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    common = [f"model.path={model}", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]",
              "trainer.backend=local", "trainer.val_freq=0", "trainer.save_freq=0", "data.train_batch_size=4",
              "data.arithmetic.n_train=16", "data.arithmetic.n_val=4", "actor.ppo_micro_batch_size_per_gpu=8",
              "rollout.n=2", "rollout.max_new_tokens=4"]
    pid_file, done = tmp_path / "driver.pid", {}

    def run() -> None:
        try:
            done["proc"] = preloaded_python.run("recipes.grpo", *common, "trainer.total_steps=10000", cwd=REPO,
                                                pid_file=pid_file, timeout=700)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            done["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    metrics = tmp_path / "grpo" / "default" / "metrics.jsonl"
    deadline = time.monotonic() + 400  # a bound on a hang, not a timing the test relies on
    try:
        while max(logged_steps(metrics), default=0) < 2:
            assert runner.is_alive(), done
            assert time.monotonic() < deadline, "step 2 never logged"
            time.sleep(0.2)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        runner.join(timeout=300)
    finally:
        if runner.is_alive() and pid_file.exists():  # the run never ended: end it (the preloaded interpreter
            # serves the next test)
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            runner.join(timeout=120)
    assert "proc" in done, done
    proc = done["proc"]
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 143, err[-3000:]
    last = max(logged_steps(metrics))
    assert last >= 2
    assert "SIGTERM received: " in err
    ckpt = tmp_path / "grpo" / "default" / "checkpoints" / f"global_step_{last}"
    # In the step's generation, or its update before its optimizer step, it is abandoned and the step before
    # saved (tests/trainer/test_stop_abandon.py, test_stop_update.py);
    # past that, it finishes and is saved: either way the checkpoint is the last logged step.
    assert f"checkpoint {ckpt} (step {last})" in out
    assert find_latest_checkpoint(ckpt.parent) == (last, ckpt)
    assert (ckpt / "hf" / "model.safetensors").is_file()  # export_hf: the model of that step, loadable
    with initialize_config_dir(config_dir=str(REPO / "recipes" / "config"), version_base=None):
        cfg = compose("grpo", overrides=[*common, f"trainer.total_steps={last + 1}", "trainer.resume=auto"])
    resumed = recipes.grpo.train(cfg)
    assert resumed.start_step == last
    assert logged_steps(metrics) == list(range(1, last + 2))


def test_a_signal_during_start_up_exits_at_once_with_its_code(capsys):
    before = signal.getsignal(signal.SIGTERM)
    try:
        exit_during_startup()
        with pytest.raises(RunStopped) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.value.code == 143
        assert "SIGTERM during start-up: exiting (nothing trained yet)" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, before)
