"""The driver killed with SIGKILL mid-run: two ``python -m recipes.grpo`` processes (in-process backend),
one killed after a complete checkpoint (with a step logged after it), one killed while a checkpoint is
being written (its step folder there, its completion marker, trainer_state.pt, not yet). Each is frozen
(SIGSTOP) at that point, checked, then killed. ``trainer.resume=auto`` must pick the last complete
checkpoint, never the half-written one, and the resumed run must log the uninterrupted run's metrics
(greedy rollouts). While a killed run's process is still alive (frozen) its folder is refused to a second run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from fault_runs import comparable, config, kill_group, overrides, recipe_process

import recipes.grpo
from rlcore.trainer.preflight import PreflightError
from rlcore.trainer.run_checkpoint import STATE_FILE, find_latest_checkpoint
from rlcore.trainer.tracking import read_jsonl_metrics

pytestmark = pytest.mark.slow
REWARDS = Path(__file__).with_name("fault_rewards.py")
# Greedy, one sample per prompt, and an estimator whose advantages are not 0 then (whitened over the
# batch), with a reward that differs between prompts: the policy really trains, so equal metrics mean
# the weights, optimizer, loader position and RNG all came back.
RESUMABLE = ["trainer.backend=local", "trainer.total_steps=6", "trainer.save_freq=2", "rollout.do_sample=false",
             "rollout.n=1", "actor.lr=1e-2", "algorithm.adv_estimator=reinforce_plus_plus",
             f"reward.reward_fn={REWARDS}:text_score"]
KILL_AFTER_CHECKPOINT, KILL_MID_CHECKPOINT = "killed_after_checkpoint", "killed_mid_checkpoint"


def logged_steps(run_dir: Path) -> list[int]:
    try:
        return [r["step"] for r in read_jsonl_metrics(run_dir / "metrics.jsonl")]
    except (FileNotFoundError, ValueError):  # not there yet, or a row half written
        return []


def after_checkpoint(run_dir: Path):
    """Checkpoint 2 complete and step 3 logged (so the resume must drop that row and redo the step)."""
    return (run_dir / "checkpoints" / "global_step_2" / STATE_FILE).exists() and 3 in logged_steps(run_dir)


def half_written(run_dir: Path):
    """A step folder from step 4 on whose marker is not there yet: a save in progress."""
    ckpt = run_dir / "checkpoints"
    for step in (4, 6):
        folder = ckpt / f"global_step_{step}"
        if folder.is_dir() and not (folder / STATE_FILE).exists():
            return folder
    return None


class Frozen:
    """A recipe process stopped (SIGSTOP) at its kill point: it still holds its run folder."""

    def __init__(self, proc, run_dir: Path, log: Path) -> None:
        self.proc, self.run_dir, self.log = proc, run_dir, log
        self.stopped_at: str | None = None  # what held when it was stopped
        self.half_folder: Path | None = None
        self.started = time.monotonic()
        self.frozen_after_s: float | None = None  # from the process's start
        self.error: str | None = None


def watch(frozen: Frozen, point, timeout_s: float) -> None:
    """Poll (tightly) until ``point(run_dir)`` holds, then SIGSTOP the process group and check it still holds
    (a save may have finished in between: then let it go on and wait for the next)."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if frozen.proc.poll() is not None:
                frozen.error = f"exited (rc {frozen.proc.returncode}) first:\n{frozen.log.read_text()[-3000:]}"
                return
            seen = point(frozen.run_dir)
            if seen:
                os.killpg(frozen.proc.pid, signal.SIGSTOP)
                frozen.frozen_after_s = time.monotonic() - frozen.started
                time.sleep(0.2)  # let writes already in the kernel land
                if point(frozen.run_dir) == seen:
                    frozen.stopped_at = str(seen)
                    frozen.half_folder = seen if isinstance(seen, Path) else None
                    return
                os.killpg(frozen.proc.pid, signal.SIGCONT)  # missed: the save finished meanwhile
            time.sleep(0.001)
        frozen.error = f"never reached its kill point within {timeout_s}s:\n{frozen.log.read_text()[-3000:]}"
    except ProcessLookupError:
        frozen.error = "exited while being stopped"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fault_model):
    """Both recipe processes, frozen at their kill points, and the uninterrupted run (in this process, meanwhile)."""
    out = tmp_path_factory.mktemp("driver_kill")
    frozen = {}
    for name in (KILL_AFTER_CHECKPOINT, KILL_MID_CHECKPOINT):
        log = out / f"{name}.log"
        proc = recipe_process("grpo", overrides(fault_model, out, *RESUMABLE, f"trainer.run_name={name}"), log)
        frozen[name] = Frozen(proc, out / "grpo" / name, log)
    watchers = [threading.Thread(target=watch, args=(frozen[KILL_AFTER_CHECKPOINT], after_checkpoint, 240)),
                threading.Thread(target=watch, args=(frozen[KILL_MID_CHECKPOINT], half_written, 240))]
    try:
        for w in watchers:
            w.start()
        whole = recipes.grpo.train(config("grpo", fault_model, out, *RESUMABLE, "trainer.run_name=whole"))
        for w in watchers:
            w.join(timeout=250)
        yield {"out": out, "whole": comparable(whole.dir), **frozen}
    finally:
        for f in frozen.values():
            if f.proc.poll() is None:
                kill_group(f.proc)


