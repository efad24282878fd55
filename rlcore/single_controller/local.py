"""LocalWorkerGroup: the same workers and group methods, run in the driver's own process.

For notebooks, debugging, and machines without Ray (the GPU check machine). Calls run synchronously
in the caller's thread, so a timeout cannot interrupt them; errors are raised as ``WorkerError``
naming the rank and method, exactly as from a ``RayWorkerGroup``.
"""

from __future__ import annotations

import os
import traceback

from rlcore.single_controller.inflight import InFlightCall, thread_stacks
from rlcore.single_controller.worker import WorkerHost, free_port, one_machine_rendezvous
from rlcore.single_controller.worker_group import ClassWithInitArgs, ColocatedClasses, WorkerError, WorkerGroup


class LocalWorkerGroup(WorkerGroup):
    """``world_size`` ranks as plain objects in this process (world_size > 1 is for dispatch logic only:
    torch.distributed needs one process per rank)."""

    def __init__(self, classes: ClassWithInitArgs | ColocatedClasses, world_size: int = 1) -> None:
        super().__init__(classes, world_size, default_timeout=None)
        port = str(free_port())
        # No TCP listener: the ranks are in this process. Their file is left to torch (removed when the store
        # closes): the process group made from it outlives the group here, and later groups' stores read it.
        rendezvous = one_machine_rendezvous()
        self.hosts = []
        self.worker_info = []
        saved = dict(os.environ)
        try:
            for rank in range(world_size):
                env = {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "RLCORE_IN_PROCESS": "1",
                    **rendezvous,
                }
                host = WorkerHost()
                roles = {role: (c.cls, c.args, c.kwargs) for role, c in self._roles.items()}
                self.worker_info.append(host.build(env, roles))
                self.hosts.append(host)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self._bind_methods()

    def worker(self, rank: int = 0, role: str | None = None):
        """The worker object itself (handy in a notebook to inspect a model)."""
        workers = self.hosts[rank].workers
        return workers[role] if role else next(iter(workers.values()))

    def _submit(self, role: str, method: str, calls: list[tuple[tuple, dict]]) -> list:
        handles = []
        for rank, (args, kwargs) in enumerate(calls):
            try:
                handles.append(("ok", self.hosts[rank].execute(role, method, *args, **kwargs)))
            except Exception as exc:  # noqa: BLE001 - re-raised with rank context in _wait
                handles.append(("error", exc, traceback.format_exc()))
        return handles

    def _wait(self, handles: list, ranks: list[int], method: str, timeout) -> list:
        for rank, handle in zip(ranks, handles):
            if handle[0] == "error":
                raise WorkerError(method, rank, handle[2]) from handle[1]
        return [h[1] for h in handles]

    def _query_mesh(self, role: str, mesh_name: str) -> list[dict]:
        return [host.mesh_info(role, mesh_name) for host in self.hosts]

    def _busy_seconds(self) -> list[float]:
        return [host.busy_seconds() for host in self.hosts]

    def _pending_ranks(self, call: InFlightCall) -> list[int]:
        return [rank for rank in call.ranks if rank < len(self.hosts) and self.hosts[rank].running]

    def _dump_stacks(self, ranks: list[int], timeout_s: float) -> dict[int, str]:
        """The stacks of the driver threads running each rank's methods (the ranks live in this process)."""
        out = {}
        for rank in ranks:
            threads = {entry[3] for entry in list(self.hosts[rank].running.values())} if rank < len(self.hosts) else set()
            out[rank] = thread_stacks(threads) if threads else f"(rank {rank} is not inside a worker method)\n"
        return out

    def shutdown(self) -> None:
        hosts, self.hosts = self.hosts, []
        for host in hosts:  # the workers live in this process: their engines are closed now, not when collected
            host.close()
