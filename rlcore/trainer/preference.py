"""Online preference optimisation pieces: pairs from scored samples, and DPO as a policy loss.

Online DPO samples n responses per prompt from the current policy, scores them, and trains on
(best, worst) pairs against the frozen reference. The pairs travel as adjacent rows (chosen at
2i, rejected at 2i+1), so the ``dpo`` loss below, registered like any policy loss, can run inside the
actor's ordinary update loop: the recipe sets ``actor.policy_loss=dpo``, ``actor.shuffle=false``
and an even micro-batch size so a pair is never split.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcore.protocol import DataProto
from rlcore.trainer.core_algos import compute_dpo_loss, register_policy_loss


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


@register_policy_loss("dpo")
def dpo_policy_loss(log_prob, old_log_prob, advantages, response_mask, *, data: DataProto,
                    global_seqs=None, dp_size: int = 1, **_unused):
    """DPO/IPO on adjacent (chosen, rejected) rows; ``data.meta_info`` may set ``dpo_beta`` (0.1),
    ``dpo_loss_type`` ("sigmoid" | "ipo") and ``dpo_label_smoothing`` (0.0).

    DP-invariant like the other losses: with ``global_seqs`` rows in the whole mini-batch this
    micro-batch contributes sum(pair losses) / (global_seqs / 2) * dp_size.
    """
    if len(data) % 2:
        raise ValueError(f"the dpo loss needs whole (chosen, rejected) pairs, got a micro-batch of {len(data)} rows; "
                         "use an even micro-batch size and actor.shuffle=false")
    uid = data.non_tensor_batch.get("uid")
    if uid is not None and not np.array_equal(uid[0::2], uid[1::2]):
        raise ValueError("the dpo loss got rows of different prompts paired together: "
                         "set actor.shuffle=false and keep pairs adjacent (best_worst_pairs)")
    mask = response_mask.float()
    seq_logp = (log_prob * mask).sum(-1)
    ref_logp = (data.batch["ref_log_prob"].to(seq_logp.device) * mask).sum(-1)
    meta = data.meta_info
    loss, metrics = compute_dpo_loss(
        seq_logp[0::2], seq_logp[1::2], ref_logp[0::2], ref_logp[1::2],
        beta=meta.get("dpo_beta", 0.1), loss_type=meta.get("dpo_loss_type", "sigmoid"),
        label_smoothing=meta.get("dpo_label_smoothing", 0.0),
    )
    if global_seqs is not None:
        loss = loss * (len(data) // 2) / (float(global_seqs) / 2) * dp_size
    return loss, metrics
