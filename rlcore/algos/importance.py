"""Importance weights for samples drawn by another policy than the one being trained: a stale
engine (asynchronous rollout) or a different numeric path (bf16 vLLM against fp32 training)."""

from __future__ import annotations

import math

import torch

from rlcore.algos.stats import check_same_shape, masked_mean, masked_sum

Tensor = torch.Tensor

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")


@torch.no_grad()
def compute_is_weights(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
    mode: str = "truncate",
    lower: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Importance weights pi_old / pi_rollout for samples drawn by a different engine (e.g. bf16
    vLLM against fp32 training) or a stale policy, truncated or masked.

    The log weight, per ``level``:
      - "token": log w_t = old_t - rollout_t, each token its own weight;
      - "sequence": log w = sum_t (old_t - rollout_t) over valid tokens (the product of the token
        ratios: the exact sequence IS weight, whose spread grows with length), broadcast;
      - "geometric": log w = mean_t (old_t - rollout_t) (the geometric mean of the token ratios:
        a per-sequence mismatch score whose scale does not depend on length), broadcast.
    Then, per ``mode``:
      - "truncate" (TIS): w = min(w, cap); bounded variance for a little bias. ``lower`` unused.
      - "mask" (MIS, Yao et al. 2025; Liu et al. 2025): w is kept as it is inside
        [lower, cap] (``lower`` default 1 / cap) and set to 0 outside, so a token (level token) or
        a whole sequence (sequence / geometric) that the two engines disagree on too much is
        dropped instead of being kept with a capped weight, which would still train on it.
        A token is dropped exactly where its weight is 0; callers that drop it from the loss's
        token count too (as ``ActorWorker`` does) remove it from the response mask with ``w > 0``.
    Weights are detached and 0 at masked positions; rows without valid tokens get weight 1 before
    masking (they count nowhere).

    Metrics: "is/weight_mean" over valid tokens; "is/capped_frac", the fraction above ``cap``
    (over valid tokens for level token, over sequences otherwise); in mask mode also
    "is/masked_frac" (valid tokens given weight 0) and "is/masked_seq_frac" (sequences with at
    least one such token); "is/log_ratio_min" / "is/log_ratio_max" of the token log ratios.
    """
    check_same_shape("old_log_prob", old_log_prob, "rollout_log_probs", rollout_log_probs)
    check_same_shape("old_log_prob", old_log_prob, "response_mask", response_mask)
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-weight mode {mode!r}; known: {list(IS_MODES)}")
    if mode == "truncate" and lower is not None:
        raise ValueError(f"lower ({lower}) applies to mode 'mask' only; truncation has just the cap")
    if lower is None:
        lower = 1.0 / cap
    if mode == "mask" and not 0 < lower <= cap:
        raise ValueError(f"mask mode needs 0 < lower <= cap, got lower {lower}, cap {cap}")
    valid = response_mask.bool()
    has_tokens = valid.any(dim=-1)
    log_ratio = torch.where(valid, old_log_prob - rollout_log_probs, torch.zeros((), dtype=old_log_prob.dtype))
    if level == "token":
        log_w = log_ratio
    elif level == "sequence":
        log_w = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    elif level == "geometric":
        log_w = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown importance-weight level {level!r}; known: {list(IS_LEVELS)}")
    log_cap, log_lower = math.log(cap), math.log(lower)
    above = log_w > log_cap
    if mode == "truncate":
        weights = torch.exp(log_w.clamp(max=log_cap))
    else:
        dropped = above | (log_w < log_lower)
        weights = torch.where(dropped, torch.zeros_like(log_w), torch.exp(log_w.clamp(log_lower, log_cap)))
    weights = torch.where(valid, weights, torch.zeros_like(weights))

    def seq_frac(flags: Tensor) -> float:  # fraction of non-empty rows with a flagged valid token
        hit = (flags & valid).any(dim=-1)[has_tokens]
        return float(hit.to(weights.dtype).mean().nan_to_num(0.0))

    def token_frac(flags: Tensor) -> float:  # fraction of valid tokens flagged
        return float(masked_mean(flags.to(weights.dtype), response_mask))

    metrics = {
        "is/weight_mean": float(masked_mean(weights, response_mask)),
        "is/capped_frac": token_frac(above) if level == "token" else seq_frac(above),
        "is/log_ratio_min": float(log_ratio[valid].min()) if valid.any() else 0.0,
        "is/log_ratio_max": float(log_ratio[valid].max()) if valid.any() else 0.0,
    }
    if mode == "mask":
        metrics["is/masked_frac"] = token_frac(dropped)
        metrics["is/masked_seq_frac"] = seq_frac(dropped)
    return weights, metrics


# ---------------------------------------------------------------------------------------------
