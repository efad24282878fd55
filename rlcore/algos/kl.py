"""KL to the reference policy: per-token estimators, and the controllers of a KL-in-reward penalty."""

from __future__ import annotations

from typing import Any

import torch

from rlcore.algos.stats import check_same_shape, masked_mean

Tensor = torch.Tensor

KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")  # what kl_penalty estimates by


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    - "k1"/"kl": logp - ref (unbiased, high variance, can be negative);
    - "abs": |logp - ref|;
    - "k2"/"mse": 0.5 * (logp - ref)^2;
    - "k3"/"low_var_kl": exp(ref - logp) - (ref - logp) - 1, always >= 0, clamped to [-10, 10].
      The exponent is clamped to [-20, 20] first: an inf there would turn the clamp's zero
      gradient into NaN.
    """
    check_same_shape("logprob", logprob, "ref_logprob", ref_logprob)
    diff = logprob - ref_logprob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(-20.0, 20.0)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_penalty kind {kind!r}; known: k1/kl, abs, k2/mse, k3/low_var_kl")


class FixedKLController:
    """A constant KL coefficient (``update`` does nothing)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 that steers the observed KL to a target.

    error = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon.
    The clip keeps one noisy batch from moving the coefficient by more than 20% per horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def get_kl_controller(kind: str, **kwargs: Any) -> FixedKLController | AdaptiveKLController:
    """"fixed" -> FixedKLController(kl_coef); "adaptive" -> AdaptiveKLController(init_kl_coef,
    target_kl, horizon)."""
    if kind == "fixed":
        return FixedKLController(**kwargs)
    if kind == "adaptive":
        return AdaptiveKLController(**kwargs)
    raise ValueError(f"unknown kl controller {kind!r}; known: fixed, adaptive")


def apply_kl_penalty(
    token_level_scores: Tensor,
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "k1",
) -> tuple[Tensor, dict[str, float]]:
    """Fold a KL penalty into the reward (the "KL in reward" of InstructGPT-style PPO).

    rewards = scores - coef * kl * mask, with the coefficient in effect for this batch; then the
    controller sees this batch's KL (mean over sequences of the per-sequence token-mean KL) with
    n_steps = batch size.
    """
    check_same_shape("token_level_scores", token_level_scores, "response_mask", response_mask)
    kld = torch.where(response_mask.bool(), kl_penalty(log_prob, ref_log_prob, kind), 0.0)
    coef = kl_ctrl.value
    rewards = token_level_scores - coef * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": coef}
