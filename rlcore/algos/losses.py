"""Losses: aggregation of per-token losses, the policy-loss registry, and the value loss.

A policy loss is one function registered by name (``actor.policy_loss``)::

    @register_policy_loss("name")
    def my_loss(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]

``inp`` holds the tensors of one micro-batch (log-probs now and when sampled, advantages, mask,
optional importance weights), the ``LossScale`` that makes the result DP-invariant, and the
micro-batch itself (``inp.data``) for losses that read keys of their own (DPO reads
``ref_log_prob``). ``cfg`` holds the settings (clip ratios, aggregation); the actor's own config
section is one, so every ``actor.*`` setting reaches the loss without a parameter list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.algos.stats import check_same_shape, masked_mean, masked_sum
from rlcore.registry import Registry

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ---------------------------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossScale:
    """The whole mini-batch's counts, so that one micro-batch's loss is its exact share of the
    global mean (see ``agg_loss``): valid tokens and non-empty sequences over every micro-batch
    and every one of ``dp_size`` ranks. All None: the plain mean over this micro-batch.
    ``norm_len``: the mini-batch's padded response width, the constant "seq-mean-token-sum-norm"
    divides by; micro-batches cropped to their own width (``rlcore.engines.layout.crop_padding``)
    would otherwise each divide by a different one."""

    global_tokens: int | Tensor | None = None
    global_seqs: int | Tensor | None = None
    dp_size: int = 1
    norm_len: int | None = None

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")


LOCAL = LossScale()


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str, scale: LossScale = LOCAL,
             norm_len: int | None = None) -> Tensor:
    """Reduce a (batch, T) per-token loss to a scalar.

    Modes:
      - "token-mean": every valid token of the mini-batch weighs the same (DAPO's choice).
      - "seq-mean-token-sum": per-sequence sum of token losses, then mean over sequences.
      - "seq-mean-token-mean": per-sequence mean over its valid tokens, then mean over
        sequences (original GRPO; long answers get less weight per token).
      - "seq-mean-token-sum-norm": per-sequence sum divided by the constant ``norm_len``
        (default ``scale.norm_len``, else ``loss_mat.shape[-1]``, the padded response length), then
        mean over sequences (Dr. GRPO's length-unbiased normaliser). For DP invariance every
        micro-batch must use the same ``norm_len``: pass it (or ``scale.norm_len``) explicitly
        when micro-batches are padded differently.
    A "sequence" is a row with at least one valid token, so DP padding rows (all-zero mask)
    never dilute a mean.

    Contract, which is what makes the loss independent of how a mini-batch is cut:
      - ``scale`` counts None: the plain mean over *this* micro-batch.
      - given: they are the counts over the whole mini-batch, across all micro-batches and
        all ``dp_size`` ranks. The result is then this micro-batch's *contribution*, e.g. for
        token-mean sum(loss * mask) / global_tokens * dp_size. Summing contributions over a
        rank's micro-batches (gradient accumulation without further division) and averaging
        gradients over the ranks (what DDP/FSDP all-reduce does) yields exactly the global
        mean, whatever the split. Token-mean needs ``global_tokens``; the seq modes ``global_seqs``.
    """
    check_same_shape("loss_mat", loss_mat, "loss_mask", loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")

    if loss_agg_mode == "token-mean":
        total = masked_sum(loss_mat, loss_mask)
        if scale.global_tokens is None:
            return total / loss_mask.bool().sum().clamp(min=1).to(loss_mat.dtype)
        return total / _positive("global_tokens", scale.global_tokens) * scale.dp_size

    token_sums = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sums / loss_mask.bool().sum(dim=-1).clamp(min=1).to(loss_mat.dtype)
    else:
        length = next(n for n in (norm_len, scale.norm_len, loss_mat.shape[-1]) if n is not None)
        if length <= 0:
            raise ValueError(f"norm_len must be > 0, got {length}")
        seq_losses = token_sums / length
    total = seq_losses.sum()  # rows without valid tokens contribute 0 to the sum ...
    if scale.global_seqs is None:  # ... and are not counted
        n_seqs = loss_mask.bool().any(dim=-1).sum()
        return total / n_seqs.clamp(min=1).to(loss_mat.dtype)
    return total / _positive("global_seqs", scale.global_seqs) * scale.dp_size


def _positive(name: str, count: int | Tensor) -> int | Tensor:
    if count <= 0:
        raise ValueError(f"{name} must be > 0, got {count}")
    return count


# ---------------------------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossConfig:
    """What every policy loss may read. ``ActorConfig`` extends it, so the actor section is one."""

    policy_loss: str = "ppo"  # a name in the policy-loss registry, or "package.module:function"
    clip_ratio_low: float = 0.2  # the ratio is clipped below at 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # ... and above at 1 + clip_ratio_high (0.28: DAPO's clip-higher)
    clip_ratio_c: float = 3.0  # dual_clip: the loss of a negative-advantage token is capped at -A * c
    loss_agg_mode: str = "token-mean"  # one of LOSS_AGG_MODES

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(f"clip ratios must be >= 0, got low {self.clip_ratio_low}, high {self.clip_ratio_high}")


@dataclass
class PolicyLossInput:
    """One micro-batch's tensors for a policy loss, (B, T_r) each."""

    log_prob: Tensor  # under the policy being updated (with grad)
    old_log_prob: Tensor  # under the policy the advantages were computed for (detached)
    advantages: Tensor | None
    response_mask: Tensor
    is_weights: Tensor | None = None  # detached per-token weights (IS correction); multiply the loss
    scale: LossScale = field(default_factory=LossScale)
    data: Any = None  # the micro-batch DataProto, for losses that read keys of their own

    def __post_init__(self) -> None:
        check_same_shape("log_prob", self.log_prob, "old_log_prob", self.old_log_prob)
        check_same_shape("log_prob", self.log_prob, "response_mask", self.response_mask)
        if self.advantages is not None:
            check_same_shape("log_prob", self.log_prob, "advantages", self.advantages)
        if self.is_weights is not None:
            check_same_shape("log_prob", self.log_prob, "is_weights", self.is_weights)

    def log_ratio(self) -> Tensor:
        """log(pi / pi_old), clamped so that a stale sample cannot overflow exp() (|x| > 20 is clipped anyway)."""
        return (self.log_prob - self.old_log_prob.detach()).clamp(-20.0, 20.0)


PolicyLossFn = Callable[[PolicyLossInput, PolicyLossConfig], tuple[Tensor, dict[str, float]]]
_POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register_policy_loss = _POLICY_LOSSES.register
get_policy_loss = _POLICY_LOSSES.get


def finish_policy_loss(pg_losses: Tensor, inp: PolicyLossInput, cfg: PolicyLossConfig, log_ratio: Tensor,
                       clipfrac: Tensor, clipfrac_lower: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Apply the IS weights, aggregate, and collect the metrics every policy loss reports."""
    mask = inp.response_mask
    if inp.is_weights is not None:
        pg_losses = pg_losses * inp.is_weights.detach()
    loss = agg_loss(pg_losses, mask, cfg.loss_agg_mode, inp.scale)
    with torch.no_grad():
        metrics = {
            # the local micro-batch mean: comparable across runs whatever the DP split
            "pg_loss": float(agg_loss(pg_losses, mask, cfg.loss_agg_mode, norm_len=inp.scale.norm_len)),
            "pg_clipfrac": float(masked_mean(clipfrac.to(pg_losses.dtype), mask)),
            "ppo_kl": float(masked_mean(-log_ratio, mask)),
            "pg_clipfrac_lower": float(masked_mean(clipfrac_lower.to(pg_losses.dtype), mask)),
        }
    return loss, metrics


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, cfg: PolicyLossConfig) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate max(-A r, -A clip(r, 1-low, 1+high)) and where the clip won."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def zero_without_advantage(fn: PolicyLossFn) -> PolicyLossFn:
    """Mark a policy loss whose gradient from a row is exactly zero when that row's advantages are
    all zero (each token's loss is its advantage times something finite): the actor then leaves
    such rows out of the forward and backward (``actor.skip_zero_advantage_rows``), e.g. the
    groups of GRPO whose samples all got the same reward. A loss of one's own gets it by applying
    this decorator; unmarked losses train on every row."""
    fn.zero_without_advantage = True
    return fn


def _needs_advantages(inp: PolicyLossInput, name: str) -> Tensor:
    if inp.advantages is None:
        raise ValueError(f"the {name!r} policy loss needs advantages")
    return inp.advantages


@register_policy_loss("ppo")
@zero_without_advantage
def compute_policy_loss_ppo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate of PPO (Schulman et al. 2017), ratio = exp(log_prob - old_log_prob).

    The ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; unequal bounds give
    DAPO's clip-higher, which leaves low-probability tokens room to grow.
    """
    advantages = _needs_advantages(inp, "ppo")
    log_ratio = inp.log_ratio()
    pg_losses, clipped = _clipped_surrogate(log_ratio, advantages, cfg)
    return finish_policy_loss(pg_losses, inp, cfg, log_ratio, clipped, torch.zeros_like(clipped))


@register_policy_loss("dual_clip")
@zero_without_advantage
def compute_policy_loss_dual_clip(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """PPO plus the dual clip of Ye et al. 2020: for A < 0 the loss is capped at -A * c.

    With a negative advantage and a huge ratio (a sample that became far likelier since it was
    drawn) the plain surrogate -A * r is unbounded; the cap bounds that token's push.
    pg_clipfrac_lower is the fraction of valid tokens where the cap applied.
    """
    if cfg.clip_ratio_c <= 1.0:
        raise ValueError(f"dual clip needs clip_ratio_c > 1, got {cfg.clip_ratio_c}")
    advantages = _needs_advantages(inp, "dual_clip")
    log_ratio = inp.log_ratio()
    pg_losses, clipped = _clipped_surrogate(log_ratio, advantages, cfg)
    cap = -advantages * cfg.clip_ratio_c
    negative = advantages < 0
    capped = negative & (pg_losses > cap)
    pg_losses = torch.where(negative, torch.minimum(pg_losses, cap), pg_losses)
    return finish_policy_loss(pg_losses, inp, cfg, log_ratio, clipped, capped)


@register_policy_loss("reinforce")
@zero_without_advantage
def compute_policy_loss_reinforce(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """Unclipped policy gradient: loss = -A * exp(log_prob - old_log_prob).

    On-policy (ratio 1) its gradient is exactly REINFORCE's -A * grad log_prob; off-policy the
    ratio is the plain importance weight. The clip settings are ignored.
    """
    log_ratio = inp.log_ratio()
    pg_losses = -_needs_advantages(inp, "reinforce") * torch.exp(log_ratio)
    none = torch.zeros_like(pg_losses, dtype=torch.bool)
    return finish_policy_loss(pg_losses, inp, cfg, log_ratio, none, none)


def _sequence_log_ratio(inp: PolicyLossInput) -> Tensor:
    """(B, 1) mean over each row's valid tokens of log(pi / pi_old): GSPO's length-normalised
    log sequence ratio (a row without valid tokens gets 0, i.e. ratio 1; it is masked anyway)."""
    return masked_mean(inp.log_ratio(), inp.response_mask, dim=-1).unsqueeze(-1)


@register_policy_loss("gspo")
@zero_without_advantage
def compute_policy_loss_gspo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on the sequence ratio
    s_i = exp(mean_t log(pi / pi_old)), broadcast to the row's tokens.

    Why a sequence ratio: the reward is given to the whole response, so the importance weight
    should be the response's too; token ratios are noisy single-sample estimates of it whose
    variance grows with length. The geometric mean (length normalisation) keeps s_i near 1 on
    any length, so one clip range fits short and long answers, and a whole response is clipped
    or not: clipping never keeps half an answer's tokens. s_i carries the gradient of every
    token of the row (d s_i = s_i * mean_t d log pi). With per-token advantages (GAE) token t's
    loss also moves the row's other tokens; ``gspo_token`` keeps each token's gradient its own.

    Settings: ``clip_ratio_low`` / ``clip_ratio_high`` bound s_i, and s_i moves far less than a
    token ratio: the paper uses 3e-4 / 4e-4 (PPO's 0.2 would almost never clip). The paper's
    aggregation is ``loss_agg_mode=seq-mean-token-mean`` (one term per response); pg_clipfrac
    is the fraction of valid tokens whose row was clipped.
    """
    advantages = _needs_advantages(inp, "gspo")
    log_seq = _sequence_log_ratio(inp).expand_as(inp.log_prob)
    pg_losses, clipped = _clipped_surrogate(log_seq, advantages, cfg)
    return finish_policy_loss(pg_losses, inp, cfg, inp.log_ratio(), clipped, torch.zeros_like(clipped))


@register_policy_loss("gspo_token")
@zero_without_advantage
def compute_policy_loss_gspo_token(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """GSPO-token (Zheng et al. 2025): token ratio s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)].

    Its value is GSPO's sequence ratio s_i on every token, so clipping is decided per response
    as in ``gspo``, but token t's gradient is s_i * A_t * d log pi(y_t), its own only: per-token
    advantages (GAE, multi-turn credit) act on their tokens. With one advantage per response and
    ``seq-mean-token-mean`` it has exactly ``gspo``'s value and gradient. Same settings as ``gspo``.
    """
    advantages = _needs_advantages(inp, "gspo_token")
    log_prob = inp.log_prob
    log_seq = _sequence_log_ratio(inp).detach() + log_prob - log_prob.detach()
    pg_losses, clipped = _clipped_surrogate(log_seq, advantages, cfg)
    return finish_policy_loss(pg_losses, inp, cfg, inp.log_ratio(), clipped, torch.zeros_like(clipped))


@register_policy_loss("cispo")
@zero_without_advantage
def compute_policy_loss_cispo(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient IS weight,
    gradient -sg[clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_t * d log pi(y_t).

    Why: PPO's clip zeroes the gradient of a token whose ratio left the trust region, and the
    tokens that do so are often the rare "fork" tokens (reflection words) that matter most;
    CISPO bounds the token's weight instead and keeps its gradient. The per-token loss is
    -sg[w] * A * (1 + log_prob - sg[log_prob]): the gradient of the paper's -sg[w] * A * log_prob,
    with the value -w * A (a weighted advantage, comparable with PPO's pg_loss; the paper's
    value would be dominated by the size of log_prob).

    Settings: MiniMax-M1 set no lower bound (``clip_ratio_low=1.0``: the weight is clipped below
    at 0, i.e. not at all) and tuned only ``clip_ratio_high``. pg_clipfrac: fraction of valid
    tokens whose weight was clipped (either side); pg_clipfrac_lower: those clipped below.
    """
    advantages = _needs_advantages(inp, "cispo")
    log_ratio = inp.log_ratio()
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
        above, below = ratio > 1.0 + cfg.clip_ratio_high, ratio < 1.0 - cfg.clip_ratio_low
    log_prob = inp.log_prob
    pg_losses = -weight * advantages * (1.0 + log_prob - log_prob.detach())
    return finish_policy_loss(pg_losses, inp, cfg, log_ratio, above | below, below)


# ---------------------------------------------------------------------------------------------
# Value loss
# ---------------------------------------------------------------------------------------------


def compute_value_loss(vpreds: Tensor, values: Tensor, returns: Tensor, response_mask: Tensor,
                       cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
                       scale: LossScale = LOCAL) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2).

    The clipped term keeps the critic from moving far from the values the advantages were
    computed with, in one update. vf_clipfrac is the fraction of valid tokens where it won;
    vf_loss is the local micro-batch mean (for logging). Aggregation as in ``agg_loss``.
    """
    check_same_shape("vpreds", vpreds, "values", values)
    check_same_shape("vpreds", vpreds, "returns", returns)
    check_same_shape("vpreds", vpreds, "response_mask", response_mask)
    clipped_preds = values + (vpreds - values).clamp(-cliprange_value, cliprange_value)
    unclipped_err = (vpreds - returns).square()
    clipped_err = (clipped_preds - returns).square()
    loss_mat = 0.5 * torch.maximum(unclipped_err, clipped_err)
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, scale)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(agg_loss(loss_mat, response_mask, loss_agg_mode, norm_len=scale.norm_len)),
            "vf_clipfrac": float(masked_mean((clipped_err > unclipped_err).to(vpreds.dtype), response_mask)),
        }
    return loss, metrics
