"""RayWorkerGroup: one Ray actor per bundle of a resource pool, each hosting the worker(s) of one rank.

A group holds its processes for as long as it lives, and no longer: ``wg.shutdown()``, the end of a
``with RayWorkerGroup(...) as wg:`` block, or the group being garbage-collected (a function returns,
``del wg``, a notebook cell re-run) kills its actors and leaves the pool, and the last group to
leave a pool removes the pool's placement groups. Nothing in the group refers back to it (group
methods are made on attribute access), so dropping the last reference releases it at once.
"""

from __future__ import annotations

import os
import re
import time
import uuid
import weakref

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.single_controller.inflight import InFlightCall, signal_stacks
from rlcore.single_controller.resource_pool import RayResourcePool
from rlcore.single_controller.worker import WorkerHost, node_ip, one_machine_rendezvous
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
WAIT_SLICE_S = 0.2  # the driver waits on ranks in slices this long (RayWorkerGroup._wait)


def plain_text(error: BaseException | str) -> str:
    """An error's text without the colour codes Ray puts in its tracebacks (for messages and logs)."""
    return _ANSI.sub("", str(error))


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per rank of ``resource_pool``, hosting ``ray_cls_with_init``'s worker(s).

    Of the options of a ``@ray.remote(...)`` worker class it honours ``num_cpus`` / ``num_gpus`` (what
    each rank's process takes from its bundle, instead of the pool's even share; refused at once if
    the groups on the pool would not fit), ``runtime_env`` and ``max_concurrency``; placement and
    names are the group's own, so any other option is an error naming it. ``device_name`` ("cpu" or
    "cuda", verl's keyword) must agree with the pool's ``use_gpu``. ``workers`` (verl's ``_workers``)
    are the ranks as handles for raw calls: ``ray.get(wg.workers[0].method.remote(x))``.

    Lifetime (module docstring): the group's processes live while the group (or a view of it from
    ``spawn``, or a pending ``GroupFuture``) is referenced; verl's ``detached=True`` (processes that
    outlive the driver) is refused.
    """

    passes_object_refs = True

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: ClassWithInitArgs | ColocatedClasses,
        name_prefix: str = "rlcore",
        default_timeout: float | None = 3600.0,
        init_timeout: float = 600.0,
        env_vars: dict[str, str] | None = None,
        device_name: str | None = None,
        detached: bool = False,
    ) -> None:
        if detached:
            raise ValueError("detached worker groups are not supported: a group's processes live as long as the group "
                             "(wg.shutdown(), `with RayWorkerGroup(...) as wg:`, or the group going out of scope); "
                             "build it with detached=False (the default)")
        self.device_name = _check_device(device_name, resource_pool)
        super().__init__(ray_cls_with_init, resource_pool.world_size, default_timeout)
        self.resource_pool = resource_pool
        resources, extra_options = _actor_options(self._roles, resource_pool)
        # The name every rank's actor starts with: unique in the cluster, and carrying the pool's tag so that
        # a pool that cannot be placed names the groups holding the cluster (resource_pool.describe_holders).
        self.group_name = f"{name_prefix}_{'+'.join(self._roles)}_{resource_pool.tag}_{uuid.uuid4().hex[:8]}"
        resource_pool.claim(self.group_name, resources)
        self.hosts: list = []
        self.worker_info: list[dict] = []  # per rank: pid, node, stack file (filled by _start)
        self._rendezvous_files: list[str] = []  # a one-node group's rendezvous file (filled by _start)
        # Runs once: at shutdown(), or when the group is garbage-collected. It holds what it releases, not the group.
        self._finalizer = weakref.finalize(self, _release, self.hosts, self.worker_info, resource_pool, self.group_name,
                                           self._rendezvous_files)
        self._finalizer.atexit = False  # at interpreter exit the driver's job ends, and Ray frees everything
        try:
            self._start(resource_pool, resources, extra_options, env_vars, init_timeout)
            self._bind_methods()
        except BaseException:
            self._finalizer()  # a group that failed to build releases what it took
            raise

    def _start(self, resource_pool: RayResourcePool, resources: dict, extra_options: dict,
               env_vars: dict[str, str] | None, init_timeout: float) -> None:
        for rank, (pg, bundle_index, _) in enumerate(resource_pool.slots()):
            options = {
                **extra_options,
                "num_cpus": resources.get("CPU", 0),
                "num_gpus": resources.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
                "name": f"{self.group_name}_rank{rank}",
            }
            self.hosts.append(_RemoteHost.options(**options).remote())

        master_addr, master_port = self._get([self.hosts[0].master_address.remote()], "master_address", init_timeout)[0]
        roles = {role: (c.cls, c.args, c.kwargs) for role, c in self._roles.items()}
        build_refs = []
        one_node = len(resource_pool.placement_groups()) == 1  # STRICT_PACK: one placement group per node
        rendezvous = one_machine_rendezvous() if one_node else {}
        self._rendezvous_files.extend(rendezvous.values())
        for rank, (_, _, local_rank) in enumerate(resource_pool.slots()):
            env = {
                **(env_vars or {}),
                **rendezvous,
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local_rank),
                "MASTER_ADDR": str(master_addr),
                "MASTER_PORT": str(master_port),
            }
            build_refs.append(self.hosts[rank].build.remote(env, roles))
        self.worker_info[:] = self._get(build_refs, "__init__", init_timeout)

    @property
    def workers(self) -> list["RankHandle"]:
        """Each rank as a handle for raw Ray calls (verl's ``wg.workers`` / ``wg._workers``)."""
        return [RankHandle(host, list(self._roles), self._prefixed) for host in self.hosts]

    _workers = workers

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
            # In slices: ray.wait does not return for a signal, and the driver's handlers (Ctrl-C, the stall
            # watchdog's on_stall=fail) run only when Python gets control back.
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(WAIT_SLICE_S, remaining or WAIT_SLICE_S))
            if not ready:
                if remaining is not None and time.monotonic() >= deadline:
                    raise WorkerTimeoutError(method, sorted(pending.values()), timeout)
                continue
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

    def _busy_seconds(self) -> list[float]:
        return self._get([h.busy_seconds.remote() for h in self.hosts], "busy_seconds", 60)

    def _pending_ranks(self, call: InFlightCall) -> list[int]:
        if not call.handles:
            return list(call.ranks)
        ready, _ = ray.wait(list(call.handles), num_returns=len(call.handles), timeout=0, fetch_local=False)
        done = set(ready)
        return [rank for rank, ref in zip(call.ranks, call.handles) if ref not in done]

    def _dump_stacks(self, ranks: list[int], timeout_s: float) -> dict[int, str]:
        """SIGUSR1 to each rank's process on this machine, whose faulthandler writes its stacks to a file."""
        here, targets, out = node_ip(), {}, {}
        for rank in ranks:
            info = self.worker_info[rank]
            if not info.get("stack_file"):
                out[rank] = f"(rank {rank}, pid {info['pid']}: no stack dump registered in its process)\n"
            elif info["node_ip"] != here:
                out[rank] = (f"(rank {rank} runs on {info['node_ip']}, not on the driver's machine: there, "
                             f"`kill -USR1 {info['pid']}` appends its stacks to {info['stack_file']})\n")
            else:
                targets[rank] = (info["pid"], info["stack_file"])
        out.update(signal_stacks(targets, timeout_s))
        return dict(sorted(out.items()))

    def shutdown(self) -> None:
        """Kill this group's actors and leave the pool (the last group to leave removes its placement
        groups; the pool places them again for the next group). Idempotent; views from ``spawn`` share
        the processes, so shutting one down shuts down all."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        """Whether the group still holds its processes (not shut down)."""
        return self._finalizer.alive


def _release(hosts: list, worker_info: list[dict], pool: RayResourcePool, name: str, rendezvous_files: list[str]) -> None:
    """Kill a group's actors, remove the files their stacks were dumped into and its rendezvous file (torch
    removes it when the last rank's store is destroyed, which a killed actor never gets to), and take the
    group off its pool. The group's finalizer: it must not refer to the group."""
    if ray.is_initialized():
        for host in hosts:
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead, or Ray restarted since
                pass
    hosts.clear()
    here = node_ip()
    if worker_info and all(info.get("node_ip") == here for info in worker_info):  # the file is on this machine
        _unlink_all(rendezvous_files)
    rendezvous_files.clear()
    _unlink_all([info["stack_file"] for info in worker_info if info.get("stack_file") and info.get("node_ip") == here])
    worker_info.clear()
    pool.release(name)


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:  # removed already (a rendezvous file whose every store closed), or never written
            pass


