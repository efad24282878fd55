"""WorkerGroup: binds every ``@register``-ed worker method as one group method, once, at construction.

The base class knows nothing of Ray: it turns a call into per-rank calls (dispatch), hands them to
``_submit`` and gathers the results (collect). ``RayWorkerGroup`` submits to Ray actors,
``LocalWorkerGroup`` runs the same workers in the driver's process.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from rlcore.single_controller import abandon
from rlcore.single_controller.decorator import REGISTER_ATTR, CallContext, Deferred, Execute, split_for_ranks
from rlcore.single_controller.inflight import CallTracker, InFlightCall
from rlcore.single_controller.worker import RemoteChunk

DEFAULT_ROLE = "default"


class ClassWithInitArgs:
    """A worker class and the arguments to build it with, on every rank.

    A ``@ray.remote``-decorated class (verl's way of writing workers) is taken apart: ``cls`` is the
    class it wraps and ``ray_options`` the options given to ``ray.remote(...)``, which a Ray group
    applies to the process of each rank (``RayWorkerGroup`` says which it honours)."""

    def __init__(self, cls: type, *args, **kwargs) -> None:
        wrapped = getattr(cls, "__ray_actor_class__", None)  # a ray ActorClass: no ray import needed here
        self.ray_options: dict = dict(getattr(cls, "_default_options", None) or {}) if wrapped is not None else {}
        cls = wrapped if wrapped is not None else cls
        if not isinstance(cls, type):
            raise TypeError(f"ClassWithInitArgs needs a worker class, got {cls!r}")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def update_options(self, options: dict) -> None:
        """Add Ray actor options for this class's processes (verl's ``RayClassWithInitArgs.update_options``)."""
        self.ray_options.update(options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cls.__name__})"


RayClassWithInitArgs = ClassWithInitArgs  # verl's name; the same object serves in-process groups


@dataclass
class ColocatedClasses:
    """Several roles that share one process per rank (e.g. actor + rollout + ref: the hybrid engine)."""

    roles: dict[str, ClassWithInitArgs] = field(default_factory=dict)


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs]) -> ColocatedClasses:
    if not class_dict:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    return ColocatedClasses(dict(class_dict))


class WorkerError(RuntimeError):
    """A worker method raised: names the rank and method and carries the remote traceback."""

    def __init__(self, method: str, rank: int, detail: str) -> None:
        self.method, self.rank, self.remote_traceback = method, rank, detail
        super().__init__(f"{method} failed on rank {rank}:\n{detail}")


class WorkerDiedError(WorkerError):
    """The process of a rank died (crash, OOM kill, node loss) while a call was pending."""


class WorkerTimeoutError(TimeoutError):
    def __init__(self, method: str, pending_ranks: list[int], timeout: float) -> None:
        self.method, self.pending_ranks = method, pending_ranks
        super().__init__(
            f"{method} did not finish within {timeout:g}s on rank(s) {pending_ranks}; the work may still be running "
            f"there. Raise the limit with wg.{method}.options(timeout=...) if this is expected."
        )


@dataclass
class MethodSpec:
    role: str
    name: str  # the worker's method name
    public_name: str  # the group's attribute name (role-prefixed when roles are colocated)
    mode: Any
    execute: Execute
    blocking: bool
    pad: bool
    balance: bool = False


class GroupFuture(Deferred):
    """Result of a non-blocking group call. ``get()`` waits; passing it to another group's DP method
    hands the per-rank results over without pulling them through the driver where Ray allows it."""

    def __init__(self, group: "WorkerGroup", handles: list, ranks: list[int], ctx: CallContext, spec: MethodSpec, timeout,
                 tracked: int | None = None):
        self.group, self.handles, self.ranks, self.ctx, self.spec, self.timeout = group, handles, ranks, ctx, spec, timeout
        self._done, self._value = False, None
        self._tracked = tracked  # its key in the group's in-flight calls, until collected (or dropped)

    def get(self, timeout: float | None | str = "default") -> Any:
        if not self._done:
            timeout = self.timeout if timeout == "default" else timeout
            try:
                outputs = self.group._wait(self.handles, self.ranks, self.spec.public_name, timeout)
                self._value, self._done = self.spec.mode.collect_fn(self.ctx, outputs), True
            finally:
                self._untrack()
        return self._value

    def _untrack(self) -> None:
        if self._tracked is not None:
            self.group._tracker.end(self._tracked)
            self._tracked = None

    def __del__(self) -> None:  # a future nobody waits for is no longer "in flight" for the driver
        self._untrack()

    @property
    def single_result_ref(self):
        """The object ref of a pending rank-0 result (RANK_ZERO, COLLECTIVE_RANK_ZERO), or None."""
        rank_zero = getattr(self.spec.mode.collect_fn, "returns_rank_zero", False)
        return self.handles[0] if rank_zero and self.group.passes_object_refs and not self._done else None

    def split_for(self, ctx: CallContext, world_size: int, what: str) -> list:
        """Per-rank parts of this future's DataProto for a consumer call of ``world_size`` ranks."""
        refs_shareable = (
            not self._done
            and getattr(self.spec.mode.collect_fn, "concatenates_chunks", False)
            and self.ctx.scratch.get("order") is None  # balanced: the ranks' outputs are in another row order
            and self.group.passes_object_refs
            and ctx.group.passes_object_refs
        )
        if refs_shareable and len(self.handles) == world_size:
            # Rank i of the consumer reads rank i's output straight from the object store.
            for key in ("pad_size", "chunk_rows"):
                if key in self.ctx.scratch:
                    ctx.scratch[key] = self.ctx.scratch[key]
            return list(self.handles)
        if refs_shareable and not ctx.pad and not self.ctx.scratch.get("pad_size"):
            return [RemoteChunk(list(self.handles), i, world_size) for i in range(world_size)]
        return split_for_ranks(ctx, self.get(), world_size, what)


