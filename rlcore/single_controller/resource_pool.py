"""RayResourcePool: CPU/GPU bundles on one or more nodes, as Ray placement groups.

One placement group per node entry (STRICT_PACK keeps a node's ranks together). Before asking Ray,
the pool checks that the cluster can ever satisfy the request: Ray itself would wait forever on an
impossible placement group, which is how a GPU default hangs on a CPU box.

Placement-group names carry a random suffix: Ray refuses a second group under a name that already
exists, so two pools of the same prefix in one cluster (two runs, or a run and its tests) must differ.
"""

from __future__ import annotations

import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group


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
        self.pg_name_prefix = f"{name_prefix}_{uuid.uuid4().hex[:8]}"  # unique in the cluster (module docstring)
        self.ready_timeout_s = ready_timeout_s
        self._pgs: list | None = None
        self._groups: dict[int, dict[str, float]] = {}  # group id -> what each of its actors takes from a bundle

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
        if self._pgs is None:
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
                    f"placement groups for {self.process_on_nodes} processes x {self.bundle()} were not ready within "
                    f"{self.ready_timeout_s:g}s: the resources exist but are held by other actors or placement groups "
                    f"(available now: {ray.available_resources()})"
                )
            self._pgs = pgs
        return self._pgs

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

    def claim(self, group_id: int, demand: dict[str, float] | None = None) -> None:
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

    def release(self, group_id: int) -> None:
        self._groups.pop(group_id, None)

    def shutdown(self) -> None:
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None