class RankHandle:
    """One rank's process as verl's worker handle: ``handle.method.remote(*args, **kwargs)`` runs the
    worker's ``method`` there (registered or not) and returns its Ray ObjectRef. In a colocated group
    the method name carries the role prefix (``actor_update``), as the group's own methods do.
    ``actor`` is the underlying Ray actor (e.g. for ``ray.kill``)."""

    def __init__(self, actor, roles: list[str], prefixed: bool) -> None:
        self.actor, self._roles, self._prefixed = actor, roles, prefixed

    def __getattr__(self, name: str) -> "_RemoteMethod":
        if name.startswith("_"):  # private names, and attributes looked up before __init__ ran (unpickling)
            raise AttributeError(name)
        if not self._prefixed:
            return _RemoteMethod(self.actor, self._roles[0], name)
        for role in self._roles:
            if name.startswith(f"{role}_"):
                return _RemoteMethod(self.actor, role, name[len(role) + 1:])
        raise AttributeError(f"{name!r}: in a colocated group name the role first, one of "
                             f"{[f'{r}_<method>' for r in self._roles]}")


class _RemoteMethod:
    def __init__(self, actor, role: str, method: str, options: dict | None = None) -> None:
        self._actor, self._role, self._method, self._options = actor, role, method, options or {}

    def remote(self, *args, **kwargs):
        call = self._actor.execute.options(**self._options) if self._options else self._actor.execute
        return call.remote(self._role, self._method, *args, **kwargs)

    def options(self, **options) -> "_RemoteMethod":
        return _RemoteMethod(self._actor, self._role, self._method, {**self._options, **options})


