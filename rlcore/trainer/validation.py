"""What a run measures about its data: greedy validation, and statistics of a training batch.

``validate`` decodes every validation prompt greedily (one sample each) with the current rollout
weights and scores the responses: its ``val/reward_mean`` is the number a recipe is judged by.
``batch_metrics`` summarises a trained batch (rewards, advantages, values, lengths) for the log.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlcore.algos.stats import masked_mean
from rlcore.protocol import DataProto
from rlcore.single_controller import WorkerGroup


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.double()
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def validate(rollout: WorkerGroup | Callable[[DataProto], DataProto], batches: Sequence[DataProto],
             reward_fn: Callable[[DataProto], DataProto]) -> dict[str, float]:
    """Greedy responses to every validation prompt, scored: ``val/reward_mean`` (the fraction
    correct for 0/1 rewards), ``val/reward_std`` and response-length statistics. ``rollout`` is a
    rollout worker group, or any function from prompts to the rollout layout (engine servers)."""
    # A group's batch may not divide its DP width: pad (and drop the padding) on the way.
    generate = rollout.generate_sequences.options(pad=True) if isinstance(rollout, WorkerGroup) else rollout
    outputs = []
    for prompts in batches:
        out = generate(prompts)
        out.union(reward_fn(out))
        outputs.append(out)
    out = DataProto.concat(outputs, meta_conflicts="first")  # each batch's own reward metrics: recomputed below
    scores = out.batch["reward_scores"].double()
    lengths = out.batch["response_mask"].sum(-1)
    return {
        "val/reward_mean": scores.mean().item(),
        "val/reward_std": scores.std(unbiased=False).item(),
        "val/response_length_mean": lengths.double().mean().item(),
        "val/response_length_max": lengths.max().item(),
    }


def batch_metrics(batch: DataProto) -> dict[str, float]:
    """Statistics of a batch after its update: sequence scores and rewards (sums over tokens),
    advantages, returns and values over valid tokens, response and prompt lengths, and the fraction
    of responses cut at the length limit (``response_length/clip_ratio``), the rollout's and the
    reward's own metrics from ``meta_info``, and the mean log-ratio of policy to reference."""
    b = batch.batch
    mask = b["response_mask"].bool()
    out: dict[str, float] = {}
    if "token_level_scores" in b.keys():
        scores = b["token_level_scores"].sum(-1)
        out.update(_stats("reward/score", scores))
        out["reward/score/std"] = scores.double().std(unbiased=False).item()
    if "token_level_rewards" in b.keys():
        out.update(_stats("reward/rewards", b["token_level_rewards"].sum(-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if key in b.keys():
            valid = b[key][mask]
            out.update(_stats(name, valid if valid.numel() else torch.zeros(1)))
    lengths = mask.sum(-1)
    out.update(_stats("response_length", lengths))
    out["response_length/clip_ratio"] = (lengths == mask.shape[1]).double().mean().item()
    prompt_width = b["prompts"].shape[1]
    out.update(_stats("prompt_length", b["attention_mask"][:, :prompt_width].sum(-1)))
    out.update({k: float(v) for k, v in batch.meta_info.items() if k.startswith(("rollout/", "reward/"))})
    if "ref_log_prob" in b.keys() and "old_log_probs" in b.keys():
        kl = b["old_log_probs"] - b["ref_log_prob"]
        out["actor/kl_old_ref"] = masked_mean(kl, b["response_mask"]).item()
    return out


def mean_over_ranks(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One dict from the per-rank metric dicts of a DP_COMPUTE_METRIC call (each rank saw equal rows).
    A key only some ranks report (a rank that trained no row of a mini-batch has no loss terms of
    it: ``FSDPTrainWorker.trained_micro_batches``) is the mean over those that do."""
    means = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):  # every key, in first-seen order
        values = [m[key] for m in per_rank if key in m]
        means[key] = sum(values) / len(values)
    return means
