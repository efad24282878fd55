"""Algorithm math shared by recipes: masked statistics, advantages, KL, losses.

Everything here is a pure function of tensors (plus two tiny KL controller classes), so that
it can be tested on hand-sized examples and reused by any worker or recipe. Conventions:

- token-level tensors are ``(batch, response_len)``;
- ``response_mask`` has the same shape, 0/1 float or bool; 1 marks a generated token that
  counts. Values at masked positions never enter a forward result, even NaN/inf ones (masking
  selects with ``torch.where`` rather than multiplying); keep them finite where gradients flow,
  since the backward pass still computes 0 * inf = NaN through them.
- Advantage estimators and policy losses live in registries keyed by name, so a recipe
  picks one from its config and a new algorithm adds one function, not a flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlcore.registry import Registry

Tensor = torch.Tensor

# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


def _check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set. Masked entries are replaced by 0 (not multiplied),
    so a NaN or inf in padding cannot leak into the result."""
    _check_same_shape("x", x, "mask", mask)
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries; an empty mask gives 0 rather than NaN, because a
    micro-batch made only of DP padding rows is legitimate and must not poison metrics."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of ``x`` (over all of them, as one population).

    With ``unbiased`` the n/(n-1) correction is applied when n > 1; a single entry has variance 0.
    """
    n = int(mask.bool().sum())
    if n == 0:
        raise ValueError("masked_var: the mask selects no entries")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and n > 1:
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise the masked entries of ``x`` to unit variance (and zero mean if ``shift_mean``).

    Statistics come from the masked entries only, so padding does not bias them; masked
    positions of the result are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# ---------------------------------------------------------------------------------------------


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) for ``logits (..., V)`` and integer ``labels (...)``.

    A full ``log_softmax`` would materialise a second (..., V) tensor; for fp32/fp64 we instead
    gather the label logit and subtract ``logsumexp``. Half-precision logsumexp loses too much
    accuracy, so there we go one sequence (first dimension) at a time in fp32, which bounds the
    extra memory to one sequence.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    chunks = logits.reshape(logits.shape[0] if logits.dim() > 2 else 1, -1, logits.shape[-1])
    chunk_labels = labels.reshape(chunks.shape[:2])
    rows = [
        F.log_softmax(chunk.float(), dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        for chunk, lab in zip(chunks, chunk_labels)
    ]
    return torch.stack(rows).reshape(labels.shape).to(logits.dtype)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p * z)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
_ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage_estimator = _ADVANTAGE_ESTIMATORS.register
get_advantage_estimator = _ADVANTAGE_ESTIMATORS.get


def _group_ids(index: Sequence[Hashable] | np.ndarray | Tensor, batch_size: int, device) -> Tensor:
    """Map arbitrary group labels (uid strings, ints) to dense ids 0..G-1 without a Python loop."""
    if isinstance(index, Tensor):
        index = index.cpu().numpy()
    labels = np.asarray(index)
    if labels.shape != (batch_size,):
        raise ValueError(f"index must hold one group id per sequence ({batch_size}), got shape {labels.shape}")
    _, inverse = np.unique(labels, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)


def _group_mean_std(scores: Tensor, gid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence group mean, unbiased group std and group size (broadcast back to rows).

    A group of one has no spread to measure: it gets mean 0 and std 1, so its advantage is its
    raw score rather than a meaningless 0/0.
    """
    n_groups = int(gid.max()) + 1
    counts = torch.bincount(gid, minlength=n_groups).to(scores.dtype)
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[gid], std[gid], counts[gid]


