"""Faults planted in short real GRPO runs in this process (trainer.backend=local, no Ray needed):
a reward function that hangs and one that raises (the shipped reward defaults), an output directory
that cannot be written, a checkpoint write that fails (ENOSPC from the writer, and a real full tmpfs),
and a Ray address nothing answers at."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fault_runs import comparable, config

import recipes.grpo
from rlcore.data.arithmetic import make_split, write_jsonl
from rlcore.rewards import RewardError
from rlcore.single_controller import WorkerError
from rlcore.trainer.watchdog import StallError
from rlcore.trainer.run_checkpoint import (
    STATE_FILE,
    find_latest_checkpoint,
    load_run_state,
)

REWARDS = Path(__file__).with_name("fault_rewards.py")
LOCAL = ["trainer.backend=local"]


def checkpoint_line(message: str) -> str:
    """The line of an error (or of a worker's traceback in it) that names the failing checkpoint file."""
    lines = [line.strip() for line in message.splitlines() if "writing checkpoint" in line]
    return (lines[-1] if lines else message.splitlines()[-1])[:220]


def row_of(message: str) -> str:
    match = re.search(r"on sample \d+ \(data_source=[^)]*\)", message)
    return match.group(0) if match else "(no row named)"


# ------------------------------------------------------------------ rewards (shipped defaults)
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hung_reward_function(tmp_path, fault_model, fault):
    started = tmp_path / "hang_started"
    cfg = config("grpo", fault_model, tmp_path, *LOCAL, f"reward.reward_fn={REWARDS}:hangs_on_third_row",
                 f"+reward.reward_kwargs.started='{started}'")
    assert (cfg.reward.num_workers, cfg.reward.timeout_s) == (0, 10.0)  # the shipped defaults
    with pytest.raises(RewardError) as err:
        recipes.grpo.train(cfg)
    waited = time.time() - float(started.read_text())
    message = str(err.value)
    assert f"'{REWARDS}:hangs_on_third_row' did not return within timeout_s=10s" in message, message
    assert "on sample 2 (data_source='arithmetic')" in message, message
    assert err.value.index == 2
    assert waited >= 10.0, waited  # the row's timeout ran out; the row itself would have slept an hour
    fault.done(f"RewardError {waited:.1f}s after the row began (shipped defaults num_workers=0, timeout_s=10): "
               f"hangs_on_third_row did not return within timeout_s=10s {row_of(message)}")


@pytest.mark.timeout(120)
def test_crashing_reward_function(tmp_path, fault_model, fault):
    cfg = config("grpo", fault_model, tmp_path, *LOCAL, f"reward.reward_fn={REWARDS}:raises_on_second_row")
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        recipes.grpo.train(cfg)
    message = str(err.value)
    assert "raised ValueError: cannot score" in message and "on sample 1 (data_source='arithmetic')" in message
    assert isinstance(err.value.__cause__, ValueError)
    fault.done(f"RewardError in {time.monotonic() - start:.1f}s: raises_on_second_row "
               f"{message.split(' raised ', 1)[1].split(' on sample')[0]} {row_of(message)}")


# ------------------------------------------------------------------ output directory
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["under_a_file", "under_a_file+data_files", "read_only_dir"])
def test_unwritable_output_dir(tmp_path, fault_model, fault, how, monkeypatch):
    """The first write under trainer.output_dir fails, naming the path, before any step: the arithmetic task's
    files (the default data) or, with data files given, the run folder."""
    fault.name = f"unwritable_output_dir[{how}]"
    if how.startswith("under_a_file"):  # fails for root too: nothing can be created below a regular file
        blocker = tmp_path / "a_file"
        blocker.write_text("not a directory")
        output_dir = blocker / "sub"
    else:
        if os.geteuid() == 0:
            pytest.skip("running as root: chmod 0o500 does not stop root's writes (under_a_file covers it)")
        output_dir = tmp_path / "read_only"
        output_dir.mkdir()
        output_dir.chmod(0o500)
    data = []
    if how.endswith("data_files"):
        train, val = make_split(8, 2, seed=0)
        data = [f"data.train_files=[{write_jsonl(tmp_path / 'train.jsonl', train)}]",
                f"data.val_files={write_jsonl(tmp_path / 'val.jsonl', val)}"]
    built, steps = [], []
    real_build = recipes.grpo.build_workers
    monkeypatch.setattr(recipes.grpo, "build_workers", lambda *a, **k: built.append(1) or real_build(*a, **k))
    monkeypatch.setattr(recipes.grpo.TrainingRun, "steps", lambda self: steps.append(1) or iter(()))
    start = time.monotonic()
    try:
        with pytest.raises(OSError) as err:
            recipes.grpo.train(config("grpo", fault_model, output_dir, *LOCAL, *data))
    finally:
        if how == "read_only_dir":
            output_dir.chmod(0o700)
    message = str(err.value)
    assert str(output_dir) in message, message
    assert steps == []  # before the first step
    where = "after building the workers" if built else "before building the workers"
    fault.done(f"{type(err.value).__name__} {where}, {time.monotonic() - start:.1f}s: {message[:200]}")