# Options of a @ray.remote worker class that make sense for a rank's process; the others (placement,
# names, lifetimes, restarts) belong to the group.
_HONOURED_OPTIONS = ("num_cpus", "num_gpus", "runtime_env", "max_concurrency")


def _actor_options(roles: dict[str, ClassWithInitArgs], pool: RayResourcePool) -> tuple[dict[str, float], dict]:
    """(what each rank's process takes from its bundle, further Ray options) from the pool's share and the
    @ray.remote options of the role classes (several colocated roles: the largest num_cpus / num_gpus)."""
    resources = pool.actor_resources()
    asked: dict[str, list[float]] = {}
    extra: dict = {}
    for cwa in roles.values():
        options = getattr(cwa, "ray_options", {})
        refused = sorted(set(options) - set(_HONOURED_OPTIONS))
        if refused:
            raise ValueError(
                f"{cwa.cls.__name__}: @ray.remote option(s) {refused} are not honoured by RayWorkerGroup, which places, "
                f"names and restarts each rank's process itself; remove them (honoured: {list(_HONOURED_OPTIONS)}; "
                "name_prefix= names the group)"
            )
        for option, key in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
            if option in options:
                asked.setdefault(key, []).append(float(options[option]))
        if "max_concurrency" in options:
            extra["max_concurrency"] = max(options["max_concurrency"], extra.get("max_concurrency", 1))
        if "runtime_env" in options:
            env = dict(extra.get("runtime_env", {}))
            env_vars = {**env.get("env_vars", {}), **options["runtime_env"].get("env_vars", {})}
            env.update(options["runtime_env"])
            if env_vars:
                env["env_vars"] = env_vars
            extra["runtime_env"] = env
    resources.update({key: max(values) for key, values in asked.items()})
    return resources, extra


def _check_device(device_name: str | None, pool: RayResourcePool) -> str:
    """verl's ``device_name`` keyword, checked against the pool: the pool's bundles decide the device."""
    pool_device = "cuda" if pool.use_gpu else "cpu"
    if device_name is None:
        return pool_device
    if device_name not in ("cpu", "cuda"):
        raise ValueError(f"device_name={device_name!r}: rlcore's Ray groups run on 'cpu' or 'cuda'")
    if device_name != pool_device:
        raise ValueError(
            f"device_name={device_name!r} but the resource pool was built with use_gpu={pool.use_gpu}: build it with "
            f"RayResourcePool(..., use_gpu={device_name == 'cuda'}) for {device_name} workers"
        )
    return device_name
