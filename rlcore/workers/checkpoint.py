"""Checkpoints of a sharded trained model and its optimizer, through torch.distributed.checkpoint:
reloadable on another world size, the tied LM head stored once, a failed write naming its file and
what the disk has left."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (

    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


# ----------------------------------------------------------------------------- checkpoints
# Checkpoints hold the parameters that train: frozen ones (a LoRA actor's base) never change and
# come back from model.path at init, so a LoRA checkpoint is its adapters and their optimizer state.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


def tied_aliases(model: nn.Module) -> set[str]:
    """State-dict names of parameters tied to an earlier one (a tied LM head is the input embedding):
    checkpoints and exports store each tensor once. ``torch.distributed.checkpoint`` would write an
    alias twice (measured: two names of one 4 MB tensor took 8 MB), the 28M-parameter embedding of
    SmolLM2-135M 113 MB of each checkpoint, and ``save_pretrained`` of gathered copies twice too."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        first.setdefault(id(param), name)
    return aliases


def save_checkpoint(path: str, model: nn.Module, optimizer, extra: dict[str, Any]) -> None:
    """Sharded model (its trainable parameters) + optimizer through torch.distributed.checkpoint
    (reloadable on another world size), plus this rank's ``extra`` (LR schedule, counters) and RNG
    states. Collective."""
    os.makedirs(path, exist_ok=True)
    model_sd, optim_sd = (get_state_dict(model, optimizer, options=TRAINED_ONLY) if optimizer is not None
                          else (get_model_state_dict(model, options=TRAINED_ONLY), None))
    model_sd = {k: v for k, v in model_sd.items() if k not in tied_aliases(model)}
    state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optimizer": optim_sd}
    _named_write(path, lambda: dcp.save(state, checkpoint_id=path))
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    extra_file = os.path.join(path, f"extra_state_rank{dist.get_rank()}.pt")
    _named_write(extra_file, lambda: torch.save({**extra, "rng": rng}, extra_file))
    dist.barrier()


def _named_write(path: str, write: Callable[[], Any]) -> None:
    """``write()``, a failure re-raised naming the checkpoint file and the cause: torch's own message
    ("unexpected pos ...", "file write failed", a per-rank CheckpointException) names neither."""
    try:
        write()
    except (OSError, RuntimeError, CheckpointException) as exc:
        causes = [e for e, _ in exc.failures.values()] if isinstance(exc, CheckpointException) else [exc]
        cause = "; ".join(f"{type(e).__name__}: {e}" for e in causes)
        raise OSError(f"writing checkpoint {path} failed: {cause} ({_space_left(path)})") from exc


def _space_left(path: str) -> str:
    """What the filesystem of ``path`` has left, said plainly when it is full: torch's zip writer reports
    a full disk as "unexpected pos", never as ENOSPC."""
    folder = path
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        usage = shutil.disk_usage(folder or ".")
    except OSError:
        return "free space unknown"
    if usage.free < max(2**20, usage.total // 1000):
        return f"No space left on device: {usage.free} bytes free of {usage.total} there"
    return "disk full?"


def load_checkpoint(path: str, model: nn.Module, optimizer) -> dict[str, Any]:
    """Restore what ``save_checkpoint`` wrote, in place; returns this rank's ``extra`` dict."""
    extra_file = os.path.join(path, f"extra_state_rank{dist.get_rank()}.pt")
    if not os.path.exists(extra_file):
        raise FileNotFoundError(f"{extra_file} is missing: not a checkpoint of this worker, or saved with fewer ranks")
    # Frozen parameters are not in the checkpoint (TRAINED_ONLY), so the load cannot be strict;
    # dcp.load already fails on a trainable one the checkpoint lacks, and the check below on the rest.
    loading = StateDictOptions(ignore_frozen_params=True, strict=False)
    aliases = tied_aliases(model)  # not in the checkpoint: loading the tensor they alias sets them
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
        state = {"model": {k: v for k, v in model_sd.items() if k not in aliases}, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
        result = set_state_dict(model, optimizer, model_state_dict=state["model"],
                                optim_state_dict=state["optimizer"], options=loading)
    else:
        model_sd = get_model_state_dict(model, options=TRAINED_ONLY)
        state = {"model": {k: v for k, v in model_sd.items() if k not in aliases}}
        dcp.load(state, checkpoint_id=path)
        result = set_model_state_dict(model, state["model"], options=loading)
    trained = set(get_model_state_dict(model, options=TRAINED_ONLY)) - aliases if result.missing_keys else set()
    if set(result.missing_keys) & trained or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {path} does not fit the model: missing trainable "
                           f"{sorted(set(result.missing_keys) & trained)[:5]}, unexpected {result.unexpected_keys[:5]}")
    extra = torch.load(extra_file, weights_only=False)
    rng = extra.pop("rng")
    torch.set_rng_state(rng["torch"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return extra


# ----------------------------------------------------------------------------- training workers
