"""The optimizer and learning-rate schedule of the training workers (actor, critic, reward model), and their step.

AdamW (fused: one kernel over all parameters) or SGD, a linear warm-up then a constant, cosine or
linear schedule, the global gradient norm clipped before each step. Its moments are made when the
optimizer is built, not at the first step (``allocate_moments``: why, and what that saved).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlcore.workers.config import TrainConfig


def build_optimizer(params: Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        # fused: one kernel over all parameters; on 2 CPU cores 0.06 s a step at 108M parameters against
        # 0.59 s for torch's default there, a loop over the tensors
        return allocate_moments(torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True))
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}; known: adamw, sgd")


def allocate_moments(optimizer: torch.optim.Adam) -> torch.optim.Adam:
    """AdamW's state (its two moments, zeros, and step 0) made now, by its own ``_init_group``, as its first
    ``step()`` would make it: the same tensors, so the same updates bit for bit.

    Why: made lazily, the moments (twice the trained parameters: 1.08 GB at SmolLM2) are allocated at the
    end of the first update, in the heap that the update's activations have just freed, so the second
    update finds its old place taken and glibc grows the heap for it. Measured at SmolLM2 (fp32, 128
    rows, benchmarks/update.py's batch): the second update faulted in 1.3 GB of fresh pages
    (326,000 faults), against 14,000 with the moments made here beside the weights. At the page-fault
    cost of a VM that is 1-3 s of a 30 s update, in the timed steps of a short benchmark run. It also
    puts the optimizer's memory on the books at init, where a model too large for the machine fails
    before its first rollout instead of after it."""
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is None]
        for p in params:  # _init_group makes state only for parameters with a gradient: zeros, dropped after
            p.grad = torch.zeros_like(p)
        try:
            optimizer._init_group(group, [], [], [], [], [], [])
        finally:
            for p in params:
                p.grad = None
    return optimizer


def lr_multiplier(step: int, warmup_steps: int, total_steps: int | None, kind: str, min_lr_ratio: float = 0.0) -> float:
    """Factor on the peak lr for optimizer step ``step`` (0-based): linear warm-up reaching 1 at
    step ``warmup_steps - 1``, then constant, or cosine/linear decay to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if kind not in ("cosine", "linear"):
        raise ValueError(f"unknown lr_scheduler {kind!r}; known: constant, cosine, linear")
    if not total_steps or total_steps <= warmup_steps:
        raise ValueError(f"lr_scheduler {kind!r} needs total_steps > warmup_steps, got {total_steps}")
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    lr_multiplier(cfg.warmup_steps, cfg.warmup_steps, cfg.total_steps, cfg.lr_scheduler)  # validate now, not mid-run
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, cfg.warmup_steps, cfg.total_steps, cfg.lr_scheduler, cfg.min_lr_ratio)
    )


def clip_and_step(model: nn.Module, optimizer, lr_scheduler, grad_clip: float | None) -> tuple[float, float]:
    """Clip to the global grad norm, step optimizer and schedule; returns (grad_norm, lr used).
    A non-finite norm skips the optimizer step, so one bad batch cannot poison the weights."""
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip or float("inf"))
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    lr = optimizer.param_groups[0]["lr"]
    if math.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lr_scheduler.step()
    return norm, lr
