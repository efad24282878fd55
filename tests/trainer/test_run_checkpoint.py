import errno
import random

import numpy as np
import pytest
import torch

from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.trainer.builder import Workers
from rlcore.trainer.config import load_config
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.run_checkpoint import (
    capture_rng_state,
    find_latest_checkpoint,
    load_run_state,
    prune_checkpoints,
    resolve_resume,
    restore_rng_state,
    save_run_state,
)
from rlcore.workers.actor import ActorWorker

from run_stubs import EmptyLoader


def draws():
    return random.random(), np.random.rand(), torch.rand(3).tolist()


def test_rng_restore_repeats_the_same_draws():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = capture_rng_state()
    first = draws()
    draws()  # move on
    restore_rng_state(state)
    assert draws() == first


def test_save_load_roundtrip_with_rng_and_latest_marker(tmp_path):
    torch.manual_seed(7)
    step_dir = save_run_state(tmp_path, 5, {"dataloader": {"epoch": 1, "position": 2},
                                            "kl_coef": 0.01})
    expected_next = torch.rand(2)
    assert step_dir == tmp_path / "global_step_5"
    assert (tmp_path / "latest_checkpointed_step.txt").read_text() == "5\n"
    assert sorted(p.name for p in step_dir.iterdir()) == ["trainer_state.pt"]  # no temp left

    state = load_run_state(step_dir)
    assert state["global_step"] == 5
    assert state["dataloader"] == {"epoch": 1, "position": 2} and state["kl_coef"] == 0.01
    torch.rand(5)
    restore_rng_state(state["rng"])
    assert torch.equal(torch.rand(2), expected_next)
    assert load_run_state(step_dir / "trainer_state.pt")["global_step"] == 5
    with pytest.raises(ValueError, match="reserved"):
        save_run_state(tmp_path, 6, {"rng": 1})


def test_find_latest_ignores_incomplete_checkpoints(tmp_path):
    assert find_latest_checkpoint(tmp_path / "nothing_here") is None
    save_run_state(tmp_path, 2, {})
    save_run_state(tmp_path, 10, {})
    (tmp_path / "global_step_20" / "actor").mkdir(parents=True)  # workers saved, driver did not
    (tmp_path / "global_step_30").mkdir()
    (tmp_path / "global_step_30" / "trainer_state.pt.tmp").write_bytes(b"half written")
    (tmp_path / "not_a_step").mkdir()
    assert find_latest_checkpoint(tmp_path) == (10, tmp_path / "global_step_10")
    with pytest.raises(FileNotFoundError, match="no trainer_state.pt"):
        load_run_state(tmp_path / "global_step_20")


def test_resolve_resume_modes(tmp_path):
    assert resolve_resume("auto", tmp_path) is None
    save_run_state(tmp_path, 3, {})
    save_run_state(tmp_path, 4, {})
    assert resolve_resume("disable", tmp_path) is None
    assert resolve_resume("auto", tmp_path) == (4, tmp_path / "global_step_4")
    explicit = tmp_path / "global_step_3"
    assert resolve_resume(str(explicit), tmp_path) == (3, explicit)
    assert resolve_resume(explicit / "trainer_state.pt", tmp_path) == (3, explicit)
    with pytest.raises(FileNotFoundError, match="'autoo'"):
        resolve_resume("autoo", tmp_path)


def test_prune_keeps_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        save_run_state(tmp_path, step, {})
        (tmp_path / f"global_step_{step}" / "actor").mkdir()
    (tmp_path / "global_step_5").mkdir()  # a save in progress: not counted, not touched
    assert prune_checkpoints(tmp_path, keep_last=2) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == \
        ["global_step_3", "global_step_4", "global_step_5"]
    assert prune_checkpoints(tmp_path, keep_last=2) == []
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(tmp_path, keep_last=0)


def torch_stream_failure(*args, **kwargs):
    raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 4544 vs 4438")


def test_a_failed_driver_state_write_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_run_state(tmp_path, 2, {"loader": 2})
    monkeypatch.setattr(torch, "save", torch_stream_failure)
    target = tmp_path / "global_step_4" / "trainer_state.pt"
    with pytest.raises(OSError, match=rf"writing checkpoint {target} failed: RuntimeError: .*unexpected pos 4544 "
                                      r"vs 4438 \(disk full\?\)"):
        save_run_state(tmp_path, 4, {"loader": 4})
    monkeypatch.undo()
    assert list((tmp_path / "global_step_4").iterdir()) == []  # no partial file
    assert (tmp_path / "latest_checkpointed_step.txt").read_text() == "2\n"
    assert find_latest_checkpoint(tmp_path) == (2, tmp_path / "global_step_2")
    assert load_run_state(tmp_path / "global_step_2")["loader"] == 2


def test_a_full_disk_during_a_worker_save_names_the_file_and_resume_takes_the_previous_one(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model", hidden_size=32, num_heads=2, num_kv_heads=1)

    def run(**trainer) -> TrainingRun:
        cfg = load_config({"model": {"path": model}, "trainer": {"output_dir": str(tmp_path), "loggers": ["jsonl"],
                                                                  "backend": "local", **trainer}}, ["model", "trainer"])
        group = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": model}}))
        group.init_model()
        return TrainingRun(cfg, Workers(group=group, actor=group), EmptyLoader(), validate=dict)

    with run() as first:
        first.save(1)

        def full_disk(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(torch, "save", full_disk)
        with pytest.raises(Exception, match=r"writing checkpoint \S*global_step_2/actor\S* failed: .*No space left "
                                            r"on device.*\(disk full\?\)"):
            first.save(2)
        monkeypatch.undo()
    assert find_latest_checkpoint(first.ckpt_dir)[0] == 1
    with run(resume="auto") as resumed:
        assert resumed.start_step == 1
