"""``model.mixed_precision: auto`` resolved in a worker: bf16 or fp32 by what the device and the model
are (``rlcore.engines.dtype_choice.mixed_precision_choice``), never by timing.

A recipe's builder resolves ``auto`` on the driver before any worker starts and records the choice
in the run's config (``rlcore.trainer.choices``), so workers built by a recipe see a concrete value.
This is the path of a worker built by hand with ``auto`` (a notebook): the same rule, decided once per
process and model directory (the actor and the reference colocated in one process agree), on rank 0
and broadcast, since FSDP ranks must hold parameters of one dtype even on unlike machines.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from rlcore.engines.dtype_choice import mixed_precision_choice
from rlcore.models.config import ModelConfig

logger = logging.getLogger(__name__)
_decided: dict[tuple[str | None, str], tuple[str | None, str]] = {}


def model_width(config) -> int:
    """The hidden size of a transformers config (a multimodal one's text model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "hidden_size", 0) or getattr(text, "d_model", 0) or getattr(text, "n_embd", 0))


def resolve_mixed_precision(model_cfg: ModelConfig, model: nn.Module, device: torch.device) -> str | None:
    """``model.mixed_precision`` with ``auto`` resolved to ``bfloat16`` or None (float32)."""
    if model_cfg.mixed_precision != "auto":
        return model_cfg.mixed_precision
    key = (model_cfg.path, device.type)
    if key not in _decided:
        decision = [choose_mixed_precision(model, device)] if not dist.is_initialized() or dist.get_rank() == 0 else [None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        _decided[key] = decision[0]
        logger.info("model.mixed_precision=auto -> %s (%s)", decision[0][0] or "float32", decision[0][1])
    return _decided[key][0]


def choose_mixed_precision(model: nn.Module, device: torch.device) -> tuple[str | None, str]:
    """(``bfloat16`` or None, why) for ``model`` on ``device``."""
    return mixed_precision_choice(model_width(model.config), device.type)
