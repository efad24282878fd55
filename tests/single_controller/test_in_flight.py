"""What a group is running right now: calls in flight per rank, and the stacks of the ranks running them,
for Ray groups (a signal to each rank's process) and in-process groups (the driver's own threads)."""

import threading
import time
from pathlib import Path

import pytest

from rlcore.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    in_flight_calls,
    register,
)


class Napper(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap_for_a_while(self, seconds: float, only_rank: int | None = None):
        if only_rank is None or only_rank == self.rank:
            time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def nap_until_released(self, folder: str, only_rank: int):
        """On ``only_rank``: say so in ``folder``, then sleep until the test releases it (a hang guard: 60 s at most)."""
        if self.rank == only_rank:
            (Path(folder) / "started").touch()
            deadline = time.monotonic() + 60
            while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return self.rank

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def nap_later(self, seconds: float):
        time.sleep(seconds)
        return self.rank


def wait_until(predicate, timeout_s=30.0):
    """Polls ``predicate`` (a hang guard of ``timeout_s``: what it waits for takes well under a second)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "never got there"
        time.sleep(0.02)


def test_local_group_reports_the_running_call_and_its_thread_stack(tmp_path):
    group = LocalWorkerGroup(ClassWithInitArgs(Napper))
    assert group.in_flight() == []
    caller = threading.Thread(target=group.nap_until_released, args=(str(tmp_path), 0), name="the-driver-step")
    before = time.monotonic()
    caller.start()
    try:  # the call stays in flight until released (no race with a machine's speed)
        wait_until(lambda: group.in_flight() and group.in_flight()[0].pending)
        [call] = group.in_flight()
        assert (call.group, call.method, call.ranks, call.pending) == ("Napper", "nap_until_released", [0], [0])
        assert call.thread == caller.ident and 0 <= call.age_s() <= time.monotonic() - before  # its age: since the call
        assert any(c is call or (g is group and c.method == call.method) for g, c in in_flight_calls())
        stacks = group.dump_stacks([0])
        assert "nap_until_released" in stacks[0] and "the-driver-step" in stacks[0], stacks[0]
    finally:
        (tmp_path / "release").touch()
        caller.join()
    assert group.in_flight() == []  # collected: no longer in flight


@pytest.mark.slow
def test_ray_group_names_the_pending_rank_and_dumps_its_process_stack(ray_cluster, tmp_path):
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="inflight")
    group = RayWorkerGroup(pool, ClassWithInitArgs(Napper), name_prefix="inflight")
    try:
        assert group.nap_for_a_while(0.0) == [0, 1]
        assert group.in_flight() == []
        future = group.nap_until_released.options(blocking=False)(str(tmp_path), only_rank=1)
        # rank 0 returns at once; rank 1 is inside the method (not merely queued) until released
        wait_until(lambda: group.in_flight()[0].pending == [1] and (tmp_path / "started").exists())
        [call] = group.in_flight()
        assert (call.group, call.method, call.ranks) == ("Napper", "nap_until_released", [0, 1])
        stacks = group.dump_stacks(call.pending)
        assert "nap_until_released" in stacks[1] and "Thread" in stacks[1], stacks[1]
        (tmp_path / "release").touch()
        assert future.get() == [0, 1]
        assert group.in_flight() == []
        # A future dropped without get() is no longer the driver's business.
        dropped = group.nap_later(0.1)
        assert [c.method for c in group.in_flight()] == ["nap_later"]
        del dropped
        assert group.in_flight() == []
    finally:
        group.shutdown()
        pool.shutdown()
