"""Faults that need Ray, planted in short real runs on the suite's Ray instance (tests/conftest.py):
a worker process killed with SIGKILL mid-call (then resumed), two resource pools and two recipe runs
at once on one cluster, and, in agentic GRPO, an env step that hangs (the env's timeout, or first the
watchdog's wait_rollout deadline) and an engine server that dies while episodes are being played."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from fault_runs import comparable, config, last_line

import recipes.agentic_grpo
import recipes.grpo
from rlcore.agentic.pool import RolloutError, RolloutPool
from rlcore.single_controller import RayResourcePool, WorkerDiedError, WorkerError
from rlcore.single_controller.ray_group import RayWorkerGroup
from rlcore.trainer import streamed_grpo
from rlcore.trainer.watchdog import StallError

pytestmark = pytest.mark.slow
RAY = ["trainer.backend=ray", "trainer.cpus_per_proc=1"]


# ------------------------------------------------------------------ a worker killed mid-step
@pytest.mark.timeout(240)
def test_worker_killed_mid_step(tmp_path, fault_model, fault, ray_cluster, monkeypatch):
    """SIGKILL to the rank's process right after step 2's generate_sequences is sent to it: the driver fails
    naming the method and the rank; resume=auto then continues from checkpoint 1 to the end. No bound on the
    time: the error's kind shows the driver saw the death (a call that waited instead would end in
    WorkerTimeoutError after the group's hour-long default timeout; the test's own timeout is the hang guard)."""
    overrides = [*RAY, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.run_name=worker_kill"]
    real_submit = RayWorkerGroup._submit
    kill = {"generate_calls": 0}

    def submit_then_kill(self, role, method, calls):
        handles = real_submit(self, role, method, calls)
        if method == "generate_sequences":
            kill["generate_calls"] += 1
            if kill["generate_calls"] == 2:  # step 2 (no validation: val_freq=0)
                kill["pid"] = self.worker_info[0]["pid"]
                assert kill["pid"] != os.getpid()
                os.kill(kill["pid"], signal.SIGKILL)
                kill["at"] = time.monotonic()
        return handles

    monkeypatch.setattr(RayWorkerGroup, "_submit", submit_then_kill)
    with pytest.raises(WorkerDiedError) as err:
        recipes.grpo.train(config("grpo", fault_model, tmp_path, *overrides))
    detected_s = time.monotonic() - kill["at"]  # includes the run's teardown
    monkeypatch.setattr(RayWorkerGroup, "_submit", real_submit)
    message = str(err.value)
    assert (err.value.method, err.value.rank) == ("generate_sequences", 0)
    assert message.startswith("generate_sequences failed on rank 0") and "died" in message, message
    assert str(kill["pid"]) in message, message  # Ray's text names the process (and the actor: its roles)
    actor = re.search(r"\bname: (\S+)", message)  # Ray's text names the actor: <project>_<roles>_rank<r>_<id>
    assert actor and "rollout" in actor.group(1), message
    resumed = recipes.grpo.train(config("grpo", fault_model, tmp_path, *overrides, "trainer.resume=auto"))
    assert resumed.start_step == 1
    assert [r["step"] for r in comparable(resumed.dir)] == [1, 2, 3]
    fault.done(f"WorkerDiedError {detected_s:.1f}s after kill -9 of pid {kill['pid']}: "
               f"'{message.splitlines()[0]} ... name: {actor.group(1)}'; resume=auto from step 1 to 3")


# ------------------------------------------------------------------ two at once on one cluster
@pytest.mark.timeout(120)
def test_two_resource_pools_at_once(ray_cluster, fault):
    """Two pools of the same name prefix, created from two threads at the same time."""
    pools, errors = [], []

    def make():
        try:
            pools.append(RayResourcePool([1], num_cpus_per_process=0.25, name_prefix="fault_pool", ready_timeout_s=60))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(2)]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not errors, errors
        assert len(pools) == 2 and pools[0].pg_name_prefix != pools[1].pg_name_prefix
        assert all(len(p.placement_groups()) == 1 for p in pools)
    finally:
        for p in pools:
            p.shutdown()
    fault.done(f"both pools ready in {time.monotonic() - start:.1f}s ({pools[0].pg_name_prefix}, "
               f"{pools[1].pg_name_prefix})")


@pytest.mark.timeout(300)
def test_two_recipe_runs_at_once_on_one_cluster(tmp_path, fault_model, fault, ray_cluster):
    """Two GRPO runs (Ray workers) in two threads of this driver at once: both finish; their placement
    groups are gone afterwards."""
    from ray.util import placement_group_table

    cfgs = {name: config("grpo", fault_model, tmp_path, *RAY, f"trainer.run_name={name}") for name in ("one", "two")}
    results, errors = {}, {}

    def train(name):
        try:
            results[name] = recipes.grpo.train(cfgs[name])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[name] = exc

    threads = {name: threading.Thread(target=train, args=(name,)) for name in cfgs}
    start = time.monotonic()
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads.values()), "a run did not finish within 240s"
    assert not errors, errors
    for run in results.values():
        assert [r["step"] for r in comparable(run.dir)] == [1, 2]
    left = [pg["name"] for pg in placement_group_table().values()
            if pg["name"].startswith(("grpo_one", "grpo_two")) and pg["state"] != "REMOVED"]
    assert not left, left
    fault.done(f"both runs finished (2 steps each) in {time.monotonic() - start:.1f}s; no placement group left")


# ------------------------------------------------------------------ agentic rollouts
def where(message: str) -> str:
    """"group N ... runner R" of a RolloutError's message."""
    group, runner = re.match(r"group \d+", message), re.search(r"failed on runner \d+", message)
    return f"{group and group.group(0)} {runner and runner.group(0)}"