class GroupMethod:
    """One registered method on the whole group: ``wg.method(data)``; ``wg.method.options(...)(data)``."""

    def __init__(self, group: "WorkerGroup", spec: MethodSpec, timeout="default", pad=None, blocking=None,
                 balance=None):
        self._group, self._spec = group, spec
        self._timeout, self._pad, self._blocking, self._balance = timeout, pad, blocking, balance
        self.__name__ = spec.public_name
        self.__doc__ = f"Group call of {spec.role}.{spec.name} ({spec.mode.name})."

    def options(self, *, timeout: float | None | str = "default", pad: bool | None = None, blocking: bool | None = None,
                balance: bool | None = None) -> "GroupMethod":
        """A copy of this method with per-call settings: timeout (s, None = wait forever), pad, blocking,
        balance (split by token count; default: registered ``balance`` and the group's ``balance_dp``)."""
        return GroupMethod(self._group, self._spec, timeout, pad, blocking, balance)

    def __call__(self, *args, **kwargs) -> Any:
        group, spec = self._group, self._spec
        pad = spec.pad if self._pad is None else self._pad
        balance = spec.balance and group.balance_dp if self._balance is None else self._balance
        ctx = CallContext(world_size=group.world_size, group=group, role=spec.role, pad=pad, balance=balance)
        calls = spec.mode.dispatch_fn(ctx, args, kwargs)
        if (spec.balance or balance) and "balance" in ctx.scratch:
            group.last_balance = ctx.scratch["balance"]
        if spec.execute is Execute.RANK_ZERO:
            calls = calls[:1]
        if spec.name in abandon.UPDATE_METHODS and abandon.update_permitted():  # given up mid-way on a stop signal
            calls = [(a, {**k, abandon.PERMIT_KWARG: True}) for a, k in calls]
        ranks = list(range(len(calls)))
        tracked = group._tracker.begin(group.name, spec.public_name, ranks)  # what a watchdog asks about
        try:
            handles = group._submit(spec.role, spec.name, calls)
        except BaseException:
            group._tracker.end(tracked)
            raise
        group._tracker.attach(tracked, handles)
        timeout = group.default_timeout if self._timeout == "default" else self._timeout
        future = GroupFuture(group, handles, ranks, ctx, spec, timeout, tracked)
        blocking = spec.blocking if self._blocking is None else self._blocking
        return future.get() if blocking else future

    def __repr__(self) -> str:
        return f"<group method {self._spec.public_name} ({self._spec.mode.name}, {self._group.world_size} ranks)>"


