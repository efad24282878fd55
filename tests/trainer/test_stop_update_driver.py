"""The driver's side of abandoning an update (rlcore.trainer.loop): which update calls it permits to be given up,
and what it saves after a stop signal however the step's first update ends. On TrainingRun's bookkeeping alone
(no workers: the stages' bodies stand in for the update calls' outcomes)."""

import os
import signal

import pytest

from rlcore.single_controller import abandon
from rlcore.single_controller.abandon import AbandonedCallError
from rlcore.trainer.run_checkpoint import find_latest_checkpoint
from rlcore.trainer.stop_signal import RunStopped
from rlcore.trainer.tracking import read_jsonl_metrics

from run_stubs import bookkeeping_run



def test_only_the_steps_first_update_is_permitted_to_be_given_up(tmp_path):
    seen = []
    with bookkeeping_run(tmp_path) as run:
        for step in run.steps():
            for stage in ("gen", "adv", "update_critic", "update_actor", "sync_weights"):
                with run.timer(stage):
                    seen.append((stage, abandon.update_permitted()))
            run.end_step(step, {})
            seen.append(("end", abandon.update_permitted()))
            break
    assert seen == [("gen", False), ("adv", False), ("update_critic", True), ("update_actor", False),
                    ("sync_weights", False), ("end", False)]


@pytest.mark.parametrize("outcome, saved, said", [
    ("abandoned", 2, "stopped by SIGTERM during step 3 (abandoned)"),  # the workers gave it up: the step before
    ("returned", 3, "step 3's update had made an optimizer step: finishing the step and saving it"),
    ("failed", None, "the update failed after the stop, so nothing new is saved: RuntimeError"),
])
def test_what_is_saved_after_a_signal_during_the_steps_first_update(tmp_path, capsys, outcome, saved, said):
    run = bookkeeping_run(tmp_path)
    with pytest.raises(RunStopped) as stopped:
        with run:
            for step in run.steps():
                with run.timer("gen"):
                    pass
                with run.timer("update_actor"):
                    if step == 3:
                        os.kill(os.getpid(), signal.SIGTERM)
                        if outcome == "abandoned":
                            raise AbandonedCallError("update abandoned at micro-batch boundary 2")
                        if outcome == "failed":
                            raise RuntimeError("an optimizer step, then a failure")
                with run.timer("sync_weights"):
                    pass
                run.end_step(step, {"x": float(step)})
    assert stopped.value.code == 143
    found = find_latest_checkpoint(run.ckpt_dir)
    assert (found[0] if found else None) == saved  # save_freq 0: only the stop saves
    assert [r["step"] for r in read_jsonl_metrics(run.dir / "metrics.jsonl")] == [1, 2, 3][:3 if saved == 3 else 2]
    out = capsys.readouterr()
    assert "SIGTERM received: abandoning the current step's update (unless it made an optimizer step)" in out.err
    assert said in out.out
    assert ("had made an optimizer step" in out.out) == (outcome == "returned")
