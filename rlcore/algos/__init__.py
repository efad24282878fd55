"""Pure tensor math of RL post-training, testable on hand-sized numbers and free of any worker:

- ``stats``: masked sums/means/variances, log-probs and entropy from logits;
- ``advantages``: the advantage-estimator registry (GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++, ReMax);
- ``kl``: KL estimators (k1/k2/k3) and the fixed/adaptive controllers of a KL-in-reward penalty;
- ``losses``: loss aggregation (DP-invariant), the policy-loss registry (PPO, dual clip, REINFORCE, GSPO, CISPO) and its settings, the value loss;
- ``importance``: truncated or masked importance weights against the sampler's log-probs;
- ``dapo``: DAPO's group filter (which prompt groups carry signal), truncation test, soft overlong penalty;
- ``sampling``: the engines' top-k / top-p filter, so the trainer scores the distribution that was sampled;
- ``preference``: DPO/IPO and the (best, worst) pairs of online DPO; the Bradley-Terry reward-model loss;
- ``seqlen_balancing``: packing a rank's rows into micro-batches by token count (the DP split itself is
  ``rlcore.single_controller.balance``).
"""

from rlcore.algos.advantages import get_advantage_estimator, register_advantage_estimator
from rlcore.algos.importance import compute_is_weights
from rlcore.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller, kl_penalty
from rlcore.algos.losses import (
    LOSS_AGG_MODES,
    LossScale,
    PolicyLossConfig,
    PolicyLossInput,
    agg_loss,
    compute_value_loss,
    get_policy_loss,
    register_policy_loss,
)
from rlcore.algos.preference import best_worst_pairs, bradley_terry_loss, compute_dpo_loss
from rlcore.algos.stats import entropy_from_logits, logprobs_from_logits, masked_mean, masked_sum, masked_whiten

__all__ = [
    "LOSS_AGG_MODES", "AdaptiveKLController", "FixedKLController", "LossScale", "PolicyLossConfig",
    "PolicyLossInput", "agg_loss", "apply_kl_penalty", "best_worst_pairs", "bradley_terry_loss", "compute_dpo_loss",
    "compute_is_weights", "compute_value_loss", "entropy_from_logits", "get_advantage_estimator",
    "get_kl_controller", "get_policy_loss", "kl_penalty", "logprobs_from_logits", "masked_mean", "masked_sum",
    "masked_whiten", "register_advantage_estimator", "register_policy_loss",
]
