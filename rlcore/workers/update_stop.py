"""Giving an update up before its first optimizer step, when the run is stopping (SIGTERM / SIGINT).

Why: a scheduler's grace period is ~30 s and one update of a real model can take minutes. Until the
first ``optimizer.step`` an update has only accumulated gradients: the weights, the optimizer's moments,
the LR schedule and the worker's update counter are exactly as the step before left them. Dropping the
gradients there leaves a worker the trainer can checkpoint as that step (``rlcore.single_controller.abandon``
says how the request reaches the worker and when the driver permits it).

``UpdateStop`` is created at the start of ``run_updates``; ``check()`` at every micro-batch boundary and
before the optimizer step; ``stepped()`` after it, from when on the update finishes whatever happens.

Ranks. FSDP's forwards and backwards are collectives: every rank must leave at the same boundary. A rank's
abandon flag is set by a signal that reaches each process at its own moment, so the ranks' flags can differ
at a given boundary. With several ranks, ``check`` therefore all-reduces the flag (MAX: one rank asked, all
leave) at each boundary until the first optimizer step. Every rank reaches the same boundaries (they run
as many micro-batches as each other: ``micro_batch_indices(agree=True)``, stand-ins) and all step the
optimizer at the same mini-batch, so they make the same number of these calls. Its cost is one
one-element all-reduce per micro-batch of the first mini-batch, beside the forward and backward's own
collectives and the loop's per-micro-batch ``float()`` of its metrics, which already waits for the
device. With one rank it is a flag read.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlcore.single_controller import abandon
from rlcore.single_controller.abandon import AbandonedCallError


class UpdateStop:
    def __init__(self, module: nn.Module, device: torch.device | None) -> None:
        self.module, self.device = module, device
        self.open = abandon.update_open()  # a call the driver permitted to be given up
        self.boundaries = 0  # boundaries checked (this rank), for the error's message
        # The RNG streams a checkpoint saves, as the update found them (a forward with dropout draws from them).
        self._rng = _capture_rng() if self.open else None

    def check(self) -> None:
        """At a micro-batch boundary before the first optimizer step: leave when this process (or, with
        several ranks, any rank) is asked to, with the gradients dropped and the RNG streams as found."""
        if not self.open:
            return
        self.boundaries += 1
        asked = abandon.update_stop_requested()
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor(int(asked), device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            asked = bool(flag.item())
        if not asked:
            return
        self.module.zero_grad(set_to_none=True)  # the accumulated gradients: nothing else moved yet
        _restore_rng(self._rng)
        self.open = False
        raise AbandonedCallError(f"update abandoned at micro-batch boundary {self.boundaries}, before its first "
                                 f"optimizer step: this worker's run is stopping")

    def stepped(self) -> None:
        """The optimizer stepped: the update now finishes, whatever is asked."""
        self.open = False
        self._rng = None


def _capture_rng() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict | None) -> None:
    if state is None:
        return
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
