"""DAPO's steps on a batch (``recipes/dapo.py``): the tensor math of ``rlcore.algos.dapo`` applied
to the rollout layout.

``GroupCollector`` is dynamic sampling's bookkeeping. The recipe draws a batch of prompts, samples
and scores their groups, and hands each such round to ``add``, which keeps the groups with a
learning signal (``group_has_signal``) and sets the others aside; it draws again until
``data.train_batch_size`` groups are kept or ``algorithm.filter_groups.max_num_gen_batches`` rounds
are spent. ``batch`` then returns exactly ``data.train_batch_size`` groups: the first ones kept, in
the order drawn (DAPO's rule; the surplus of the last round is discarded).

When the round cap is reached first, the batch is topped up with dropped groups rather than the
step failing (DAPO's reference raises) or training on fewer rows. Why: a step of fixed size keeps
every batch-size check valid (ranks, ``ppo_mini_batch_size``), and a dropped group's advantages are
all 0, so it adds no gradient: the step is then what plain GRPO would have done with those rows. A
policy that solves (or fails) nearly every prompt would otherwise stop a long run. The metrics say
how often it happens (``dynamic_sampling/topped_up_groups``).

Each round's ``uid`` values (row numbers of its prompt batch) are prefixed with the round number,
so groups of different rounds never merge in the advantage. Rounds are aligned to the widest
prompt and response before they are concatenated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig

from rlcore.algos.dapo import group_has_signal, overlong_penalty, truncated_rows
from rlcore.engines.layout import pad_rollout, widths
from rlcore.protocol import DataProto
from rlcore.typed_config import ConfigError


def _groups(uid: np.ndarray) -> np.ndarray:
    """The distinct uids in order of first appearance."""
    _, first = np.unique(uid, return_index=True)
    return uid[np.sort(first)]


class GroupCollector:
    """One step's prompt groups over generation rounds (module docstring)."""

    def __init__(self, num_groups: int, pad_token_id: int) -> None:
        self.num_groups, self.pad_token_id = num_groups, pad_token_id
        self.kept: list[DataProto] = []
        self.dropped: list[DataProto] = []
        self.rounds = self.drawn_groups = self.kept_groups = 0

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.num_groups

    def add(self, batch: DataProto, values: torch.Tensor | None) -> None:
        """One round's scored groups; ``values`` (B,) is what the filter compares within a group,
        None keeps every group (dynamic sampling off)."""
        self.rounds += 1
        uid = np.array([f"{self.rounds}/{u}" for u in batch.non_tensor_batch["uid"]], dtype=object)
        batch.non_tensor_batch["uid"] = uid
        self.drawn_groups += len(_groups(uid))
        keep = np.ones(len(batch), dtype=bool) if values is None else group_has_signal(values, uid).cpu().numpy()
        if keep.any():
            self.kept.append(batch[keep])
            self.kept_groups += len(_groups(uid[keep]))
        if not keep.all():
            self.dropped.append(batch[~keep])

    def batch(self) -> tuple[DataProto, dict[str, float]]:
        """Exactly ``num_groups`` groups (kept ones first, in the order drawn, then dropped ones if the
        round cap left too few), and the dynamic-sampling metrics of the step."""
        parts = self.kept + self.dropped
        if not parts:
            raise RuntimeError("GroupCollector.batch() before any round was added")
        t_p = max(widths(p)[0] for p in parts)
        t_r = max(widths(p)[1] for p in parts)
        merged = DataProto.concat([pad_rollout(p, t_p, t_r, self.pad_token_id) for p in parts],
                                  meta_conflicts="first")  # each round's generation timings: the first round's
        uid = merged.non_tensor_batch["uid"]
        chosen = _groups(uid)[: self.num_groups]
        if len(chosen) < self.num_groups:
            raise RuntimeError(f"{len(chosen)} groups were drawn, fewer than the {self.num_groups} a step needs")
        out = merged[np.isin(uid, chosen)]
        dropped = self.drawn_groups - self.kept_groups
        return out, {
            "dynamic_sampling/gen_rounds": float(self.rounds),
            "dynamic_sampling/prompts_drawn": float(self.drawn_groups),
            "dynamic_sampling/groups_kept_frac": self.kept_groups / self.drawn_groups,
            "dynamic_sampling/groups_dropped_frac": dropped / self.drawn_groups,
            "dynamic_sampling/topped_up_groups": float(max(0, self.num_groups - self.kept_groups)),
            "dynamic_sampling/surplus_groups": float(max(0, self.kept_groups - self.num_groups)),
        }


