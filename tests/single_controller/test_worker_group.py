"""Worker groups: every dispatch mode gives the same result through Ray and in-process."""

import os
import time

import numpy as np
import pytest
import torch

from rlcore.protocol import DataProto
from rlcore.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    DispatchMode,
    Execute,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
    create_colocated_worker_cls,
    mesh_dispatch,
    register,
)


def _scatter_range(ctx, args, kwargs):
    """A user-defined mode: rank r gets (start + r)."""
    return [((args[0] + r,), {}) for r in range(ctx.world_size)]


def _sum(ctx, outputs):
    return sum(outputs)


class Calc(Worker):
    def __init__(self, scale: int):
        self.scale = scale
        self.calls = 0

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self):
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "scale": self.scale}

    @register(Dispatch.ALL_TO_ALL)
    def add(self, x, y):
        return x + y + self.rank

    @register(Dispatch.DP_COMPUTE)
    def square(self, x):
        return x * x

    @register(Dispatch.RANK_ZERO)
    def rank_zero_only(self, x):
        self.calls += 1
        return (self.rank, x)

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def count_calls(self):
        return self.calls

    @register(Dispatch.DP_COMPUTE_PROTO)
    def scale_ids(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(
            {"out": data.batch["ids"] * self.scale, "rank": torch.full((len(data),), self.rank)},
            {"uid": data.non_tensor_batch["uid"]},
        )

    @register(Dispatch.DP_COMPUTE_PROTO)
    def two_samples_per_row(self, data: DataProto) -> DataProto:
        return data.repeat(2, interleave=True)

    @register(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"out": fn(data.batch["ids"])})

    @register(Dispatch.DP_COMPUTE_METRIC)
    def row_count(self, data: DataProto):
        return {"rows": len(data), "rank": self.rank}

    @register(DispatchMode(_scatter_range, _sum, "scatter_sum"))
    def identity(self, x):
        return x

    @register(Dispatch.RANK_ZERO)
    def fail(self):
        raise ValueError("the reward table is empty")

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds):
        time.sleep(seconds)
        return True


def batch(n):
    return DataProto.from_dict({"ids": torch.arange(n)}, {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)})


@pytest.fixture(scope="module")
def ray_group(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="calc")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(Calc, scale=3), default_timeout=60)
    yield wg
    wg.shutdown()
    pool.shutdown()


@pytest.fixture(scope="module")
def local_group():
    return LocalWorkerGroup(ClassWithInitArgs(Calc, scale=3), world_size=2)


@pytest.fixture(params=["ray", "local"])
def wg(request):
    return request.getfixturevalue(f"{request.param}_group")


def test_ranks_and_env(wg):
    infos = wg.whoami()
    assert [(i["rank"], i["world_size"], i["scale"]) for i in infos] == [(0, 2, 3), (1, 2, 3)]


def test_ray_ranks_are_separate_processes(ray_group):
    pids = [i["pid"] for i in ray_group.whoami()]
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_all_to_all_and_dp_compute(wg):
    assert wg.add([1, 10], y=[100, 1000]) == [101, 1011]
    assert wg.square([3, 4]) == [9, 16]
    with pytest.raises(ValueError, match=r"argument #0 must be a list with one entry per rank \(2\)"):
        wg.add([1], [2])


def test_rank_zero_dispatch_and_execute(wg):
    assert wg.rank_zero_only("x") == (0, "x")
    assert wg.count_calls() == [1]  # only rank 0 ran, and it is the same rank 0 as above


def test_dp_compute_proto_splits_and_concats(wg):
    out = wg.scale_ids(batch(6))
    assert out.batch["out"].tolist() == [0, 3, 6, 9, 12, 15]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1]
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(6)]


def test_indivisible_batch_is_an_error_unless_padding_is_asked(wg):
    with pytest.raises(ValueError, match="batch of 5 rows does not divide across 2 ranks"):
        wg.scale_ids(batch(5))
    out = wg.scale_ids.options(pad=True)(batch(5))
    assert out.batch["out"].tolist() == [0, 3, 6, 9, 12]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]


def test_padding_removed_when_each_row_gives_several(wg):
    out = wg.two_samples_per_row.options(pad=True)(batch(3))
    assert out.batch["ids"].tolist() == [0, 0, 1, 1, 2, 2]


def test_with_func_and_metric_modes(wg):
    assert wg.apply(lambda t: t + 100, batch(4)).batch["out"].tolist() == [100, 101, 102, 103]
    assert wg.row_count(batch(4)) == [{"rows": 2, "rank": 0}, {"rows": 2, "rank": 1}]


def test_user_registered_dispatch_mode(wg):
    assert wg.identity(10) == 10 + 11


