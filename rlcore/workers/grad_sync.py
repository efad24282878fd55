"""Gradient accumulation on one rank without FSDP2's per-backward reduce.

Why: after every backward FSDP2 reduce-scatters each layer's gradients into the sharded ones. With one
rank there is nothing to reduce, yet it still concatenates the layer's gradients into one buffer, runs
the (one-rank) collective over it and adds the result into the sharded gradients: two extra passes
over every gradient per micro-batch (at SmolLM2, 0.54 GB of fp32 gradients; reducing once made the
update of 8 micro-batches 1.03x faster on 2 CPU cores, 28.45 -> 27.59 s, ``benchmarks/update.py``). With gradient sync off, FSDP2 leaves each
micro-batch's gradients accumulating on its unsharded parameters (in the reduce dtype) and reduces
once, after the mini-batch's last backward: the same sums in the same order, as much memory (the
unsharded gradients stand where the sharded ones stood), none of the passes in between.

Only with one rank: with several, the unsharded gradients would take world-size times the memory
of the sharded ones until the last backward.

``accumulates_unsynced(module, world_size)`` says whether ``module`` can do it here;
``drop_unsynced_grads`` forgets what a given-up mini-batch accumulated (``module.zero_grad`` reaches
only the sharded gradients). Both read FSDP2's per-module parameter groups (``_get_fsdp_state``, as
torch 2.13 has them); where those are not found, accumulation stays as FSDP2 does it by default.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule


def _fsdp_params(module: nn.Module) -> list | None:
    """FSDP2's ``FSDPParam`` of every sharded module in ``module``; None where their layout is not found."""
    params = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        get_state = getattr(m, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", False) if get_state is not None else False
        if group is False:
            return None
        if group is not None and not hasattr(group, "fsdp_params"):
            return None
        params.extend(group.fsdp_params if group is not None else [])
    return params


def accumulates_unsynced(module: nn.Module, world_size: int) -> bool:
    """Whether ``module``'s micro-batches can run with gradient sync off but for the last: one rank, an
    FSDP2 root, and parameter groups this module knows how to clear (``drop_unsynced_grads``)."""
    return world_size == 1 and isinstance(module, FSDPModule) and bool(_fsdp_params(module))


def drop_unsynced_grads(module: nn.Module) -> None:
    """Forget the gradients backwards without sync left on ``module``'s unsharded parameters."""
    for param in _fsdp_params(module) or []:
        param.unsharded_accumulated_grad = None
        unsharded = getattr(param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
