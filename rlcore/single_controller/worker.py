"""Worker: the base of every SPMD role; WorkerHost: the process-side shell that builds and calls workers.

A worker is a plain class. Its rank, world size and rendezvous address come from the environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which the worker group sets before the
worker is constructed. The same class therefore runs in-process (world size 1) or as N Ray actors.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlcore.protocol import DataProto
from rlcore.single_controller import abandon
from rlcore.single_controller.inflight import register_stack_dump


class Worker:
    """Base class of SPMD workers. Subclasses need not call ``super().__init__()``."""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        env = os.environ
        self._rank = int(env.get("RANK", 0))
        self._world_size = int(env.get("WORLD_SIZE", 1))
        self._local_rank = int(env.get("LOCAL_RANK", 0))
        self._master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        self._master_port = env.get("MASTER_PORT", "")
        self._rendezvous_file = env.get(RENDEZVOUS_FILE_ENV, "")
        self._in_process = env.get("RLCORE_IN_PROCESS") == "1"
        self._mesh: dict[str, dict] = {}
        self.colocated_workers: dict[str, Any] = {}
        return self

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def master_address(self) -> tuple[str, str]:
        return self._master_addr, self._master_port

    def init_distributed(self, backend: str | None = None, timeout_s: float = 600) -> None:
        """Join the group's torch.distributed process group (gloo on CPU, nccl on GPU); idempotent.

        Ranks that share one machine (the group sets ``RLCORE_RENDEZVOUS_FILE``) meet through a file
        (torch's FileStore) and gloo's sockets bind the loopback interface, so a single-box run opens
        no port reachable from outside it: torch's TCPStore listens on every interface whatever
        MASTER_ADDR says. Ranks on several machines meet at ``tcp://MASTER_ADDR:MASTER_PORT``."""

        if self.world_size > 1 and self._in_process:
            raise RuntimeError(
                "an in-process worker group with world_size > 1 cannot run torch.distributed collectives "
                "(all ranks share one process); use world_size=1 or a RayWorkerGroup"
            )
        if dist.is_initialized():
            return
        if not (self._master_port or self._rendezvous_file):
            raise RuntimeError("MASTER_PORT is not set: build this worker through a worker group")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            # Ray shows each GPU actor only its own device(s); a torchrun-style process sees all.
            torch.cuda.set_device(self.local_rank % torch.cuda.device_count())
        if self._rendezvous_file:
            init_method = f"file://{self._rendezvous_file}"
            loopback = loopback_interface()
            if backend == "gloo" and loopback:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # the user's choice, if any, wins
        else:
            init_method = f"tcp://{self._master_addr}:{self._master_port}"
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def close(self) -> None:
        """Free now what the worker holds beyond Python objects (an engine's threads and process-wide
        state). An in-process group's shutdown calls it; a Ray rank's process simply ends. Nothing
        by default."""

    def register_mesh(self, mesh_name: str, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Declare this rank's place in a (DP x model-parallel) mesh for ``mesh_dispatch(mesh_name)``."""
        self._mesh[mesh_name] = {"dp_rank": dp_rank, "dp_size": dp_size, "is_collect": is_collect}

    def _mesh_info(self, mesh_name: str) -> dict:
        if mesh_name not in self._mesh:
            raise RuntimeError(f"rank {self.rank} has not registered mesh {mesh_name!r} (call register_mesh first)")
        return self._mesh[mesh_name]


@dataclass
class RemoteChunk:
    """A reference to part ``index`` of ``parts`` of a batch that lives as rank outputs of another group.

    The receiving worker fetches the producer's outputs straight from Ray's object store, so the
    batch never passes through the driver.
    """

    refs: list
    index: int
    parts: int
    pad_size: int = 0

    def resolve(self) -> DataProto:
        import ray  # optional dependency: only Ray-hosted workers get here

        full = DataProto.concat(ray.get(self.refs), meta_conflicts="first").unpad(self.pad_size)  # as the collect
        padded, _ = full.pad_to_divisor(self.parts)
        return padded.chunk(self.parts)[self.index]


RENDEZVOUS_FILE_ENV = "RLCORE_RENDEZVOUS_FILE"


def one_machine_rendezvous() -> dict[str, str]:
    """The environment that has a group's ranks, all on one machine, meet through a fresh file
    (``Worker.init_distributed``); unique per group, so a stale file of a crashed run never matters."""
    return {RENDEZVOUS_FILE_ENV: os.path.join(tempfile.gettempdir(), f"rlcore-rendezvous-{uuid.uuid4().hex}")}


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS), None if there is none."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray  # optional dependency: only Ray-hosted workers get here

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray the loopback address is right
        pass
    return "127.0.0.1"


class WorkerHost:
    """Holds the worker(s) of one rank: one per role when roles are colocated in one process.

    Two phases, so that a worker whose constructor joins a process group does not block the driver
    from learning the rendezvous address: ``master_address()`` first, then ``build(env, classes)``.
    """

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}
        self.busy_s = 0.0  # seconds inside worker methods (``WorkerGroup.busy_seconds``)
        self.running: dict[int, tuple[str, str, float, int]] = {}  # calls now inside a worker method (below)
        self._stack_out = None  # the file this process's stacks are dumped into (``inflight``)
        self._keys = itertools.count()

    def master_address(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def build(self, env: dict[str, str], classes: dict[str, tuple[type, tuple, dict]]) -> dict:
        os.environ.update(env)
        stack_file, abandon_handler = None, False
        if env.get("RLCORE_IN_PROCESS") != "1":  # a process of its own: dump its stacks when signalled
            fd, stack_file = tempfile.mkstemp(prefix=f"rlcore-stacks-rank{env['RANK']}-", suffix=".txt")
            os.close(fd)
            self._stack_out = register_stack_dump(stack_file)
            abandon_handler = abandon.install_worker_handler()  # a stopping run abandons its step's generation
        for role, (cls, args, kwargs) in classes.items():
            self.workers[role] = cls(*args, **kwargs)
        for worker in self.workers.values():
            if isinstance(worker, Worker):
                worker.colocated_workers = self.workers
        return {"rank": int(env["RANK"]), "pid": os.getpid(), "node_ip": node_ip(), "node_id": _node_id(),
                "stack_file": stack_file, "abandon_handler": abandon_handler}

    def close(self) -> None:
        """Each worker's ``close`` (in-process groups: their shutdown); one that fails is named, the rest
        still close. The workers stay readable (a notebook inspects a finished run's model)."""
        for role, worker in self.workers.items():
            try:
                if isinstance(worker, Worker):
                    worker.close()
            except Exception as exc:  # noqa: BLE001 - shutting down: say it and go on
                print(f"warning: {role} worker's close failed: {type(exc).__name__}: {exc}", flush=True)

    def execute(self, role: str, method: str, /, *args, **kwargs) -> Any:
        permit = bool(kwargs.pop(abandon.PERMIT_KWARG, False))  # the driver's word: may this update be given up
        args = tuple(a.resolve() if isinstance(a, RemoteChunk) else a for a in args)
        kwargs = {k: v.resolve() if isinstance(v, RemoteChunk) else v for k, v in kwargs.items()}
        start = time.perf_counter()
        key = next(self._keys)
        self.running[key] = (role, method, time.monotonic(), threading.get_ident())
        try:
            bound = getattr(self.workers[role], method)
            return abandon.run_abandonable(method, lambda: bound(*args, **kwargs), self.workers, permit)
        finally:
            self.busy_s += time.perf_counter() - start
            self.running.pop(key, None)

    def busy_seconds(self) -> float:
        return self.busy_s

    def mesh_info(self, role: str, mesh_name: str) -> dict:
        return self.workers[role]._mesh_info(mesh_name)

    def pid(self) -> int:
        return os.getpid()


def _node_id() -> str | None:
    try:
        import ray  # optional dependency: only Ray-hosted workers get here

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


__all__ = ["Worker", "WorkerHost", "RemoteChunk", "free_port", "node_ip", "one_machine_rendezvous", "loopback_interface"]
