"""TrainingRun's run folder is one run's: a folder holding another run is refused unless resumed or
overwritten, and a second live run in the same folder fails at once, naming the holder's pid."""

import os

import pytest

from rlcore.trainer.builder import Workers
from rlcore.trainer.config import load_config
from rlcore.trainer.loop import RunFolderError, TrainingRun
from rlcore.trainer.tracking import read_jsonl_metrics

from run_stubs import EmptyLoader


class NoGroup:
    def shutdown(self):
        self.closed = True


def start(tmp_path, **trainer) -> TrainingRun:
    cfg = load_config({"trainer": {"output_dir": str(tmp_path), "loggers": ["jsonl"], "val_freq": 0, **trainer}},
                      ["trainer"])
    return TrainingRun(cfg, Workers(group=NoGroup()), EmptyLoader(), validate=dict)


def one_step_run(tmp_path, **trainer) -> TrainingRun:
    with start(tmp_path, **trainer) as run:
        for step in run.steps():
            run.end_step(step, {"x": float(step)})
    return run


def test_a_folder_holding_another_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    first = one_step_run(tmp_path, total_steps=2)
    assert [r["step"] for r in read_jsonl_metrics(first.dir / "metrics.jsonl")] == [1, 2]
    with pytest.raises(RunFolderError, match=rf"run folder {first.dir} holds another run \(metrics.jsonl\): "
                                             r"set trainer.resume=auto .* trainer.overwrite=true"):
        start(tmp_path)
    assert [r["step"] for r in read_jsonl_metrics(first.dir / "metrics.jsonl")] == [1, 2]  # untouched
    one_step_run(tmp_path, total_steps=1, overwrite=True)
    assert [r["step"] for r in read_jsonl_metrics(first.dir / "metrics.jsonl")] == [1]  # replaced, not appended
    one_step_run(tmp_path, total_steps=1, resume="auto")  # no checkpoint: starts over, the old rows dropped
    assert [r["step"] for r in read_jsonl_metrics(first.dir / "metrics.jsonl")] == [1]


def test_a_second_live_run_in_the_same_folder_fails_naming_the_holder(tmp_path):
    holder = start(tmp_path)
    try:
        with pytest.raises(RunFolderError, match=rf"run folder {holder.dir} is in use by a live run "
                                                 rf"\(pid {os.getpid()}\)"):
            start(tmp_path, resume="auto")  # not even resuming may share a live folder
    finally:
        holder.close()
    start(tmp_path, resume="auto").close()  # released when the holder closed


def test_overwrite_and_resume_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="trainer.overwrite=true replaces .* trainer.resume='auto' continues"):
        start(tmp_path, overwrite=True, resume="auto")
