"""Learned rewards in the recipes: the pairs a reward model trains on, its held-out pair metrics,
and the training reward of an RL run that scores with one.

Training reward. With ``reward.model.path`` set, an RL recipe adds the role "rm" (``reward_roles``:
the frozen ``RewardModelWorker`` of that directory, colocated and sharded like the other roles) and
scores each training response with ``training_reward``'s function:

    reward.model.combine = "rm"    score = weight * r_model              (the default: the learned reward alone)
    reward.model.combine = "sum"   score = r_rule + weight * r_model      (the rule kept as an anchor)

placed on the last response token, as the rule's score is. The rule still scores every response,
so its mean is logged beside the model's (``reward/rule/mean``, ``reward/rm/mean``; ``reward/mean``
is the combined score), and validation scores with the rule alone: a run with a reward model is
judged by the same number as one without.

Pair data (``build_pair_data``). ``data.train_files`` / ``data.val_files`` name pair files
(``rlcore.data.preference``); with both null, pairs are built from the arithmetic task's prompt
files (``data.arithmetic``: for training, each problem paired with every wrong answer of every kind,
``pairs_train_dense.jsonl``; held out, with one of each kind, ``pairs_val.jsonl``) and written next
to them once, so the reward model trains on the RL recipes' own training prompts and is measured
on their held-out ones.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from rlcore.algos.preference import bradley_terry_loss
from rlcore.data.dataset import PromptLoader, read_records
from rlcore.data.preference import PairDataset, collate_pairs, make_arithmetic_pairs, write_pairs_jsonl
from rlcore.protocol import DataProto
from rlcore.rewards.manager import LearnedRewardConfig, RuleRewardManager, reward_metrics
from rlcore.single_controller import WorkerGroup
from rlcore.trainer.builder import Workers, data_files


# ----------------------------------------------------------------------------- RL recipes
def reward_roles(cfg: DictConfig) -> list[str]:
    """["rm"] when the run scores with a reward model (``reward.model.path``), else []."""
    return ["rm"] if cfg.reward.model.path else []


class LearnedReward:
    """The rule manager's contract (a DataProto in, scores out) for a run with a reward model: the
    combined score of the module docstring, plus ``rm_scores`` and ``rule_scores`` (B,) per row."""

    def __init__(self, rule: RuleRewardManager, rm: WorkerGroup, cfg: LearnedRewardConfig) -> None:
        self.rule, self.rm, self.cfg = rule, rm, cfg

    def __call__(self, data: DataProto) -> DataProto:
        rule = self.rule(data)
        rm_scores = self.rm.compute_rm_score(data).batch["rm_scores"].float().cpu()
        rule_scores = rule.batch["reward_scores"].cpu()
        scores = self.cfg.weight * rm_scores + (rule_scores if self.cfg.combine == "sum" else 0.0)
        mask = data.batch["response_mask"].bool().cpu()
        last = torch.where(mask, torch.arange(mask.shape[1]).expand_as(mask), -1).amax(dim=1)
        rows = torch.nonzero(last >= 0).squeeze(1)
        token_level_scores = torch.zeros(mask.shape, dtype=torch.float32)
        token_level_scores[rows, last[rows]] = scores[rows]  # an empty response gets its score nowhere, as the rule's
        out = DataProto.from_dict({"token_level_scores": token_level_scores, "reward_scores": scores,
                                   "rm_scores": rm_scores, "rule_scores": rule_scores}, dict(rule.non_tensor_batch))
        out.meta_info.update(reward_metrics(scores, data.non_tensor_batch.get("data_source")))
        out.meta_info.update({k.replace("reward/", "reward/rule/", 1): v for k, v in rule.meta_info.items()})
        # Correct is the rule's verdict (its full score): a reward model's score has no full score.
        out.meta_info["reward/frac_correct"] = rule.meta_info["reward/frac_correct"]
        out.meta_info.update({"reward/rm/mean": rm_scores.mean().item(),
                              "reward/rm/std": rm_scores.std(unbiased=False).item()})
        return out


def training_reward(cfg: DictConfig, rule: RuleRewardManager, workers: Workers) -> Any:
    """What scores a run's training responses: ``rule`` itself, or with ``reward.model.path`` the
    reward model of ``workers.rm`` combined as ``reward.model`` says."""
    if not cfg.reward.model.path:
        return rule
    if workers.rm is None:
        raise ValueError("reward.model.path is set but the workers have no 'rm' role: build them with "
                         "reward_roles(cfg) among the roles")
    return LearnedReward(rule, workers.rm, LearnedRewardConfig(**cfg.reward.model))


# ----------------------------------------------------------------------------- reward-model training
def pair_files(cfg: DictConfig) -> tuple[Any, Any]:
    """(train, val) pair files: the given ones, or pairs of the arithmetic task, written once."""
    if cfg.data.train_files is not None or cfg.data.val_files is not None:
        return data_files(cfg)  # both required
    out = []
    for split, prompts in zip(("train", "val"), data_files(cfg)):
        dense = split == "train"
        target = Path(prompts).with_name(f"pairs_{split}{'_dense' if dense else ''}.jsonl")
        if not target.exists():
            rows, _ = read_records(prompts)
            seed = cfg.data.arithmetic.seed + (split == "val")
            pairs = make_arithmetic_pairs(rows, seed, dense=dense)
            partial = write_pairs_jsonl(target.with_suffix(f".{os.getpid()}.tmp"), pairs)
            os.replace(partial, target)  # whole or absent, if two runs write it at once
        out.append(str(target))
    return out[0], out[1]


def build_pair_data(cfg: DictConfig, tokenizer: Any) -> tuple[PromptLoader, list[DataProto]]:
    """The resumable loader of training pairs (``data.train_batch_size`` pairs a step) and the
    held-out pairs as DataProto batches (``data.val_batch_size`` each; null: one batch)."""
    train_files, val_files = pair_files(cfg)
    d = cfg.data

    def dataset(files: Any) -> PairDataset:
        return PairDataset(files, tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                           apply_chat_template=d.apply_chat_template)

    loader = PromptLoader(dataset(train_files), d.train_batch_size, shuffle=d.shuffle, seed=d.seed, collate=collate_pairs)
    val = dataset(val_files)
    size = d.val_batch_size or len(val)
    batches = [DataProto.from_dict(*collate_pairs([val[i] for i in range(start, min(start + size, len(val)))],
                                                  loader.pad_token_id))
               for start in range(0, len(val), size)]
    return loader, batches


def pair_metrics(rm: WorkerGroup, batches: Sequence[DataProto], prefix: str = "val") -> dict[str, float]:
    """The reward model on pair batches: ``<prefix>/pair_accuracy`` (chosen scored strictly above
    rejected), ``<prefix>/pair_loss`` (Bradley-Terry), ``<prefix>/margin``, and the accuracy per
    ``kind`` of pair (``<prefix>/pair_accuracy/<kind>``) when the pairs name one."""
    score = rm.compute_pair_scores.options(pad=True)  # a batch need not divide the group's DP width
    outs = [score(b) for b in batches]
    chosen = torch.cat([o.batch["chosen_scores"] for o in outs])
    rejected = torch.cat([o.batch["rejected_scores"] for o in outs])
    loss, m = bradley_terry_loss(chosen, rejected)
    metrics = {f"{prefix}/pair_accuracy": m["accuracy"], f"{prefix}/pair_loss": loss.item(),
               f"{prefix}/margin": m["margin"]}
    kinds = np.concatenate([b.non_tensor_batch["kind"] for b in batches]) if all(
        "kind" in b.non_tensor_batch for b in batches) else np.array([], dtype=object)
    for kind in dict.fromkeys(kinds.tolist()):
        if kind:
            rows = torch.from_numpy(kinds == kind)
            metrics[f"{prefix}/pair_accuracy/{kind}"] = (chosen[rows] > rejected[rows]).float().mean().item()
    return metrics
