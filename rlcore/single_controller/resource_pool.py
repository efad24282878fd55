"""RayResourcePool: CPU/GPU bundles on one or more nodes, as Ray placement groups.

One placement group per node entry (STRICT_PACK keeps a node's ranks together). Before asking Ray,
the pool checks that the cluster can ever satisfy the request: Ray itself would wait forever on an
impossible placement group, which is how a GPU default hangs on a CPU box.

Placement-group names carry a random suffix (the pool's ``tag``): Ray refuses a second group under a
name that already exists, so two pools of the same prefix in one cluster (two runs, or a run and its
tests) must differ. The worker groups' actor names carry the same tag, which is how an error names
the groups that hold a pool's bundles, even groups built by another process of the job.

Lifetime: Ray removes a placement group only when asked (or when the job ends), even when the task
that made it has returned. A pool therefore holds its placement groups only while a worker group
uses it: the last group to go (``wg.shutdown()``, or the group garbage-collected) removes them, and
the next group places them again. A pool that is dropped removes them too, and so does
``pool.shutdown()``.
"""

from __future__ import annotations

import re
import uuid
import weakref

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group


class ResourceError(RuntimeError):
    """The cluster cannot (or did not in time) provide the requested bundles."""


class RayResourcePool:
    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        num_cpus_per_process: float = 1.0,
        num_gpus_per_process: float = 1.0,
        max_colocate_count: int = 1,
        name_prefix: str = "rlcore",
        ready_timeout_s: float = 120.0,
        detached: bool = False,
    ) -> None:
        if detached:
            raise ValueError("detached resource pools are not supported: a pool and its groups live as long as the "
                             "driver that built them; build it with detached=False (the default)")
        if not process_on_nodes or any(n <= 0 for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must list a positive process count per node, got {process_on_nodes}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.num_cpus_per_process = num_cpus_per_process
        self.num_gpus_per_process = num_gpus_per_process if use_gpu else 0
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix
        self.tag = uuid.uuid4().hex[:8]  # unique in the cluster (module docstring)
        self.pg_name_prefix = f"{name_prefix}_{self.tag}"
        self.ready_timeout_s = ready_timeout_s
        self._pgs: list = []  # placed while a group uses the pool; the list object is shared with the finalizer
        self._groups: dict[str, dict[str, float]] = {}  # group key -> what each of its actors takes from a bundle
        self._finalizer = weakref.finalize(self, _remove_placement_groups, self._pgs)
        self._finalizer.atexit = False  # at interpreter exit the job ends, and Ray removes them itself

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def bundle(self) -> dict[str, float]:
        b = {"CPU": self.num_cpus_per_process}
        if self.use_gpu:
            b["GPU"] = self.num_gpus_per_process
        return b

    def actor_resources(self) -> dict[str, float]:
        """What one worker group's actor takes from its bundle (several groups may share a bundle)."""
        return {k: v / self.max_colocate_count for k, v in self.bundle().items()}

    def placement_groups(self) -> list:
        """The pool's placement groups (one per node entry), placed on first use: within
        ``ready_timeout_s``, or a ``ResourceError`` naming what is free and who holds the rest."""
        if not self._pgs:
            if not ray.is_initialized():
                raise RuntimeError("ray is not initialized: call ray.init(...) before building a RayResourcePool's groups")
            self._check_feasible()
            pgs = [
                placement_group([self.bundle()] * n, strategy="STRICT_PACK", name=f"{self.pg_name_prefix}_node{i}")
                for i, n in enumerate(self.process_on_nodes)
            ]
            ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
            if len(ready) < len(pgs):
                for pg in pgs:
                    remove_placement_group(pg)
                raise ResourceError(
                    f"resource pool {self.name_prefix!r} ({self.process_on_nodes} processes x {self.bundle()}) could not "
                    f"be placed within {self.ready_timeout_s:g}s: the cluster has the resources but they are taken. "
                    f"{describe_holders(list(self.bundle()), exclude=self.pg_name_prefix)} Free them (wg.shutdown(), "
                    "`with RayWorkerGroup(...) as wg:`, pool.shutdown()), or ask for less."
                )
            self._pgs[:] = pgs
        return list(self._pgs)

    def slots(self) -> list[tuple[object, int, int]]:
        """(placement group, bundle index, local rank on that node) for every rank, in rank order."""
        return [(pg, i, i) for pg, n in zip(self.placement_groups(), self.process_on_nodes) for i in range(n)]

    def _check_feasible(self) -> None:
        need = self.bundle()
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        capacity = [{k: node.get(k, 0.0) for k in need} for node in nodes]
        for count in sorted(self.process_on_nodes, reverse=True):
            want = {k: v * count for k, v in need.items()}
            fits = [c for c in capacity if all(c[k] + 1e-9 >= want[k] for k in want)]
            if not fits:
                raise ResourceError(
                    f"the cluster can never place {count} processes x {need} on one node "
                    f"(node totals: {[{k: n.get(k, 0) for k in need} for n in nodes]}). "
                    + ("No GPUs in this cluster: use CPU workers (trainer.device=cpu / use_gpu=False)."
                       if self.use_gpu and not any(n.get("GPU") for n in nodes) else
                       "Ask for fewer processes per node or fewer CPUs/GPUs per process.")
                )
            best = max(fits, key=lambda c: sum(c.values()))
            for k in want:
                best[k] -= want[k]

    def claim(self, group_id: str, demand: dict[str, float] | None = None) -> None:
        """Reserve what one worker group's actors take from every bundle (``demand``, default the
        ``actor_resources`` share). More than max_colocate_count groups, or demands that together
        exceed a bundle, would never schedule: Ray would wait forever, so this refuses at once."""
        demand = self.actor_resources() if demand is None else dict(demand)
        if len(self._groups) >= self.max_colocate_count:
            raise ResourceError(
                f"resource pool {self.name_prefix!r} already hosts {len(self._groups)} worker group(s) and "
                f"max_colocate_count={self.max_colocate_count}; build it with a larger max_colocate_count to colocate "
                "more groups, e.g. RayResourcePool(..., max_colocate_count=3) for three (verl's pools default to 10, "
                "rlcore's to 1: each group then gets the whole bundle), or colocate the roles in one group "
                "(create_colocated_worker_cls)"
            )
        bundle = self.bundle()
        for key, want in demand.items():
            taken = sum(g.get(key, 0.0) for g in self._groups.values())
            if want > 0 and taken + want > bundle.get(key, 0.0) + 1e-9:
                raise ResourceError(
                    f"resource pool {self.name_prefix!r}: each bundle holds {key}={bundle.get(key, 0.0):g}, the groups "
                    f"already on it take {taken:g} and this group's workers ask for {want:g} (their @ray.remote options); "
                    f"ask for less, or build the pool with more per process (num_cpus_per_process / num_gpus_per_process)"
                )
        self._groups[group_id] = demand

    def release(self, group_id: str) -> None:
        """A group leaves the pool; the last one to leave removes the placement groups (module docstring)."""
        self._groups.pop(group_id, None)
        if not self._groups:
            _remove_placement_groups(self._pgs)

    @property
    def groups(self) -> list[str]:
        """Keys of the worker groups on this pool now (their actors' names start so)."""
        return list(self._groups)

    def shutdown(self) -> None:
        """Remove the placement groups now (a group still on the pool loses its processes with them)."""
        _remove_placement_groups(self._pgs)


def _remove_placement_groups(pgs: list) -> None:
    """Remove and forget ``pgs`` (emptied in place); a no-op once Ray is shut down, which removed them."""
    placed, pgs[:] = list(pgs), []
    if placed and ray.is_initialized():
        for pg in placed:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed (the job's end, or another handle)
                pass


_ACTOR_NAME = re.compile(r"^(?P<group>.+)_rank(?P<rank>\d+)$")


def describe_holders(keys: list[str], exclude: str = "") -> str:
    """One paragraph saying, for the resource ``keys`` (CPU, GPU), what the cluster has, what is free,
    and who holds the rest: each placement group with its bundles and the worker groups whose actors
    run in it (matched by the pool tag in the names), then what tasks and actors outside placement
    groups take. ``exclude``: placement groups whose name starts so (the caller's own, just removed)."""
    total, free = ray.cluster_resources(), ray.available_resources()
    groups: dict[str, int] = {}
    for name in ray.util.list_named_actors():
        match = _ACTOR_NAME.match(name)
        if match:
            groups[match["group"]] = groups.get(match["group"], 0) + 1
    held, lines = dict.fromkeys(keys, 0.0), []
    for info in placement_group_table().values():
        if info["state"] != "CREATED" or (exclude and info["name"].startswith(exclude)):
            continue
        reserved = {k: sum(b.get(k, 0.0) for b in info["bundles"].values()) for k in keys}
        if not any(reserved.values()):
            continue
        for k in keys:
            held[k] += reserved[k]
        tag = _pool_tag(info["name"])
        users = [f"{g} ({n} rank{'s' * (n > 1)})" for g, n in sorted(groups.items()) if tag and f"_{tag}_" in g + "_"]
        lines.append(f"placement group {info['name'] or info['placement_group_id']!r} holds {_fmt(reserved)}"
                     + (f", used by worker group(s) {', '.join(users)}" if users else ", used by no rlcore worker group"))
    outside = {k: max(0.0, total.get(k, 0.0) - free.get(k, 0.0) - held[k]) for k in keys}
    if any(outside.values()):
        lines.append(f"tasks and actors outside placement groups take {_fmt(outside)}")
    cluster = {k: total.get(k, 0.0) for k in keys}
    return (f"The cluster has {_fmt(cluster)}, {_fmt({k: free.get(k, 0.0) for k in keys})} free now; held: "
            + ("; ".join(lines) if lines else "nothing that Ray reports") + ".")


def _pool_tag(pg_name: str) -> str:
    """The pool tag in a placement-group name ``<prefix>_<tag>_node<i>``, or '' for another's group."""
    match = re.search(r"_([0-9a-f]{8})_node\d+$", pg_name or "")
    return match.group(1) if match else ""


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"