def kill_and_resume(runs, name: str, fault_model):
    frozen = runs[name]
    assert frozen.error is None, frozen.error
    start = time.monotonic()
    kill_group(frozen.proc)  # SIGKILL: no handler runs, the lock goes with the process
    assert frozen.proc.returncode == -signal.SIGKILL
    complete = find_latest_checkpoint(frozen.run_dir / "checkpoints")
    resumed = recipes.grpo.train(config("grpo", fault_model, runs["out"], *RESUMABLE, f"trainer.run_name={name}",
                                        "trainer.resume=auto"))
    got = comparable(resumed.dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got == runs["whole"], [(w["step"], {k: (w[k], g.get(k)) for k in w if g.get(k) != w[k]})
                                  for w, g in zip(runs["whole"], got) if w != g]
    assert any(r["actor/grad_norm"] > 0 for r in got)  # the policy really trained
    return frozen, complete, resumed, time.monotonic() - start


@pytest.mark.timeout(300)
def test_second_run_in_a_live_run_folder(runs, fault_model, fault):
    """The frozen process still holds its folder: a second run there (even resuming) is refused, naming it."""
    frozen = runs[KILL_AFTER_CHECKPOINT]
    assert frozen.error is None, frozen.error
    start = time.monotonic()
    with pytest.raises(PreflightError) as err:  # the pre-flight's one error, listing every problem it found
        recipes.grpo.train(config("grpo", fault_model, runs["out"], *RESUMABLE,
                                  f"trainer.run_name={KILL_AFTER_CHECKPOINT}", "trainer.resume=auto"))
    message = str(err.value)
    assert f"run folder {frozen.run_dir.resolve()} is in use by a live run (pid {frozen.proc.pid})" in message, message
    assert logged_steps(frozen.run_dir) == [1, 2, 3]  # the holder's records untouched
    fault.done(f"PreflightError in {time.monotonic() - start:.1f}s: {message[:170]}")


@pytest.mark.timeout(300)
def test_driver_killed_after_a_checkpoint(runs, fault_model, fault):
    frozen, complete, resumed, elapsed = kill_and_resume(runs, KILL_AFTER_CHECKPOINT, fault_model)
    assert complete[0] == 2 and resumed.start_step == 2
    fault.done(f"SIGKILL {frozen.frozen_after_s:.0f}s into the run, after checkpoint 2 + step 3 logged; resume=auto "
               f"from step 2, row 3 redone, metrics of steps 1-6 == uninterrupted run (greedy); "
               f"kill+resume {elapsed:.1f}s")


@pytest.mark.timeout(300)
def test_driver_killed_while_a_checkpoint_is_written(runs, fault_model, fault):
    frozen = runs[KILL_MID_CHECKPOINT]
    assert frozen.error is None, frozen.error
    half = frozen.half_folder
    half_step = int(half.name.rsplit("_", 1)[1])
    written = sorted(str(p.relative_to(half)) for p in half.rglob("*"))
    frozen, complete, resumed, elapsed = kill_and_resume(runs, KILL_MID_CHECKPOINT, fault_model)
    assert complete[0] == half_step - 2 and resumed.start_step == half_step - 2  # the last complete one
    assert (half / STATE_FILE).exists()  # the resumed run wrote that checkpoint again, whole
    fault.done(f"SIGKILL {frozen.frozen_after_s:.0f}s into the run, while writing checkpoint {half_step} (there: "
               f"{written or 'nothing yet'}, no {STATE_FILE}); resume=auto from step {half_step - 2}, never the half "
               f"one; metrics == uninterrupted run (greedy); kill+resume {elapsed:.1f}s")