def test_worker_exception_names_rank_method_and_traceback(wg):
    with pytest.raises(WorkerError) as info:
        wg.fail()
    err = info.value
    assert err.rank == 0 and err.method == "fail"
    assert "the reward table is empty" in str(err) and "ValueError" in str(err)
    assert "in fail" in err.remote_traceback  # the worker-side frame is there


def test_non_blocking_future(wg):
    future = wg.scale_ids.options(blocking=False)(batch(4))
    assert future.get().batch["out"].tolist() == [0, 3, 6, 9]


def test_timeout(ray_group):
    with pytest.raises(WorkerTimeoutError, match=r"nap did not finish within 0.5s on rank\(s\) \[0, 1\]"):
        ray_group.nap.options(timeout=0.5)(3)
    assert ray_group.nap.options(timeout=10)(0) == [True, True]


def test_busy_seconds_count_each_ranks_time_inside_methods(wg):
    """What benchmarks/step.py subtracts from a call's time to get the transport's share."""
    before = wg.busy_seconds()
    start = time.perf_counter()
    wg.nap(0.3)
    elapsed = time.perf_counter() - start
    spent = [after - b for after, b in zip(wg.busy_seconds(), before)]
    assert len(spent) == wg.world_size
    assert all(0.3 <= s <= elapsed for s in spent), (spent, elapsed)


def test_same_results_from_ray_and_in_process(ray_group, local_group):
    data = batch(8)
    a, b = ray_group.scale_ids(data), local_group.scale_ids(data)
    assert torch.equal(a.batch["out"], b.batch["out"]) and torch.equal(a.batch["rank"], b.batch["rank"])


