"""Run by test_group_lifetime.py in a fresh process with a Ray cluster of its own (4 CPUs): worker
groups made and dropped the ways notebooks and tutorials drop them, then pools that need what the
dropped groups held. The cyclic garbage collector is off, so a group is released only if dropping
its last reference frees it at once (no reference cycle keeps it). Prints one ``RESULT {json}`` line.
"""

import gc
import json
import sys
import time
import weakref

import ray

from rlcore.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    RayResourcePool,
    RayWorkerGroup,
    ResourceError,
    Worker,
    create_colocated_worker_cls,
    register,
)

CLUSTER_CPUS = 4


class Echo(Worker):
    def __init__(self, offset=0):
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        return self.offset + self.rank


def pool_of(cpus, ranks=1, **kwargs):
    """A pool of ``cpus`` CPUs in ``ranks`` processes (few processes: each one imports torch)."""
    return RayResourcePool([ranks], num_cpus_per_process=cpus / ranks, ready_timeout_s=60, **kwargs)


def named(group_name, settle_s=30.0):
    """The group's actors still registered; a killed actor leaves Ray's registry shortly after the
    kill, so this waits up to ``settle_s`` for them to go (a deadline, not a measured time)."""
    deadline = time.monotonic() + settle_s
    while True:
        left = sorted(n for n in ray.util.list_named_actors() if n.startswith(group_name))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def drop_by_return():
    """A function that builds a group, uses it and returns: the group goes with its frame."""
    wg = RayWorkerGroup(pool_of(2, ranks=2), ClassWithInitArgs(Echo))
    assert wg.where() == [0, 1]
    return weakref.ref(wg), wg.group_name


def dropped_groups() -> list[dict]:
    """Four ways a group goes, each on a pool of 2 of the 4 CPUs: two leaked groups would fill the cluster."""
    seen = []
    ref, name = drop_by_return()
    seen.append({"how": "function returns", "collected": ref() is None, "actors_left": named(name)})

    wg = RayWorkerGroup(pool_of(2), ClassWithInitArgs(Echo))
    ref, name, actors = weakref.ref(wg), wg.group_name, named(wg.group_name, settle_s=0)
    del wg
    seen.append({"how": "del wg", "collected": ref() is None, "actors_before": actors, "actors_left": named(name)})

    with RayWorkerGroup(pool_of(2), ClassWithInitArgs(Echo)) as wg:
        assert wg.where() == [0]
    seen.append({"how": "with block", "collected": not wg.alive, "actors_left": named(wg.group_name)})

    wg = RayWorkerGroup(pool_of(2), ClassWithInitArgs(Echo))  # a notebook cell ...
    first, name = weakref.ref(wg), wg.group_name
    wg = RayWorkerGroup(pool_of(2), ClassWithInitArgs(Echo))  # ... run again
    seen.append({"how": "cell re-run", "collected": first() is None, "actors_left": named(name)})
    wg.shutdown()
    seen.append({"how": "shutdown()", "collected": not wg.alive, "actors_left": named(wg.group_name)})
    return seen


@ray.remote
def main_task():
    """verl's extension tutorial: a driver task builds three groups colocated on one pool."""
    pool = RayResourcePool([1], num_cpus_per_process=2, max_colocate_count=3, ready_timeout_s=60)
    groups = [RayWorkerGroup(pool, ClassWithInitArgs(Echo, offset=10 * i)) for i in range(3)]
    fused = RayWorkerGroup(RayResourcePool([1], num_cpus_per_process=0.5, ready_timeout_s=60),
                           create_colocated_worker_cls({"a": ClassWithInitArgs(Echo), "b": ClassWithInitArgs(Echo, 7)}))
    views = fused.spawn(["a", "b"])
    del fused  # the views keep the processes
    return [g.where() for g in groups] + [views["a"].where(), views["b"].where()]


def unplaceable_pool_error() -> dict:
    """A group holds 3 of the 4 CPUs; a pool of 2 more cannot be placed and must say who holds what."""
    holder = RayWorkerGroup(pool_of(3, name_prefix="holder"), ClassWithInitArgs(Echo))
    try:
        RayResourcePool([2], num_cpus_per_process=1, name_prefix="late", ready_timeout_s=2).placement_groups()
    except ResourceError as exc:
        return {"error": str(exc), "holder": holder.group_name, "holder_pg": holder.resource_pool.pg_name_prefix}
    finally:
        holder.shutdown()
    return {"error": None}


def main() -> None:
    gc.disable()
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        result = {"dropped": dropped_groups()}
        wg = RayWorkerGroup(pool_of(2), ClassWithInitArgs(Echo))  # one more dropped group before the driver task
        del wg
        result["main_task"] = ray.get(main_task.remote(), timeout=300)
        result["unplaceable"] = unplaceable_pool_error()
        # the whole cluster in one bundle: only if nothing was leaked (one rank: each process imports torch)
        whole = pool_of(CLUSTER_CPUS, name_prefix="whole")
        with RayWorkerGroup(whole, ClassWithInitArgs(Echo)) as wg:
            result["whole_cluster"] = wg.where()  # [0]
        deadline = time.monotonic() + 30  # placement groups are removed asynchronously
        while ray.available_resources().get("CPU", 0.0) < CLUSTER_CPUS and time.monotonic() < deadline:
            time.sleep(0.2)
        result["cpus_free_at_end"] = ray.available_resources().get("CPU", 0.0)
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