# ------------------------------------------------------------------ a checkpoint that cannot be written
@pytest.mark.timeout(180)
@pytest.mark.parametrize("failing", ["extra_state_rank0.pt", STATE_FILE])
def test_checkpoint_write_fails_with_enospc(tmp_path, fault_model, fault, monkeypatch, failing):
    """The writer raises ENOSPC at the step-2 checkpoint (the actor's own file, or the driver's marker):
    a clear error naming the file; step 1 stays complete and a resume from it runs to the end."""
    fault.name = f"checkpoint_enospc[{failing}]"
    overrides = [*LOCAL, "trainer.save_freq=1", "trainer.total_steps=2", "trainer.run_name=full"]
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if "global_step_2" in str(f) and Path(str(f)).name.startswith(failing):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    start = time.monotonic()
    with pytest.raises((OSError, WorkerError)) as err:  # the driver's own OSError, or the group's WorkerError
        recipes.grpo.train(config("grpo", fault_model, tmp_path, *overrides))
    elapsed = time.monotonic() - start
    monkeypatch.setattr(torch, "save", real_save)
    ckpt = tmp_path / "grpo" / "full" / "checkpoints"
    message = str(err.value)
    assert f"writing checkpoint {ckpt / 'global_step_2'}" in message and failing in message, message
    assert "No space left on device" in message, message
    if isinstance(err.value, WorkerError):  # a worker's file: the group names the method and rank
        assert message.startswith("save_checkpoint failed on rank 0") and isinstance(err.value.__cause__, OSError)
    assert not (ckpt / "global_step_2" / STATE_FILE).exists()
    assert not list(ckpt.rglob("*.tmp")), "a partial temporary file was left"
    assert find_latest_checkpoint(ckpt)[0] == 1
    assert load_run_state(ckpt / "global_step_1")["global_step"] == 1
    resumed = recipes.grpo.train(config("grpo", fault_model, tmp_path, *overrides, "trainer.resume=auto"))
    assert resumed.start_step == 1 and [r["step"] for r in comparable(resumed.dir)] == [1, 2]
    fault.done(f"{type(err.value).__name__} in {elapsed:.1f}s: {checkpoint_line(message)}; "
               "step 1 complete, resumed to 2")


def _mount_tmpfs(where: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``where``; None when it worked, else why not."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "needs root and mount(8)"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False,
                          capture_output=True, text=True, timeout=30)
    return None if proc.returncode == 0 else f"mount -t tmpfs failed: {proc.stderr.strip()[:200]}"


@pytest.mark.timeout(180)
def test_checkpoint_on_a_full_tmpfs(tmp_path, fault_model, fault):
    """A real filesystem that fills up during the step-2 checkpoint: sized for one checkpoint and a half (a
    checkpoint holds the weights, Adam's two moments and DCP's metadata: about 5x the model file, 0.55 MB here)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    one_checkpoint = 5 * sum(f.stat().st_size for f in Path(fault_model).glob("*.safetensors")) + 64 * 1024
    why = _mount_tmpfs(disk, f"{int(1.5 * one_checkpoint) // 1024}k")
    if why:
        pytest.skip(why)
    overrides = [*LOCAL, "trainer.save_freq=1", "trainer.total_steps=3", "trainer.run_name=full"]
    try:
        start = time.monotonic()
        with pytest.raises((OSError, WorkerError)) as err:
            recipes.grpo.train(config("grpo", fault_model, disk, *overrides))
        elapsed = time.monotonic() - start
        ckpt = disk / "grpo" / "full" / "checkpoints"
        message = str(err.value)
        assert "writing checkpoint" in message and str(ckpt / "global_step_2") in message, message
        assert "No space left on device" in message or "ENOSPC" in message or "errno 28" in message.lower(), message
        assert find_latest_checkpoint(ckpt)[0] == 1
        shutil.copytree(disk / "grpo", tmp_path / "copy" / "grpo")  # a disk with room again
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)
    resumed = recipes.grpo.train(config("grpo", fault_model, tmp_path / "copy", *overrides, "trainer.resume=auto"))
    assert resumed.start_step == 1 and [r["step"] for r in comparable(resumed.dir)] == [1, 2, 3]
    fault.done(f"{type(err.value).__name__} in {elapsed:.1f}s: {checkpoint_line(message)}; "
               "step 1 loadable, resumed to 3")


# ------------------------------------------------------------------ a Ray address nothing answers at
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


@pytest.mark.timeout(60)
def test_dead_ray_address(tmp_path, fault_model, fault, monkeypatch):
    """A closed port on this machine. (A remote address that is down is not tested: behind a proxy, as on
    this sandbox's network, every outbound connection is accepted; see the test below for what that does.)"""
    address = f"127.0.0.1:{closed_port()}"
    ray = pytest.importorskip("ray")
    # This process may be attached to the suite's own Ray instance (init_ray would then reuse it): act unattached,
    # and never hand the dead address to ray.init.
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: pytest.fail(f"ray.init was called with {kw}"))
    cfg = config("grpo", fault_model, tmp_path, "trainer.backend=ray", f"trainer.ray_address={address}",
                 "trainer.ray_connect_timeout_s=3")
    start = time.monotonic()
    with pytest.raises(ConnectionError) as err:
        recipes.grpo.train(cfg)
    elapsed = time.monotonic() - start
    message = str(err.value)
    assert f"no Ray cluster answers at {address} (from trainer.ray_address) within 3s" in message
    # the message shows the connect timeout ended it; a client that waited on would meet the test's timeout
    assert not (tmp_path / "grpo").exists()  # no run folder
    fault.done(f"ConnectionError in {elapsed:.1f}s (ray_connect_timeout_s=3): {message[:150]}")


