"""Importance weights for samples drawn by another policy than the one being trained: a stale
engine (asynchronous rollout) or a different numeric path (bf16 vLLM against fp32 training)."""

from __future__ import annotations

import math

import torch

from rlcore.algos.stats import check_same_shape, masked_mean, masked_sum

Tensor = torch.Tensor

IS_LEVELS = ("token", "sequence")


@torch.no_grad()
def compute_is_weights(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights pi_old / pi_rollout for samples drawn by a different engine
    (e.g. bf16 vLLM against fp32 training) or a stale policy.

    - level "token": w_t = min(exp(old_t - rollout_t), cap);
    - level "sequence": w = min(exp(sum_t (old_t - rollout_t)), cap) over valid tokens, the
      product of the token ratios, broadcast to every token of the sequence.
    Truncation (TIS) trades a little bias for bounded variance. Weights are detached and 0 at
    masked positions. Metrics: mean weight over valid tokens ("is/weight_mean") and the
    fraction capped, over valid tokens or over sequences ("is/capped_frac").
    """
    check_same_shape("old_log_prob", old_log_prob, "rollout_log_probs", rollout_log_probs)
    check_same_shape("old_log_prob", old_log_prob, "response_mask", response_mask)
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    log_cap = math.log(cap)
    log_ratio = old_log_prob - rollout_log_probs
    if level == "token":
        weights = torch.exp(log_ratio.clamp(max=log_cap))
        capped_frac = masked_mean((log_ratio > log_cap).to(weights.dtype), response_mask)
    elif level == "sequence":
        seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1)
        weights = torch.exp(seq_log_ratio.clamp(max=log_cap)).unsqueeze(-1).expand_as(log_ratio)
        has_tokens = response_mask.bool().any(dim=-1)
        capped_frac = (seq_log_ratio > log_cap)[has_tokens].to(weights.dtype).mean()
    else:
        raise ValueError(f"unknown importance-weight level {level!r}; known: token, sequence")
    weights = torch.where(response_mask.bool(), weights, torch.zeros_like(weights))
    metrics = {
        "is/weight_mean": float(masked_mean(weights, response_mask)),
        "is/capped_frac": float(capped_frac.nan_to_num(0.0)),
    }
    return weights, metrics


# ---------------------------------------------------------------------------------------------