def _returns_to_go(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over valid tokens; masked tokens are skipped (they neither
    add reward nor discount) and get 0."""
    mask = response_mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        g = rewards[:, t] + gamma * running
        running = torch.where(mask[:, t], g, running)
        returns[:, t] = torch.where(mask[:, t], g, torch.zeros_like(g))
    return returns


def _broadcast(per_seq: Tensor, response_mask: Tensor) -> Tensor:
    return per_seq.unsqueeze(-1) * response_mask.to(per_seq.dtype)


@register_advantage_estimator("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016), backwards over valid tokens.

    delta_t = r_t + gamma * V_next - V_t ; A_t = delta_t + gamma * lam * A_next, where "next"
    is the next *valid* token: masked positions are skipped, so right padding (and masked
    tool-output tokens inside a response) never contribute a value. The last valid token
    bootstraps from 0. returns = A + V (the critic's target) is taken before whitening.
    """
    _check_same_shape("token_level_rewards", token_level_rewards, "values", values)
    _check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    mask = response_mask.bool()
    advantages = torch.zeros_like(token_level_rewards)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_adv = torch.where(mask[:, t], adv, next_adv)
        advantages[:, t] = torch.where(mask[:, t], adv, torch.zeros_like(adv))
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_advantage_estimator("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable] | np.ndarray,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): outcome score normalised within its prompt group.

    score_i = sum_t r_{i,t} (rewards are expected to be 0 outside the mask); sequences sharing
    ``index[i]`` form a group; A_i = (score_i - mean_g) / (std_g + epsilon) with the unbiased
    std, or just score_i - mean_g when ``norm_adv_by_std`` is False (Dr. GRPO, Liu et al. 2025,
    which argues the std division over-weights easy/hard prompts). A_i is broadcast over the
    valid tokens. There is no critic, so returns are the advantages.
    """
    _check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], scores.device)
    mean, std, _ = _group_mean_std(scores, gid)
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    advantages = _broadcast(adv, response_mask)
    return advantages, advantages


@register_advantage_estimator("dr_grpo")
def compute_dr_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable] | np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: GRPO's group-mean baseline without dividing by the group std."""
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, norm_adv_by_std=False, epsilon=epsilon
    )


@register_advantage_estimator("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable] | np.ndarray,
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): the baseline of sample i is the mean
    score of the *other* samples of its group, which keeps the estimator unbiased.
    A_i = score_i - (sum_g - score_i) / (n_g - 1). A group of one has no others: baseline 0.
    """
    _check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], scores.device)
    n_groups = int(gid.max()) + 1
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    counts = torch.bincount(gid, minlength=n_groups).to(scores.dtype)[gid]
    others_mean = (sums[gid] - scores) / (counts - 1).clamp(min=1)
    baseline = torch.where(counts > 1, others_mean, torch.zeros_like(scores))
    advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the whole batch
    (the batch-level normalisation stands in for a critic's baseline). Returns are the
    un-whitened returns-to-go."""
    _check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    returns = _returns_to_go(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable] | np.ndarray,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: score minus its group mean, broadcast over valid
    tokens, then whitened over the batch's valid tokens. Returns are the advantages."""
    _check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], scores.device)
    mean, _, _ = _group_mean_std(scores, gid)
    advantages = masked_whiten(_broadcast(scores - mean, response_mask), response_mask)
    return advantages, advantages


@register_advantage_estimator("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: Tensor,
    reward_baselines: Tensor,
    response_mask: Tensor,
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023): return-to-go (gamma = 1) minus the reward of the greedy response
    to the same prompt (``reward_baselines``, shape (batch,)). No whitening. Returns are the
    returns-to-go."""
    _check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must have shape ({token_level_rewards.shape[0]},), "
            f"got {tuple(reward_baselines.shape)}"
        )
    returns = _returns_to_go(token_level_rewards, response_mask, gamma=1.0)
    advantages = returns - _broadcast(reward_baselines.to(returns.dtype), response_mask)
    return advantages, returns


# ---------------------------------------------------------------------------------------------
# KL penalty and controllers
# ---------------------------------------------------------------------------------------------


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    - "k1"/"kl": logp - ref (unbiased, high variance, can be negative);
    - "abs": |logp - ref|;
    - "k2"/"mse": 0.5 * (logp - ref)^2;
    - "k3"/"low_var_kl": exp(ref - logp) - (ref - logp) - 1, always >= 0, clamped to [-10, 10].
      The exponent is clamped to [-20, 20] first: an inf there would turn the clamp's zero
      gradient into NaN.
    """
    _check_same_shape("logprob", logprob, "ref_logprob", ref_logprob)
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
    _check_same_shape("token_level_scores", token_level_scores, "response_mask", response_mask)
    kld = torch.where(response_mask.bool(), kl_penalty(log_prob, ref_log_prob, kind), 0.0)
    coef = kl_ctrl.value
    rewards = token_level_scores - coef * kld
    current_kl = float(masked_mean(kld, response_mask, dim=-1).mean())
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": coef}


# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    global_tokens: int | Tensor | None = None,
    global_seqs: int | Tensor | None = None,
    dp_size: int = 1,
    norm_len: int | None = None,
) -> Tensor:
    """Reduce a (batch, T) per-token loss to a scalar.

    Modes:
      - "token-mean": every valid token of the mini-batch weighs the same (DAPO's choice).
      - "seq-mean-token-sum": per-sequence sum of token losses, then mean over sequences.
      - "seq-mean-token-mean": per-sequence mean over its valid tokens, then mean over
        sequences (original GRPO; long answers get less weight per token).
      - "seq-mean-token-sum-norm": per-sequence sum divided by the constant ``norm_len``
        (default ``loss_mat.shape[-1]``, the padded response length), then mean over sequences
        (Dr. GRPO's length-unbiased normaliser). For DP invariance every micro-batch must use
        the same ``norm_len``: pass it explicitly when micro-batches are padded differently.
    A "sequence" is a row with at least one valid token, so DP padding rows (all-zero mask)
    never dilute a mean.

    Contract, which is what makes the loss independent of how a mini-batch is cut:
      - ``global_tokens`` / ``global_seqs`` None: the plain mean over *this* micro-batch.
      - given: they are the counts over the whole mini-batch, across all micro-batches and
        all ``dp_size`` ranks (global_tokens = sum of loss_mask; global_seqs = rows with a valid
        token). The result is then this micro-batch's *contribution*, e.g. for token-mean
        sum(loss * mask) / global_tokens * dp_size. Summing contributions over a rank's
        micro-batches (gradient accumulation without further division) and averaging
        gradients over the ranks (what DDP/FSDP all-reduce does) yields exactly the global
        mean, whatever the split. The seq modes do the same with the per-sequence losses and
        ``global_seqs``. Token-mean needs ``global_tokens``; the seq modes need ``global_seqs``.
    """
    _check_same_shape("loss_mat", loss_mat, "loss_mask", loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")

    if loss_agg_mode == "token-mean":
        total = masked_sum(loss_mat, loss_mask)
        if global_tokens is None:
            return total / loss_mask.bool().sum().clamp(min=1).to(loss_mat.dtype)
        return total / _positive("global_tokens", global_tokens) * dp_size

    token_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sums / loss_mask.bool().sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
    else:
        length = loss_mat.shape[-1] if norm_len is None else norm_len
        if length <= 0:
            raise ValueError(f"norm_len must be > 0, got {length}")
        seq_losses = token_sums / length
    total = seq_losses.sum()  # rows without valid tokens contribute 0 to the sum ...
    if global_seqs is None:  # ... and are not counted
        n_seqs = loss_mask.bool().any(dim=-1).sum()
        return total / n_seqs.clamp(min=1).to(loss_mat.dtype)
    return total / _positive("global_seqs", global_seqs) * dp_size


def _positive(name: str, count: int | Tensor) -> int | Tensor:
    if count <= 0:
        raise ValueError(f"{name} must be > 0, got {count}")
    return count


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register_policy_loss = _POLICY_LOSSES.register
get_policy_loss = _POLICY_LOSSES.get


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor) -> Tensor:
    _check_same_shape("log_prob", log_prob, "old_log_prob", old_log_prob)
    _check_same_shape("log_prob", log_prob, "advantages", advantages)
    _check_same_shape("log_prob", log_prob, "response_mask", response_mask)
    # Clamped so that a stale sample cannot overflow exp(); |log ratio| > 20 is clipped anyway.
    return (log_prob - old_log_prob.detach()).clamp(-20.0, 20.0)