CONNECT = """
import sys, time
from rlcore.trainer.builder import init_ray
from rlcore.trainer.config import load_config
cfg = load_config({"trainer": {"ray_address": sys.argv[1], "ray_connect_timeout_s": 3}}, ["trainer"])
start = time.monotonic()  # init_ray's own time, the imports before it left out
try:
    init_ray(cfg)
    print(f"CONNECTED after {time.monotonic() - start:.1f}s", flush=True)
except Exception as exc:
    print(f"ERROR {type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_address_that_accepts_but_never_answers(tmp_path, fault, preloaded_python):
    """A listener that accepts connections and never says a word: init_ray must still give up within
    trainer.ray_connect_timeout_s (a fresh process, a child of the preloaded interpreter, which never
    attached to Ray: this one may be attached already)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # the kernel completes the handshakes; nobody ever reads
    address = f"127.0.0.1:{server.getsockname()[1]}"
    start = time.monotonic()
    try:  # a hang guard far past the 3 s limit (the imports were done before): ray.init retrying forever fails it
        proc = preloaded_python.run(None, address, code=CONNECT, cwd=Path(__file__).parents[2], timeout=3 + 120)
        outcome = [line for line in proc.stdout.splitlines() if line.startswith(("ERROR", "CONNECTED"))]
    except subprocess.TimeoutExpired:
        outcome = []
    finally:
        server.close()
    elapsed = time.monotonic() - start
    if not outcome:
        fault.done(f"BUG: no error {elapsed:.0f}s after the child started (ray_connect_timeout_s=3): ray.init still "
                   f"retrying a listener that never answers")
    else:
        fault.done(outcome[-1][:200])
    assert outcome and outcome[-1].startswith("ERROR ConnectionError") and address in outcome[-1], outcome


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stalled_reward_phase_fails_by_the_watchdog(tmp_path, fault_model, fault):
    """A reward function that hangs, with the watchdog's reward deadline (2 s) below the reward's own timeout
    (10 s) and on_stall=fail: the run fails at the watchdog's deadline, naming the phase and step, and the
    stall file in the run folder holds the hung function's stack."""
    started = tmp_path / "hang_started"
    cfg = config("grpo", fault_model, tmp_path, *LOCAL, f"reward.reward_fn={REWARDS}:hangs_on_third_row",
                 f"+reward.reward_kwargs.started='{started}'", "trainer.watchdog.deadlines.reward=2",
                 "trainer.watchdog.on_stall=fail")
    with pytest.raises(StallError) as err:
        recipes.grpo.train(cfg)
    waited = time.time() - float(started.read_text())
    message = str(err.value)
    assert "phase 'reward' of step 1" in message and "past its deadline of 2s" in message, message
    stall = Path(cfg.trainer.output_dir) / cfg.trainer.project / cfg.trainer.run_name / "stalls" / "step_1_reward.txt"
    assert str(stall) in message and "in hangs_on_third_row" in stall.read_text()
    # StallError, not the reward's own TimeoutError: the watchdog's 2 s deadline, not the reward's 10 s, ended it
    fault.done(f"StallError {waited:.1f}s after the reward hung (deadlines.reward=2, on_stall=fail): "
               f"{message.split(': ', 1)[0]}; stack in stalls/{stall.name}")
