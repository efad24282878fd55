"""LoRA actors through peft: adapters to train, merged weights for everyone else.

With ``actor.lora.rank > 0`` the actor wraps its HF model with peft's LoRA before FSDP2 shards it:
every targeted linear layer keeps its weight ``W`` frozen and adds ``alpha / rank * B @ A`` (``A``
random, ``B`` zero, so the adapted model starts as the base model). Only ``A`` and ``B`` get
gradients and sit in the optimizer: AdamW's two moments shrink from twice the model to twice the
adapters (``python -m benchmarks.lora_memory`` measures it).

The rest of the system keeps seeing a plain HF model. Rollout engines (the hybrid engine's
``sync_weights``, bucketed ``push_weights``) and ``export_hf`` get ``merge_lora_tensors`` of the
actor's state dict: each targeted weight replaced by ``W + alpha / rank * B @ A`` under the base
model's own parameter name, no ``lora_`` tensor among them. So vLLM needs no LoRA support and an
export loads with ``AutoModelForCausalLM``. The merge streams: a layer's tensors come out as soon
as its adapters have gone by, so the bucketed sync still never holds the whole model.

The frozen base is also the reference policy: the actor computes ``ref_log_prob`` with its adapters
switched off, and a run needs no reference copy of the weights (``rlcore.trainer.builder``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch import nn

from rlcore.workers.config import LoraConfig

PEFT_PREFIX = "base_model.model."  # what peft puts before every name of the wrapped model
ADAPTER = "default"  # peft's name for the one adapter it adds
# A targeted linear layer's entries: <module>.base_layer.weight / .bias, <module>.lora_A|B.default.weight
_LORA_PART = re.compile(rf"^(.*)\.(base_layer\.weight|lora_A\.{ADAPTER}\.weight|lora_B\.{ADAPTER}\.weight)$")
_BASE_BIAS = ".base_layer.bias"


def wrap_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """``model`` with LoRA adapters on ``cfg.target_modules``; only the adapters require grad."""
    if not cfg.enabled:
        raise ValueError("wrap_lora needs lora.rank > 0")
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=cfg.target_modules,
                              lora_dropout=cfg.dropout, bias="none")
    return get_peft_model(model, peft_cfg)


def lora_scaling(cfg: LoraConfig) -> float:
    """The factor on ``B @ A`` (peft's ``scaling``; rsLoRA is not used)."""
    return cfg.alpha / cfg.rank


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer should hold: all of a plain model's, only the adapters of a LoRA one."""
    return [p for p in model.parameters() if p.requires_grad]


def merge_lora_tensors(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft LoRA model's state-dict entries as the base model's: names without peft's prefixes,
    each adapted weight merged (``W + scaling * B @ A``, computed in float32, cast back to ``W``'s
    dtype). Lazy, in the input's order, holding only the parts of layers whose adapters have not
    all gone by yet. An entry this cannot map (another adapter type, a second adapter) is an error
    rather than a tensor the engine would silently not know."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if not name.startswith(PEFT_PREFIX):
            raise ValueError(f"{name!r} is not a name of a peft model (no {PEFT_PREFIX!r} prefix)")
        name = name[len(PEFT_PREFIX):]
        part = _LORA_PART.match(name)
        if part:
            module, kind = part.group(1), part.group(2).split(".")[0]
            parts = pending.setdefault(module, {})
            parts[kind] = tensor
            if len(parts) == 3:
                del pending[module]
                yield f"{module}.weight", _merged(parts["base_layer"], parts["lora_A"], parts["lora_B"], scaling)
        elif name.endswith(_BASE_BIAS):
            yield name[: -len(_BASE_BIAS)] + ".bias", tensor
        elif "lora_" in name or ".base_layer." in name:
            raise ValueError(f"cannot merge {name!r}: only LoRA on linear layers (adapter {ADAPTER!r}) is supported")
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"incomplete LoRA layers (a weight or an adapter missing): {sorted(pending)}")


def _merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    if a.shape[1] != weight.shape[1] or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA shapes do not fit: W {tuple(weight.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}")
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