def filter_values(batch: DataProto, metric: str) -> torch.Tensor:
    """What ``algorithm.filter_groups.metric`` compares within a group: ``score``, the rule reward
    (``reward_scores``: accuracy, as DAPO filters), or ``reward``, the sequence's score after the
    overlong penalty (``token_level_scores`` summed)."""
    if metric == "score":
        return batch.batch["reward_scores"]
    if metric == "reward":
        return batch.batch["token_level_scores"].sum(-1)
    raise ValueError(f"unknown filter metric {metric!r}; known: 'score', 'reward'")


def add_overlong_penalty(batch: DataProto, max_len: int, buffer_len: int, penalty_factor: float) -> None:
    """Add the soft overlong punishment to ``token_level_scores`` on each response's last token
    (where the rule score sits), and keep it as the ``overlong_penalty`` (B,) column."""
    mask = batch.batch["response_mask"]
    lengths = mask.sum(-1).long()
    penalty = overlong_penalty(lengths, max_len, buffer_len, penalty_factor)
    scores = batch.batch["token_level_scores"].clone()
    rows = (lengths > 0).nonzero().squeeze(1)
    scores[rows, lengths[rows] - 1] += penalty[rows].to(scores.dtype)
    batch.batch["token_level_scores"] = scores
    batch.batch["overlong_penalty"] = penalty


def mask_truncated(batch: DataProto, max_len: int, stop_ids: Sequence[int]) -> torch.Tensor:
    """Overlong filtering: zero ``response_mask`` of the responses cut at ``max_len`` (the loss and
    its token counts skip them; ``attention_mask`` is untouched, so the forward pass is the same).
    Returns the (B,) bool mask of those rows. A batch with every response cut has no token left to
    learn from (the recipe then skips the update); so does a mini-batch of only cut responses, which
    the actor refuses (``ppo_mini_batch_size`` small against a cut fraction near 1)."""
    b = batch.batch
    cut = truncated_rows(b["responses"], b["response_mask"], max_len, stop_ids)
    b["response_mask"] = b["response_mask"] * (~cut).unsqueeze(1).to(b["response_mask"].dtype)
    return cut


def stop_token_ids(cfg: DictConfig, tokenizer) -> list[int]:
    """The ids that end a response as the rollout engines stop (``rlcore.engines.base``): the
    tokenizer's eos and the model's generation-config eos ids (none with ``rollout.ignore_eos``),
    plus ``rollout.stop_token_ids``."""
    ids = set(int(t) for t in cfg.rollout.stop_token_ids)
    if not cfg.rollout.ignore_eos:
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        gen_config = Path(cfg.model.path) / "generation_config.json"
        if gen_config.exists():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids.update(int(t) for t in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return sorted(ids)


def check_dapo_config(cfg: DictConfig) -> None:
    """Settings DAPO's pieces cannot run with, refused before anything is built."""
    algo = cfg.algorithm
    if algo.filter_groups.enable and cfg.rollout.n < 2:
        raise ConfigError(f"algorithm.filter_groups.enable needs rollout.n >= 2 (got {cfg.rollout.n}): a group of "
                          "one response never has two different scores, so every group would be dropped")
    if algo.overlong_buffer.enable and algo.overlong_buffer.len > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong_buffer.len={algo.overlong_buffer.len} exceeds rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}: the penalty ramps over the last len tokens before the limit")