class WorkerGroup:
    """Shared machinery of Ray and in-process groups. Subclasses provide ``_submit`` and ``_wait``."""

    passes_object_refs = False  # True where per-rank results live in a store other workers can read
    # Methods registered with balance=True split their batches balanced by token count (the
    # builder sets it from trainer.balance_batch). Their last call's per-rank token counts, plain
    # split and used split: last_balance = {"tokens_max_before", "tokens_min_before", ... "_after"}.
    balance_dp = True
    last_balance: dict | None = None

    def __init__(self, classes: ClassWithInitArgs | ColocatedClasses, world_size: int, default_timeout: float | None) -> None:
        if isinstance(classes, ColocatedClasses):
            self._roles = dict(classes.roles)
            self._prefixed = True
        elif isinstance(classes, ClassWithInitArgs):
            self._roles = {DEFAULT_ROLE: classes}
            self._prefixed = False
        else:
            raise TypeError(f"expected ClassWithInitArgs or ColocatedClasses, got {type(classes).__name__}")
        self._world_size = world_size
        self.default_timeout = default_timeout
        self._mesh_cache: dict[tuple[str, str], dict] = {}
        self._methods: dict[str, MethodSpec] = {}
        self.method_names: list[str] = []
        self._tracker = CallTracker(self)  # shared with the per-role views (``spawn``)

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def name(self) -> str:
        """The group's name in reports: its role(s) (a per-role view: the role), else its worker class."""
        if list(self._roles) == [DEFAULT_ROLE]:
            return self._roles[DEFAULT_ROLE].cls.__name__
        return "+".join(self._roles)

    def in_flight(self) -> list[InFlightCall]:
        """The calls this group (and its views) made that the driver has not collected, oldest first,
        each with ``pending``: the ranks still running it (asked now, without waiting)."""
        calls = sorted(self._tracker.calls(), key=lambda c: c.started)
        for call in calls:
            call.pending = self._pending_ranks(call)
        return calls

    def dump_stacks(self, ranks: list[int], timeout_s: float = 2.0) -> dict[int, str]:
        """The Python stacks (every thread) of the processes of ``ranks``, as text per rank; what
        cannot be had (a rank on another machine) says why (``rlcore.single_controller.inflight``)."""
        return self._dump_stacks(list(ranks), timeout_s)

    def _bind_methods(self) -> None:
        """Resolve every registered method of the roles' classes once. The group keeps the specs, not
        bound ``GroupMethod`` objects (``__getattr__`` makes one per access): a method object stored on
        the group would point back at it, a cycle that keeps a dropped group (and its processes) alive
        until the cyclic garbage collector happens to run."""
        for role, cwa in self._roles.items():
            for name, member in inspect.getmembers(cwa.cls, predicate=callable):
                reg = getattr(member, REGISTER_ATTR, None)
                if reg is None:
                    continue
                public = f"{role}_{name}" if self._prefixed else name
                if hasattr(type(self), public) or public in self.__dict__:
                    raise ValueError(f"worker method {cwa.cls.__name__}.{name} would shadow WorkerGroup.{public}; rename it")
                self._methods[public] = MethodSpec(role, name, public, reg["mode"], reg["execute"], reg["blocking"],
                                                   reg["pad"], reg["balance"])
                self.method_names.append(public)

    def __getattr__(self, name: str) -> GroupMethod:
        methods = self.__dict__.get("_methods")  # absent before __init__ ran (copy, unpickling)
        if methods is None or name not in methods:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}"
                                 + (f"; its worker methods: {sorted(methods)}" if methods and not name.startswith("_")
                                    else ""))
        return GroupMethod(self, methods[name])

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__dict__.get("_methods", {})})

    def spawn(self, prefix_set: set[str] | list[str]) -> dict[str, "WorkerGroup"]:
        """Per-role views of a colocated group: same processes, methods without the role prefix."""
        views = {}
        for role in prefix_set:
            if role not in self._roles:
                raise KeyError(f"no role {role!r} in this group; roles: {sorted(self._roles)}")
            view = object.__new__(type(self))
            view.__dict__.update(self.__dict__)
            view._roles, view._prefixed, view.method_names, view._methods = {role: self._roles[role]}, False, [], {}
            view._mesh_cache, view.last_balance = {}, None
            view._owner = self  # the processes are the group's: it lives (and holds them) while a view does
            view._bind_methods()
            views[role] = view
        return views

    def mesh_info(self, mesh_name: str, role: str = DEFAULT_ROLE) -> dict:
        """DP rank / collect flag of every rank for ``mesh_dispatch``, asked once and cached."""
        key = (mesh_name, role)
        if key not in self._mesh_cache:
            infos = self._query_mesh(role, mesh_name)
            sizes = {i["dp_size"] for i in infos}
            if len(sizes) != 1:
                raise ValueError(f"ranks disagree on the dp_size of mesh {mesh_name!r}: {sorted(sizes)}")
            self._mesh_cache[key] = {
                "dp_size": sizes.pop(),
                "dp_ranks": [i["dp_rank"] for i in infos],
                "is_collect": [i["is_collect"] for i in infos],
            }
        return self._mesh_cache[key]

    def busy_seconds(self) -> list[float]:
        """Per rank, the seconds spent inside worker methods so far (the rank's own compute, without
        dispatch, transfer or waiting). A call's time minus its slowest rank's share of this is what
        the group's transport costs it (``benchmarks/step.py``)."""
        return self._busy_seconds()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, roles={sorted(self._roles)}, methods={self.method_names})"

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Release the group's processes (Ray) or workers (in-process); the group is unusable after."""
        raise NotImplementedError

    # subclass hooks
    def _submit(self, role: str, method: str, calls: list[tuple[tuple, dict]]) -> list:
        raise NotImplementedError

    def _wait(self, handles: list, ranks: list[int], method: str, timeout: float | None) -> list:
        raise NotImplementedError

    def _query_mesh(self, role: str, mesh_name: str) -> list[dict]:
        raise NotImplementedError

    def _busy_seconds(self) -> list[float]:
        raise NotImplementedError

    def _pending_ranks(self, call: InFlightCall) -> list[int]:
        return list(call.ranks)

    def _dump_stacks(self, ranks: list[int], timeout_s: float) -> dict[int, str]:
        raise NotImplementedError