AGENTIC = ["trainer.backend=local", "trainer.total_steps=2", "env.max_total_tokens=40", "agentic.cpus_per_engine=1"]


@pytest.mark.timeout(240)
def test_hung_env_step_in_agentic_rollouts(tmp_path, fault_model, fault, ray_cluster):
    started = tmp_path / "hang_started"
    cfg = config("agentic_grpo", fault_model, tmp_path, *AGENTIC, "env.name=tests.faults.fault_envs:HangingToolEnv",
                 "env.step_timeout_s=2", f"+env.kwargs.started='{started}'")
    with pytest.raises(RolloutError) as err:
        recipes.agentic_grpo.train(cfg)
    waited = time.time() - float(started.read_text())  # from the first hung step to the run's error
    message = str(err.value)
    assert "HangingToolEnv.step did not return within 2s (session " in message, message  # not its latency wrapper
    assert message.startswith("group ") and "failed on runner 0" in message, message
    # the step's timeout ran out (the step itself would have waited an hour); the env stamps its start just after
    # the timeout's clock started, so the two clocks may differ by a moment (1.9992 s was seen)
    assert waited >= 2 - 0.25, waited
    fault.done(f"RolloutError {waited:.1f}s after the step hung (step_timeout_s=2): "
               f"{where(message)}: {last_line(message)}")


@pytest.mark.timeout(240)
def test_engine_server_dies_during_agentic_rollouts(tmp_path, fault_model, fault, ray_cluster, monkeypatch):
    """The (only) engine server is killed as step 1 waits for its first groups, every one still being played:
    the run fails naming the dead engine (with one engine there is nothing to fail over to) and tears down.
    (Should the pool hand out groups first anyway, the weight push after the update is the call that finds it.)"""
    import ray

    engines, killed = [], {}
    real_start, real_get = streamed_grpo.start_engine_servers, RolloutPool.get_groups

    def start_engine_servers(*args, **kwargs):
        engines.extend(real_start(*args, **kwargs))
        return engines

    def get_groups(self, n, current_version, timeout_s=600.0):
        if not killed:
            deadline = time.monotonic() + 30  # the pool's thread submits its first groups right after start
            while not self._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            killed["in_flight"], killed["ready"] = len(self._in_flight), len(self._ready)
            ray.kill(engines[0].handle)
            killed["at"] = time.monotonic()
        try:
            return real_get(self, n, current_version, timeout_s)
        except BaseException:
            killed.setdefault("raised", time.monotonic())
            raise

    monkeypatch.setattr(streamed_grpo, "start_engine_servers", start_engine_servers)
    monkeypatch.setattr(RolloutPool, "get_groups", get_groups)
    cfg = config("agentic_grpo", fault_model, tmp_path, *AGENTIC, "env.kwargs.step_latency_s=0.2",
                 "env.kwargs.latency_sigma=0.0")
    with pytest.raises((RolloutError, WorkerError)) as err:
        recipes.agentic_grpo.train(cfg)
    elapsed = time.monotonic() - killed["at"]  # includes the run's teardown
    raised = killed.get("raised", time.monotonic()) - killed["at"]
    message = str(err.value)
    assert killed["in_flight"] > 0
    assert "\x1b[" not in message  # Ray's colour codes are stripped from the error text
    if isinstance(err.value, RolloutError):
        assert "engine 0 died during generate" in message or "engines died" in message, message
        what = where(message)
    else:
        assert message.startswith("push_weights failed on rank 0") and "an engine died during" in message, message
        what = "push_weights on rank 0"
    # no bound of its own on the time: the error itself shows the run did not wait on the dead engine
    fault.done(f"{type(err.value).__name__} raised {raised:.1f}s (torn down {elapsed:.1f}s) after ray.kill of the only "
               f"engine ({killed['in_flight']} groups in flight, {killed['ready']} ready; no failover with 1 engine): "
               f"{what}: {last_line(message)}")


@pytest.mark.timeout(240)
def test_stalled_wait_for_rollouts_is_reported_with_the_pools_groups(tmp_path, fault_model, fault, ray_cluster):
    """An env that hangs for longer than anything times out (env.step_timeout_s=600): the trainer's wait for
    groups runs past the watchdog's wait_rollout deadline (3 s, on_stall=fail), and the run fails naming the
    phase and the groups the pool is still playing, with their ages, in the message and the stall file."""
    started = tmp_path / "hang_started"
    cfg = config("agentic_grpo", fault_model, tmp_path, *AGENTIC, "env.name=tests.faults.fault_envs:HangingToolEnv",
                 "env.step_timeout_s=600", f"+env.kwargs.started='{started}'",
                 "trainer.watchdog.deadlines.wait_rollout=3", "trainer.watchdog.on_stall=fail")
    start = time.monotonic()
    with pytest.raises(StallError) as err:
        recipes.agentic_grpo.train(cfg)
    message = str(err.value)
    assert "phase 'wait_rollout' of step 1" in message and "past its deadline of 3s" in message, message
    assert "rollout pool: " in message and "group(s) in flight" in message, message
    stall = tmp_path / cfg.trainer.project / cfg.trainer.run_name / "stalls" / "step_1_wait_rollout.txt"
    text = stall.read_text()
    assert "== rollout pool" in text and re.search(r"group 0 \(arithmetic\) on runner 0: played \d", text), text
    assert "in get_groups" in text  # the driver's own stack: waiting on the pool
    fault.done(f"StallError {time.monotonic() - start:.1f}s into the run (deadlines.wait_rollout=3, the env hangs): "
               f"{message.split('. Stacks')[0][-200:]}")
