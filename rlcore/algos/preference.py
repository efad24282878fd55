"""Preference learning pieces: pairs from scored samples, DPO as a policy loss, and the
Bradley-Terry loss of a reward model.

Online DPO samples n responses per prompt from the current policy, scores them, and trains on
(best, worst) pairs against the frozen reference. The pairs travel as adjacent rows (chosen at
2i, rejected at 2i+1), so the ``dpo`` loss below, registered like any policy loss, can run inside the
actor's ordinary update loop: the recipe sets ``actor.policy_loss=dpo``, ``actor.shuffle=false``
and an even micro-batch size so a pair is never split.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rlcore.algos.losses import LOCAL, LossScale, PolicyLossConfig, PolicyLossInput, register_policy_loss
from rlcore.algos.stats import check_same_shape
from rlcore.protocol import DataProto

Tensor = torch.Tensor


def best_worst_pairs(data: DataProto, scores: torch.Tensor, uid_key: str = "uid", min_margin: float = 0.0) -> DataProto:
    """Rows ordered chosen_0, rejected_0, chosen_1, ...: per prompt (same ``uid``) the highest- and
    lowest-scored sample. Prompts whose best and worst differ by ``min_margin`` or less carry no
    preference and are skipped (the result may be empty). Ties keep the earliest sample."""
    if uid_key not in data.non_tensor_batch:
        raise KeyError(f"best_worst_pairs needs non_tensor_batch[{uid_key!r}] to group samples by prompt")
    scores = scores.detach().float().cpu()
    if scores.shape != (len(data),):
        raise ValueError(f"scores must have shape ({len(data)},), got {tuple(scores.shape)}")
    uids = data.non_tensor_batch[uid_key]
    order: list[int] = []
    for uid in dict.fromkeys(uids.tolist()):
        rows = np.flatnonzero(uids == uid)
        group = scores[rows]
        best, worst = rows[int(torch.argmax(group))], rows[int(torch.argmin(group))]
        if float(scores[best] - scores[worst]) > min_margin:
            order += [int(best), int(worst)]
    return data[np.asarray(order, dtype=np.int64)]


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
        check_same_shape("policy_chosen_logps", policy_chosen_logps, name, t)
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


@register_policy_loss("dpo")
def dpo_policy_loss(inp: PolicyLossInput, cfg: PolicyLossConfig) -> tuple[Tensor, dict[str, float]]:
    """DPO/IPO on adjacent (chosen, rejected) rows of ``inp.data``; its ``meta_info`` may set
    ``dpo_beta`` (0.1), ``dpo_loss_type`` ("sigmoid" | "ipo") and ``dpo_label_smoothing`` (0.0).

    DP-invariant like the other losses: with ``scale.global_seqs`` rows in the whole mini-batch
    this micro-batch contributes sum(pair losses) / (global_seqs / 2) * dp_size.
    """
    data = inp.data
    if data is None:
        raise ValueError("the dpo loss reads ref_log_prob from the micro-batch: PolicyLossInput.data is None")
    if len(data) % 2:
        raise ValueError(f"the dpo loss needs whole (chosen, rejected) pairs, got a micro-batch of {len(data)} rows; "
                         "use an even micro-batch size and actor.shuffle=false")
    uid = data.non_tensor_batch.get("uid")
    if uid is not None and not np.array_equal(uid[0::2], uid[1::2]):
        raise ValueError("the dpo loss got rows of different prompts paired together: "
                         "set actor.shuffle=false and keep pairs adjacent (best_worst_pairs)")
    mask = inp.response_mask.float()
    seq_logp = (inp.log_prob * mask).sum(-1)
    ref_logp = (data.batch["ref_log_prob"].to(seq_logp.device) * mask).sum(-1)
    meta = data.meta_info
    loss, metrics = compute_dpo_loss(
        seq_logp[0::2], seq_logp[1::2], ref_logp[0::2], ref_logp[1::2],
        beta=meta.get("dpo_beta", 0.1), loss_type=meta.get("dpo_loss_type", "sigmoid"),
        label_smoothing=meta.get("dpo_label_smoothing", 0.0),
    )
    if inp.scale.global_seqs is not None:
        loss = loss * (len(data) // 2) / (float(inp.scale.global_seqs) / 2) * inp.scale.dp_size
    return loss, metrics


dpo_policy_loss.batch_keys = ("ref_log_prob",)  # the actor keeps these batch keys for the loss


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, scale: LossScale = LOCAL) -> tuple[Tensor, dict[str, float]]:
    """Reward-model loss on the scalar scores of (chosen, rejected) pairs, shape (P,) each:
    mean over pairs of -log sigmoid(r_chosen - r_rejected), i.e. the negative log-likelihood of the
    preferences under Bradley-Terry, P(chosen > rejected) = sigmoid(r_chosen - r_rejected).

    DP-invariant like ``agg_loss``: ``scale.global_seqs`` counts the *sequences* of the whole
    mini-batch (two per pair, as a reward model's update sees them), and the result is then this
    micro-batch's contribution sum(pair losses) / (global_seqs / 2) * dp_size. Metrics are over
    these pairs: ``accuracy`` (chosen strictly above rejected: a tie is no preference learnt),
    ``margin`` (mean r_chosen - r_rejected) and the mean score of each side.
    """
    check_same_shape("chosen", chosen, "rejected", rejected)
    if chosen.ndim != 1 or not len(chosen):
        raise ValueError(f"the Bradley-Terry loss expects non-empty scores of shape (P,), got {tuple(chosen.shape)}")
    margin = chosen.float() - rejected.float()
    total = -F.logsigmoid(margin).sum()
    if scale.global_seqs is None:
        loss = total / len(margin)
    else:
        if scale.global_seqs <= 0:
            raise ValueError(f"global_seqs must be > 0, got {scale.global_seqs}")
        loss = total / (scale.global_seqs / 2) * scale.dp_size
    with torch.no_grad():
        metrics = {
            "accuracy": float((margin > 0).float().mean()),
            "margin": float(margin.mean()),
            "chosen_score": float(chosen.float().mean()),
            "rejected_score": float(rejected.float().mean()),
        }
    return loss, metrics
