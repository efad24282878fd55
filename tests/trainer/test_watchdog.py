"""The stall watchdog: a phase past its deadline names the group, rank, method and phase, writes the stuck
workers' stacks into the run folder, then warns and waits or fails while the stuck call still runs,
for in-process groups and for Ray groups (whose ranks dump their own stacks when signalled).

No test bounds a time from above (a busy machine would fail it): the stuck calls wait for the watchdog's
own reports (an event) or sleep far past every deadline and show whether they were cut short.
"""

import logging
import threading
import time
from pathlib import Path

import pytest

from rlcore.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, Worker, register
from rlcore.trainer.config import ConfigError, load_config
from rlcore.trainer.timing import Timer
from rlcore.trainer.watchdog import StallError, Watchdog

HANG_GUARD_S = 60.0  # how long a "stuck" call sleeps: far past any deadline here; reached only if nothing interrupts it


class Sleeper(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def sleep_past_the_deadline(self, seconds: float, only_rank: int | None = None, woke: str | None = None):
        """Sleeps ``seconds`` (on ``only_rank``, or on every rank), then touches the file ``woke``: a call the
        watchdog interrupted never gets there."""
        if only_rank is None or only_rank == self.rank:
            time.sleep(seconds)
            if woke:
                Path(woke).touch()
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def stay_until(self, done):
        """Stays in the call until ``done()`` (in-process groups only: ``done`` is a closure), polling."""
        deadline = time.monotonic() + HANG_GUARD_S
        while not done():
            assert time.monotonic() < deadline, "the watchdog never reported"
            time.sleep(0.02)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def quick(self):
        return self.rank


@pytest.fixture
def local_group():
    return LocalWorkerGroup(ClassWithInitArgs(Sleeper))


def test_warn_logs_who_is_stuck_writes_stacks_and_keeps_waiting(tmp_path, local_group, caplog):
    dog = Watchdog({"deadline_s": 0.3, "on_stall": "warn"}, tmp_path / "stalls")
    dog.step = 12
    timer = Timer(watch=(dog.begin, dog.end))
    try:
        with caplog.at_level(logging.WARNING, logger="rlcore.trainer.watchdog"):
            with timer("gen"):
                # stays until reported twice (at the deadline, 0.3 s, and at twice it), then finishes: warn waits
                assert local_group.stay_until(lambda: len(dog.reports) >= 2) == [0]
    finally:
        dog.close()
    lines = [r.getMessage() for r in caplog.records if "STALL" in r.getMessage()]
    assert len(lines) == len(dog.reports) >= 2, lines  # at the deadline (0.3 s), again at twice it (0.6 s)
    assert "phase 'gen' of step 12" in lines[0] and "group Sleeper rank 0 in stay_until" in lines[0]
    first, second = (tmp_path / "stalls" / name for name in ("step_12_gen.txt", "step_12_gen_2.txt"))
    assert str(first) in lines[0] and second.exists()
    text = first.read_text()
    assert "== group Sleeper rank 0 (stay_until" in text, text
    assert "in stay_until" in text  # the waiting frame itself (its line: wherever the loop was at that moment)
    assert timer.durations["gen"] >= 0.6


def test_fail_interrupts_the_stuck_call_naming_it(tmp_path, local_group):
    """on_stall=fail raises in the driver while the stuck call still runs: the call never wakes (no speed bound:
    the proof is that the sleep was cut short, whatever the machine's speed)."""
    dog = Watchdog({"deadline_s": 30.0, "deadlines": {"update_actor": 0.5}, "on_stall": "fail"}, tmp_path)
    dog.step = 3
    woke = tmp_path / "woke"
    start = time.monotonic()
    try:
        with pytest.raises(StallError) as err:
            with dog.phase("update_actor"):
                local_group.sleep_past_the_deadline(HANG_GUARD_S, woke=str(woke))
    finally:
        dog.close()
    elapsed = time.monotonic() - start
    assert elapsed >= 0.5 and not woke.exists(), elapsed  # not before the deadline; the sleep itself was interrupted
    message = str(err.value)
    assert "phase 'update_actor' of step 3" in message and "past its deadline of 0.5s" in message, message
    assert "group Sleeper rank 0 in sleep_past_the_deadline" in message and "step_3_update_actor.txt" in message
    assert "sleep_past_the_deadline" in (tmp_path / "step_3_update_actor.txt").read_text()


def test_a_phase_run_by_another_thread_fails_when_it_ends(tmp_path, local_group):
    """Only the main thread can be interrupted; elsewhere the phase raises as it ends, never silently."""
    dog = Watchdog({"deadline_s": 0.2, "on_stall": "fail"}, tmp_path)
    raised = []

    def step():
        try:
            with dog.phase("reward"):
                local_group.stay_until(lambda: dog.failure is not None)  # past the deadline, then ends
        except StallError as exc:
            raised.append(exc)

    worker = threading.Thread(target=step)
    worker.start()
    worker.join(HANG_GUARD_S)
    dog.close()
    assert len(raised) == 1 and "phase 'reward'" in str(raised[0])


def test_phases_in_time_are_silent_and_deadlines_can_be_off(tmp_path, local_group, caplog):
    dog = Watchdog({"deadline_s": 5.0, "deadlines": {"gen": 0}, "on_stall": "fail"}, tmp_path / "stalls")
    with caplog.at_level(logging.WARNING):
        for _ in range(200):
            with dog.phase("update_actor"):
                local_group.quick()
        with dog.phase("gen"):  # deadline 0: not watched
            local_group.sleep_past_the_deadline(0.1)
    dog.close()
    assert dog.reports == [] and not (tmp_path / "stalls").exists() and "STALL" not in caplog.text
    off = Watchdog({"enable": False}, tmp_path)
    assert off.begin("gen") is None and off._thread is None
    with pytest.raises(ValueError, match="on_stall must be 'warn' or 'fail'"):
        Watchdog({"on_stall": "panic"}, tmp_path)


def test_the_driver_busy_outside_any_group_is_reported_with_its_threads_and_probes(tmp_path):
    dog = Watchdog({"deadline_s": 0.2}, tmp_path)
    dog.add_probe("rollout pool", lambda: ["group 7 on runner 0 for 12.0s"])
    deadline = time.monotonic() + HANG_GUARD_S
    with dog.phase("wait_rollout"):
        while not dog.reports and time.monotonic() < deadline:  # busy in the driver itself until reported
            time.sleep(0.05)
    dog.close()
    text = (tmp_path / "step_0_wait_rollout.txt").read_text()
    assert "no worker-group call in flight" in text and "== rollout pool" in text
    driver = text.split("== the driver thread running phase 'wait_rollout'")[1].split("== the driver's other")[0]
    assert "group 7 on runner 0 for 12.0s" in text and "in test_the_driver_busy_outside_any_group" in driver, text


def test_config_defaults_and_checks():
    cfg = load_config({}, ["trainer"])
    w = cfg.trainer.watchdog
    assert (w.enable, w.deadline_s, w.on_stall) == (True, 1800.0, "warn")
    assert w.deadlines.wait_rollout == 300.0 and w.deadlines.step == 7200.0
    cfg = load_config({"trainer": {"watchdog": {"deadlines": {"gen": 5}}}}, ["trainer"])
    assert cfg.trainer.watchdog.deadlines.gen == 5.0 and cfg.trainer.watchdog.deadlines.sync_weights == 600.0
    with pytest.raises(ConfigError, match="on_stall"):
        load_config({"trainer": {"watchdog": {"on_stall": "explode"}}}, ["trainer"])
    with pytest.raises(ConfigError, match=">= 0"):
        load_config({"trainer": {"watchdog": {"deadlines": {"gen": -1}}}}, ["trainer"])


@pytest.mark.slow
def test_ray_group_fail_names_the_rank_and_its_process_stack(tmp_path, ray_cluster, caplog):
    from rlcore.single_controller import RayResourcePool, RayWorkerGroup

    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="watchdog")
    group = RayWorkerGroup(pool, ClassWithInitArgs(Sleeper), name_prefix="watchdog")
    dog = Watchdog({"deadline_s": 1.0, "on_stall": "fail"}, tmp_path)
    dog.step = 5
    try:
        assert group.quick() == [0, 1]
        woke = tmp_path / "woke"
        start = time.monotonic()
        with pytest.raises(StallError) as err, caplog.at_level(logging.WARNING, logger="rlcore.trainer.watchdog"):
            with dog.phase("gen"):
                group.sleep_past_the_deadline(HANG_GUARD_S, only_rank=1, woke=str(woke))  # the driver blocks in ray.wait
        elapsed = time.monotonic() - start
        still_asleep = not woke.exists()  # the driver stopped waiting while rank 1 still slept (the same disk)
    finally:
        dog.close()
        group.shutdown()
        pool.shutdown()
    assert elapsed >= 1.0 and still_asleep, elapsed
    message = str(err.value)
    assert "phase 'gen' of step 5" in message and "group Sleeper rank 1 in sleep_past_the_deadline" in message, message
    [line] = [r.getMessage() for r in caplog.records if "STALL" in r.getMessage()]
    assert "phase 'gen' of step 5" in line and "group Sleeper rank 1 in sleep_past_the_deadline" in line, line
    text = (tmp_path / "step_5_gen.txt").read_text()
    rank_section = text.split("== group Sleeper rank 1")[1].split("== the driver thread")[0]
    assert "sleep_past_the_deadline" in rank_section and "most recent call first" in rank_section, text
