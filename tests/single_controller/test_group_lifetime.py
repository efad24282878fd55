"""Worker groups release what they hold when they go: dropped groups (function return, ``del``, a
``with`` block, a notebook cell re-run, ``shutdown()``) free their CPUs, so verl's tutorial driver
task and then a pool of the whole cluster are placed after them; a pool that cannot be placed says
what is free and which groups hold the rest. One fresh process with a 4-CPU Ray cluster of its own
(lifetime_check.py), so what other tests leave in the session's cluster cannot change the numbers."""

import json
import os
from pathlib import Path

import pytest

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayWorkerGroup, Worker

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def lifetime(preloaded_python):
    """``python lifetime_check.py`` in a process of its own, forked from an interpreter that imported torch and
    Ray once (tests/preloaded_python.py): its Ray cluster, garbage collector and actors are its own all the same."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent)]))
    env.pop("RAY_ADDRESS", None)  # a cluster of its own, not one this environment points at
    proc = preloaded_python.run(None, script=HERE / "lifetime_check.py", cwd=HERE, timeout=900, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"lifetime check failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
def test_dropped_groups_are_collected_at_once_and_their_actors_killed(lifetime):
    dropped = lifetime["dropped"]
    assert [d["how"] for d in dropped] == ["function returns", "del wg", "with block", "cell re-run", "shutdown()"]
    assert all(d["collected"] for d in dropped), dropped  # with the cyclic GC off: no cycle keeps a group
    assert dropped[1]["actors_before"] and all(d["actors_left"] == [] for d in dropped), dropped


@pytest.mark.slow
def test_verl_tutorial_driver_task_places_three_colocated_groups_after_dropped_ones(lifetime):
    # 2 of the 4 CPUs for the pool, 0.5 for the fused group, 1 for the task itself: one leaked group
    # of the six dropped before (2 CPUs each) and this would wait forever
    assert lifetime["main_task"] == [[0], [10], [20], [0], [7]]


@pytest.mark.slow
def test_a_pool_of_the_whole_cluster_is_placed_after_everything_was_dropped(lifetime):
    assert lifetime["whole_cluster"] == [0]  # one rank holding all 4 CPUs
    assert lifetime["cpus_free_at_end"] == 4.0


@pytest.mark.slow
def test_an_unplaceable_pool_names_what_is_free_and_who_holds_the_rest(lifetime):
    info = lifetime["unplaceable"]
    error = info["error"]
    assert error is not None, "the pool of 2 CPUs was placed although a group held 3 of 4"
    assert "resource pool 'late'" in error and "within 2s" in error
    assert "The cluster has {CPU: 4}, {CPU: 1} free now" in error
    assert f"placement group '{info['holder_pg']}_node0' holds {{CPU: 3}}" in error
    assert f"used by worker group(s) {info['holder']} (1 rank)" in error
    assert "wg.shutdown()" in error


class Probe(Worker):
    pass


def test_in_process_groups_close_in_a_with_block_too():
    with LocalWorkerGroup(ClassWithInitArgs(Probe), world_size=2) as wg:
        assert len(wg.hosts) == 2
    assert wg.hosts == []


def test_detached_groups_are_refused_by_name():
    with pytest.raises(ValueError, match="detached=False"):
        RayWorkerGroup(None, ClassWithInitArgs(Probe), detached=True)