def _finish_policy_loss(
    pg_losses: Tensor,
    log_ratio: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str,
    is_weights: Tensor | None,
    global_tokens: int | Tensor | None,
    global_seqs: int | Tensor | None,
    dp_size: int,
    clipfrac: Tensor,
    clipfrac_lower: Tensor,
) -> tuple[Tensor, dict[str, float]]:
    """Apply IS weights, aggregate, and collect the metrics every policy loss reports."""
    if is_weights is not None:
        _check_same_shape("is_weights", is_weights, "log_prob", pg_losses)
        pg_losses = pg_losses * is_weights.detach()
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, global_tokens, global_seqs, dp_size)
    with torch.no_grad():
        metrics = {
            # the local micro-batch mean: comparable across runs whatever the DP split
            "pg_loss": float(agg_loss(pg_losses, response_mask, loss_agg_mode)),
            "pg_clipfrac": float(masked_mean(clipfrac.to(pg_losses.dtype), response_mask)),
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
            "pg_clipfrac_lower": float(masked_mean(clipfrac_lower.to(pg_losses.dtype), response_mask)),
        }
    return loss, metrics


def _clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate max(-A r, -A clip(r, 1-low, 1+high)) and where the clip won."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@register_policy_loss("ppo")
def compute_policy_loss_ppo(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    global_tokens: int | Tensor | None = None,
    global_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate of PPO (Schulman et al. 2017), ratio = exp(log_prob - old_log_prob).

    The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; unequal bounds give
    DAPO's clip-higher, which leaves low-probability tokens room to grow. ``clip_ratio_c`` is
    unused here (see "dual_clip"); it is accepted so all losses share one signature.
    ``is_weights`` (detached) multiplies the per-token loss, to correct for a rollout policy that
    differs from ``old_log_prob``'s (see ``compute_is_weights``).
    """
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    pg_losses, clipped = _clipped_surrogate(log_ratio, advantages, clip_ratio_low, clip_ratio_high)
    return _finish_policy_loss(
        pg_losses, log_ratio, response_mask, loss_agg_mode, is_weights,
        global_tokens, global_seqs, dp_size, clipped, torch.zeros_like(clipped),
    )


@register_policy_loss("clip_higher")
def compute_policy_loss_clip_higher(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    global_tokens: int | Tensor | None = None,
    global_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """"ppo" with DAPO's default asymmetric bounds (low 0.2, high 0.28)."""
    return compute_policy_loss_ppo(
        log_prob, old_log_prob, advantages, response_mask,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode, is_weights=is_weights,
        global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size,
    )


@register_policy_loss("dual_clip")
def compute_policy_loss_dual_clip(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    global_tokens: int | Tensor | None = None,
    global_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """PPO plus the dual clip of Ye et al. 2020: for A < 0 the loss is capped at -A * c.

    With a negative advantage and a huge ratio (a sample that became far likelier since it was
    drawn) the plain surrogate -A * r is unbounded; the cap bounds that token's push.
    pg_clipfrac_lower is the fraction of valid tokens where the cap applied.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"dual clip needs clip_ratio_c > 1, got {clip_ratio_c}")
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    pg_losses, clipped = _clipped_surrogate(log_ratio, advantages, clip_ratio_low, clip_ratio_high)
    cap = -advantages * clip_ratio_c
    negative = advantages < 0
    capped = negative & (pg_losses > cap)
    pg_losses = torch.where(negative, torch.minimum(pg_losses, cap), pg_losses)
    return _finish_policy_loss(
        pg_losses, log_ratio, response_mask, loss_agg_mode, is_weights,
        global_tokens, global_seqs, dp_size, clipped, capped,
    )


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: Tensor | None = None,
    global_tokens: int | Tensor | None = None,
    global_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """Unclipped policy gradient: loss = -A * exp(log_prob - old_log_prob).

    On-policy (ratio 1) its gradient is exactly REINFORCE's -A * grad log_prob; off-policy the
    ratio is the plain importance weight. The clip arguments are accepted and ignored.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob, advantages, response_mask)
    pg_losses = -advantages * torch.exp(log_ratio)
    none = torch.zeros_like(pg_losses, dtype=torch.bool)
    return _finish_policy_loss(
        pg_losses, log_ratio, response_mask, loss_agg_mode, is_weights,
        global_tokens, global_seqs, dp_size, none, none,
    )


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
    _check_same_shape("old_log_prob", old_log_prob, "rollout_log_probs", rollout_log_probs)
    _check_same_shape("old_log_prob", old_log_prob, "response_mask", response_mask)
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
# Value loss
# ---------------------------------------------------------------------------------------------


def compute_value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    global_tokens: int | Tensor | None = None,
    global_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2).

    The clipped term keeps the critic from moving far from the values the advantages were
    computed with, in one update. vf_clipfrac is the fraction of valid tokens where it won;
    vf_loss is the local micro-batch mean (for logging). Aggregation as in ``agg_loss``.
    """
    _check_same_shape("vpreds", vpreds, "values", values)
    _check_same_shape("vpreds", vpreds, "returns", returns)
    _check_same_shape("vpreds", vpreds, "response_mask", response_mask)
    clipped_preds = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped_err = (vpreds - returns).square()
    clipped_err = (clipped_preds - returns).square()
    loss_mat = 0.5 * torch.maximum(unclipped_err, clipped_err)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_tokens, global_seqs, dp_size)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(agg_loss(loss_mat, response_mask, loss_agg_mode)),
            "vf_clipfrac": float(masked_mean((clipped_err > unclipped_err).to(vpreds.dtype), response_mask)),
        }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Preference (DPO) losses
# ---------------------------------------------------------------------------------------------


def compute_dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023) and IPO (Azar et al. 2023) on per-sequence summed log-probs.

    logits = (pi_c - pi_r) - (ref_c - ref_r).
    - "sigmoid": -(1 - ls) * logsigmoid(beta * logits) - ls * logsigmoid(-beta * logits); the
      label smoothing ``ls`` models a fraction of flipped preference labels (cDPO).
    - "ipo": (logits - 1 / (2 * beta))^2, which regresses the margin to a finite target instead
      of pushing it to infinity.
    Implicit rewards are beta * (pi - ref); metrics are batch means, accuracy is the fraction of
    pairs whose chosen reward beats the rejected one.
    """
    shape = policy_chosen_logps.shape
    if len(shape) != 1:
        raise ValueError(f"DPO expects per-sequence log-probs of shape (B,), got {tuple(shape)}")
    for name, t in (
        ("policy_rejected_logps", policy_rejected_logps),
        ("ref_chosen_logps", ref_chosen_logps),
        ("ref_rejected_logps", ref_rejected_logps),
    ):
        _check_same_shape("policy_chosen_logps", policy_chosen_logps, name, t)
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")

    logits = (policy_chosen_logps - policy_rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * logits) - label_smoothing * F.logsigmoid(
            -beta * logits
        )
    elif loss_type == "ipo":
        if label_smoothing != 0.0:
            raise ValueError("label_smoothing applies to the sigmoid loss only, not ipo")
        losses = (logits - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; known: sigmoid, ipo")

    with torch.no_grad():
        chosen = beta * (policy_chosen_logps - ref_chosen_logps)
        rejected = beta * (policy_rejected_logps - ref_rejected_logps)
        metrics = {
            "dpo/reward_chosen": float(chosen.mean()),
            "dpo/reward_rejected": float(rejected.mean()),
            "dpo/reward_margin": float((chosen - rejected).mean()),
            "dpo/accuracy": float((chosen > rejected).float().mean()),
        }
    return losses.mean(), metrics
