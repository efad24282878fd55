"""Advantage estimators, in a registry keyed by name (``algorithm.adv_estimator``).

Each estimator takes the batch tensors it needs by parameter name (``token_level_rewards``,
``response_mask``, ``values``, ``index`` for the prompt groups, ``reward_baselines``, ...) and
returns ``(advantages, returns)``, both (batch, response_len). A new estimator is one function
with ``@register_advantage_estimator("name")``; the driver offers it what the batch holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from rlcore.algos.stats import check_same_shape, masked_whiten
from rlcore.registry import Registry

Tensor = torch.Tensor

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


def _first_of_each(episode_index: Sequence[Hashable] | np.ndarray, batch_size: int, device) -> Tensor:
    """A mask of one row per episode (its first): an episode of several rows (a chat agent's
    segments, all with the episode's reward) counts once in its group's statistics."""
    labels = np.asarray(episode_index)
    if labels.shape != (batch_size,):
        raise ValueError(f"episode_index must hold one episode id per sequence ({batch_size}), got {labels.shape}")
    _, first = np.unique(labels, return_index=True)
    keep = torch.zeros(batch_size, dtype=torch.bool, device=device)
    keep[torch.as_tensor(first, device=device)] = True
    return keep


def _group_mean_std(scores: Tensor, gid: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence group mean, unbiased group std and group size (broadcast back to rows), over
    the rows in ``keep`` (all by default).

    A group of one has no spread to measure: it gets mean 0 and std 1, so its advantage is its
    raw score rather than a meaningless 0/0.
    """
    n_groups = int(gid.max()) + 1
    all_gid = gid
    if keep is not None:
        scores, gid = scores[keep], gid[keep]
    counts = torch.bincount(gid, minlength=n_groups).to(scores.dtype)
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean = sums / counts.clamp(min=1)
    sq = torch.zeros_like(sums).index_add_(0, gid, (scores - mean[gid]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[all_gid], std[all_gid], counts[all_gid]


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
    check_same_shape("token_level_rewards", token_level_rewards, "values", values)
    check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
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
    episode_index: Sequence[Hashable] | np.ndarray | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO (Shao et al. 2024): outcome score normalised within its prompt group.

    score_i = sum_t r_{i,t} (rewards are expected to be 0 outside the mask); sequences sharing
    ``index[i]`` form a group; A_i = (score_i - mean_g) / (std_g + epsilon) with the unbiased
    std, or just score_i - mean_g when ``norm_adv_by_std`` is False (Dr. GRPO, Liu et al. 2025,
    which argues the std division over-weights easy/hard prompts). A_i is broadcast over the
    valid tokens. There is no critic, so returns are the advantages. With ``episode_index``, rows
    of one episode (segments sharing its reward) count once in the group's mean and std.
    """
    check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    scores = token_level_rewards.sum(dim=-1)
    gid = _group_ids(index, scores.shape[0], scores.device)
    keep = None if episode_index is None else _first_of_each(episode_index, scores.shape[0], scores.device)
    mean, std, _ = _group_mean_std(scores, gid, keep)
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
    episode_index: Sequence[Hashable] | np.ndarray | None = None,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: GRPO's group-mean baseline without dividing by the group std."""
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, norm_adv_by_std=False, epsilon=epsilon, episode_index=episode_index
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
    check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
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
    check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
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
    check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
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
    check_same_shape("token_level_rewards", token_level_rewards, "response_mask", response_mask)
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must have shape ({token_level_rewards.shape[0]},), "
            f"got {tuple(reward_baselines.shape)}"
        )
    returns = _returns_to_go(token_level_rewards, response_mask, gamma=1.0)
    advantages = returns - _broadcast(reward_baselines.to(returns.dtype), response_mask)
    return advantages, returns
