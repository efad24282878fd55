"""Generic single-controller machinery: workers, dispatch, worker groups. Knows nothing of RL.

Ray is imported only when a Ray class is asked for, so the in-process group works where Ray is not
installed (e.g. the GPU check machine).

Coming from verl: every name a verl script imports from ``verl.single_controller.ray``,
``verl.single_controller.base`` and ``verl.single_controller.base.decorator`` is importable from
here (the README's "Coming from verl" section has the mapping).
"""

import importlib

from rlcore.single_controller.decorator import (
    CallContext,
    Dispatch,
    DispatchMode,
    Execute,
    mesh_dispatch,
    register,
    verl_dispatch_mode,
)
from rlcore.single_controller.inflight import InFlightCall, in_flight_calls
from rlcore.single_controller.local import LocalWorkerGroup
from rlcore.single_controller.worker import Worker
from rlcore.single_controller.worker_group import (
    ClassWithInitArgs,
    ColocatedClasses,
    GroupFuture,
    RayClassWithInitArgs,
    WorkerDiedError,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    create_colocated_worker_cls,
)

_RAY_NAMES = {
    "RayWorkerGroup": "rlcore.single_controller.ray_group",
    "RankHandle": "rlcore.single_controller.ray_group",
    "RayResourcePool": "rlcore.single_controller.resource_pool",
    "ResourceError": "rlcore.single_controller.resource_pool",
}


def __getattr__(name: str):
    if name in _RAY_NAMES:
        return getattr(importlib.import_module(_RAY_NAMES[name]), name)
    raise AttributeError(f"module 'rlcore.single_controller' has no attribute {name!r}")


__all__ = [
    "CallContext", "ClassWithInitArgs", "ColocatedClasses", "Dispatch", "DispatchMode", "Execute", "GroupFuture",
    "InFlightCall", "LocalWorkerGroup", "RankHandle", "RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "ResourceError",
    "Worker", "WorkerDiedError", "WorkerError", "WorkerGroup", "WorkerTimeoutError", "create_colocated_worker_cls",
    "in_flight_calls", "mesh_dispatch", "register", "verl_dispatch_mode",
]
