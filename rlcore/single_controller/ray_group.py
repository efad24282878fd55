"""RayWorkerGroup: one Ray actor per bundle of a resource pool, each hosting the worker(s) of one rank."""

from __future__ import annotations

import re
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.single_controller.resource_pool import RayResourcePool
from rlcore.single_controller.worker import WorkerHost
from rlcore.single_controller.worker_group import (
    ClassWithInitArgs,
    ColocatedClasses,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
)

_RemoteHost = ray.remote(WorkerHost)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its traceback headers


def plain_text(error: BaseException | str) -> str:
    """An error's text without the colour codes Ray puts in its tracebacks (for messages and logs)."""
    return _ANSI.sub("", str(error))


class RayWorkerGroup(WorkerGroup):
    passes_object_refs = True

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: ClassWithInitArgs | ColocatedClasses,
        name_prefix: str = "rlcore",
        default_timeout: float | None = 3600.0,
        init_timeout: float = 600.0,
        env_vars: dict[str, str] | None = None,
    ) -> None:
        super().__init__(ray_cls_with_init, resource_pool.world_size, default_timeout)
        self.resource_pool = resource_pool
        resource_pool.claim(id(self))
        resources = resource_pool.actor_resources()
        self.hosts = []
        for rank, (pg, bundle_index, _) in enumerate(resource_pool.slots()):
            options = {
                "num_cpus": resources.get("CPU", 0),
                "num_gpus": resources.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
                "name": f"{name_prefix}_{'+'.join(self._roles)}_rank{rank}_{id(self):x}",
            }
            self.hosts.append(_RemoteHost.options(**options).remote())

        master_addr, master_port = self._get([self.hosts[0].master_address.remote()], "master_address", init_timeout)[0]
        roles = {role: (c.cls, c.args, c.kwargs) for role, c in self._roles.items()}
        build_refs = []
        for rank, (_, _, local_rank) in enumerate(resource_pool.slots()):
            env = {
                **(env_vars or {}),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local_rank),
                "MASTER_ADDR": str(master_addr),
                "MASTER_PORT": str(master_port),
            }
            build_refs.append(self.hosts[rank].build.remote(env, roles))
        self.worker_info = self._get(build_refs, "__init__", init_timeout)
        self._bind_methods()

    def _get(self, refs: list, method: str, timeout: float | None) -> list:
        return self._wait(refs, list(range(len(refs))), method, timeout)

    def _submit(self, role: str, method: str, calls: list[tuple[tuple, dict]]) -> list:
        return [self.hosts[rank].execute.remote(role, method, *args, **kwargs) for rank, (args, kwargs) in enumerate(calls)]

    def _wait(self, handles: list, ranks: list[int], method: str, timeout: float | None) -> list:
        """Gather per-rank results, failing at the first error or dead rank instead of waiting for all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = dict(zip(handles, ranks))
        results: dict[int, object] = {}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            if not ready:
                raise WorkerTimeoutError(method, sorted(pending.values()), timeout)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref, timeout=max(1.0, remaining or 1.0))
                except RayActorError as exc:
                    raise WorkerDiedError(method, rank, f"the worker process died: {exc}") from None
                except RayTaskError as exc:
                    raise WorkerError(method, rank, plain_text(exc)) from None
                except GetTimeoutError:
                    raise WorkerTimeoutError(method, [rank], timeout) from None
        return [results[r] for r in ranks]

    def _query_mesh(self, role: str, mesh_name: str) -> list[dict]:
        return self._get([h.mesh_info.remote(role, mesh_name) for h in self.hosts], "mesh_info", 60)

    def shutdown(self) -> None:
        """Kill this group's actors (the resource pool stays, so another group can use it)."""
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        self.hosts = []
        self.resource_pool.release(id(self))
