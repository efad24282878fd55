"""``model.mixed_precision: auto``: train in bf16 where this machine makes that faster, measured.

Why measure rather than take bf16 where the hardware has it: native bf16 (AMX, AVX512-BF16) speeds
up large matmuls, but on a small model the casts and the bf16 element-wise ops eat the gain.
Measured on a 2-core Xeon with AMX, forward + backward: the 25M model, 32 x 140 tokens, 3.1 s in
fp32 and 1.4 s in bf16 (this module's 8 x 128 probe: 1.7-2.0x); the 0.3M toy model, 512 x 24
tokens, 0.21 s in fp32 and 0.27 s in bf16 (the probe: 1.2-1.3x). Hence the 1.5x bar: it sends the
one to bf16 and the other to fp32 with room for the probe's noise. Without native bf16 it is
emulated and far slower (45x on an AVX2-only CPU), so it is not even tried.

The decision is made once per process and model directory (the actor and the reference colocated
in one process agree), on rank 0, and broadcast: FSDP ranks must hold parameters of one dtype.
"""

from __future__ import annotations

import copy
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from rlcore.engines.dtype_choice import native_bf16
from rlcore.models.config import ModelConfig

MIN_SPEEDUP = 1.5  # bf16 must be at least this much faster on the probe, so that timing noise does not flip the choice
PROBE_ROWS, PROBE_TOKENS = 8, 128  # the probe's synthetic micro-batch

logger = logging.getLogger(__name__)
_decided: dict[tuple[str | None, str], tuple[str | None, str]] = {}


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
    """(``bfloat16`` or None, why). CUDA with bf16: bf16. A CPU with native bf16: bf16 if a forward
    and backward of ``model`` on a synthetic micro-batch runs ``MIN_SPEEDUP`` times faster in it."""
    native, why = native_bf16(device.type)
    if not native:
        return None, why
    if device.type == "cuda":
        return "bfloat16", why
    speedup = bf16_speedup(model, device)
    choice = "bfloat16" if speedup >= MIN_SPEEDUP else None
    return choice, f"{why}; a forward/backward here ran {speedup:.2f}x as fast in bf16 (needs {MIN_SPEEDUP}x)"


def bf16_speedup(model: nn.Module, device: torch.device, repeats: int = 2) -> float:
    """fp32 seconds / bf16 seconds of one forward + backward of ``model`` (a bf16 copy for the latter),
    best of ``repeats`` after a warm-up; ``model`` itself is left as it was (its gradients cleared)."""
    vocab = model.get_input_embeddings().num_embeddings
    tokens = min(PROBE_TOKENS, getattr(model.config, "max_position_embeddings", PROBE_TOKENS))
    ids = torch.randint(0, vocab, (PROBE_ROWS, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    seconds = []
    for candidate in (model, bf16):
        was_training, needs_grad = candidate.training, [p.requires_grad for p in candidate.parameters()]
        candidate.train()
        candidate.requires_grad_(True)
        best = float("inf")
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            candidate(input_ids=ids, use_cache=False)[0].float().mean().backward()  # logits, or a backbone's hidden states
            if attempt:  # the first is warm-up
                best = min(best, time.perf_counter() - start)
        seconds.append(best)
        candidate.zero_grad(set_to_none=True)
        for p, flag in zip(candidate.parameters(), needs_grad):
            p.requires_grad_(flag)
        candidate.train(was_training)
    del bf16
    return seconds[0] / seconds[1]