# ------------------------------------------------------------------ futures between groups
class Doubler(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ids": data.batch["ids"] * 2, "pid": torch.full((len(data),), os.getpid())})

    @register(Dispatch.RANK_ZERO)
    def weights(self):
        return {"w": torch.arange(4.0)}

    @register(Dispatch.ONE_TO_ALL)
    def load(self, weights):
        return float(weights["w"].sum())


def test_future_passes_between_groups_without_the_driver(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.5, max_colocate_count=2, name_prefix="dbl")
    pool3 = RayResourcePool([3], num_cpus_per_process=0.25, name_prefix="dbl3")
    producer = RayWorkerGroup(pool, ClassWithInitArgs(Doubler))
    same_size = RayWorkerGroup(pool, ClassWithInitArgs(Doubler))
    other_size = RayWorkerGroup(pool3, ClassWithInitArgs(Doubler))
    try:
        import ray

        first = producer.double.options(blocking=False)(batch(6))
        # Same world size: rank i receives the object ref of producer rank i (resolved by Ray).
        per_rank = first.split_for(type("Ctx", (), {"group": same_size, "pad": False, "scratch": {}})(), 2, "x")
        assert all(isinstance(p, ray.ObjectRef) for p in per_rank)
        assert same_size.double(first).batch["ids"].tolist() == [0, 4, 8, 12, 16, 20]
        # Different world size: each rank fetches the producer's outputs itself.
        second = producer.double.options(blocking=False)(batch(6))
        assert other_size.double(second).batch["ids"].tolist() == [0, 4, 8, 12, 16, 20]
        # A RANK_ZERO result broadcast to every rank of another group (weight-sync shape).
        assert other_size.load(producer.weights.options(blocking=False)()) == [6.0, 6.0, 6.0]
    finally:
        for g in (producer, same_size, other_size):
            g.shutdown()
        pool.shutdown()
        pool3.shutdown()


# ------------------------------------------------------------------ colocation
class Actor(Worker):
    def __init__(self):
        self.weight = torch.ones(3)

    @register(Dispatch.ONE_TO_ALL)
    def step(self):
        self.weight += 1
        return float(self.weight.sum())


class Rollout(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def sync_and_read(self):
        actor = self.colocated_workers["actor"]  # same process: no copy across the wire
        return float(actor.weight.sum()), os.getpid()


@pytest.mark.parametrize("kind", ["ray", "local"])
def test_colocated_roles_share_a_process(kind, ray_cluster):
    classes = create_colocated_worker_cls({"actor": ClassWithInitArgs(Actor), "rollout": ClassWithInitArgs(Rollout)})
    if kind == "ray":
        pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="colo")
        wg = RayWorkerGroup(pool, classes)
    else:
        wg = LocalWorkerGroup(classes, world_size=1)
    assert wg.actor_step() == [6.0] * wg.world_size
    values = wg.rollout_sync_and_read()
    assert [v for v, _ in values] == [6.0] * wg.world_size
    roles = wg.spawn({"actor", "rollout"})
    assert roles["actor"].step() == [9.0] * wg.world_size
    assert [v for v, _ in roles["rollout"].sync_and_read()] == [9.0] * wg.world_size
    assert not hasattr(roles["actor"], "sync_and_read")
    if kind == "ray":
        assert [p for _, p in values] == [i["pid"] for i in wg.worker_info]
        wg.shutdown()
        pool.shutdown()


# ------------------------------------------------------------------ mesh-aware DP
class TensorParallel(Worker):
    """4 ranks as dp=2 x tp=2: tp peers see the same data; one of them reports."""

    def __init__(self):
        self.register_mesh("actor", dp_rank=self.rank // 2, dp_size=2, is_collect=self.rank % 2 == 0)

    @register(mesh_dispatch("actor"))
    def forward(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"ids": data.batch["ids"], "rank": torch.full((len(data),), self.rank)})


@pytest.mark.parametrize("kind", ["ray", "local"])
def test_mesh_dispatch(kind, ray_cluster):
    if kind == "ray":
        pool = RayResourcePool([4], num_cpus_per_process=0.25, name_prefix="mesh")
        wg = RayWorkerGroup(pool, ClassWithInitArgs(TensorParallel))
    else:
        wg = LocalWorkerGroup(ClassWithInitArgs(TensorParallel), world_size=4)
    out = wg.forward(batch(6))
    assert out.batch["ids"].tolist() == list(range(6))
    assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # collected from the DP heads only
    if kind == "ray":
        wg.shutdown()
        pool.shutdown()


# ------------------------------------------------------------------ failures that must not hang
class Fragile(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def crash_on_rank1(self):
        if self.rank == 1:
            os._exit(3)
        time.sleep(3600)  # longer than any timeout here: only a prompt failure ends the call
        return "survived"


def test_dead_worker_fails_promptly(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="fragile")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(Fragile))
    # waiting for rank 0 (an hour) would end in WorkerTimeoutError after the 300 s limit, not WorkerDiedError
    with pytest.raises(WorkerDiedError) as info:
        wg.crash_on_rank1.options(timeout=300)()
    assert info.value.rank == 1 and info.value.method == "crash_on_rank1"
    assert "died" in str(info.value)
    wg.shutdown()
    pool.shutdown()


def test_pool_refuses_more_groups_than_it_can_colocate(ray_cluster):
    from rlcore.single_controller import ResourceError

    pool = RayResourcePool([1], num_cpus_per_process=0.25, name_prefix="full")
    first = RayWorkerGroup(pool, ClassWithInitArgs(Doubler))
    with pytest.raises(ResourceError, match="already hosts 1 worker group"):
        RayWorkerGroup(pool, ClassWithInitArgs(Doubler))
    first.shutdown()
    RayWorkerGroup(pool, ClassWithInitArgs(Doubler)).shutdown()  # the share is free again
    pool.shutdown()


def test_impossible_resources_fail_fast(ray_cluster):
    from rlcore.single_controller import ResourceError

    pool = RayResourcePool([2], use_gpu=True, name_prefix="gpu", ready_timeout_s=3600)
    with pytest.raises(ResourceError, match="can never place 2 processes .* No GPUs in this cluster"):
        RayWorkerGroup(pool, ClassWithInitArgs(Calc, scale=1))  # the check before Ray is asked, not the hour's wait
    with pytest.raises(ResourceError, match="can never place 64 processes"):
        RayResourcePool([64], num_cpus_per_process=1).placement_groups()


def test_constructor_error_names_rank(ray_cluster):
    class Broken(Worker):
        def __init__(self):
            raise RuntimeError("model path does not exist")

    pool = RayResourcePool([1], num_cpus_per_process=0.25, name_prefix="broken")
    with pytest.raises(WorkerError, match="__init__ failed on rank 0"):
        RayWorkerGroup(pool, ClassWithInitArgs(Broken))
    pool.shutdown()


def test_torch_distributed_inside_ray_workers(ray_cluster):
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="dist")
    wg = RayWorkerGroup(pool, ClassWithInitArgs(AllReduce))
    assert wg.all_reduce_rank() == [1.0, 1.0]  # 0 + 1 summed over gloo
    wg.shutdown()
    pool.shutdown()


class AllReduce(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self):
        import torch.distributed as dist

        self.init_distributed()
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return float(t.item())


def test_in_process_group_refuses_multi_rank_collectives():
    wg = LocalWorkerGroup(ClassWithInitArgs(AllReduce), world_size=2)
    with pytest.raises(WorkerError, match="cannot run torch.distributed collectives"):
        wg.all_reduce_rank()
