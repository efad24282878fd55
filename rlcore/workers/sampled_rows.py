"""The trainer's log-probs of the rows the run's trajectory sample shows, from a single-step update.

Why: the inspector's per-token trainer/sampler view needs the trainer's log-prob of each sampled
token. With several optimizer steps per batch the batch has ``old_log_probs`` (a forward pass of
its own) and the sample takes them from there. A single-step update (every recipe's default)
skips that pass: its own first forward, before the optimizer moves, is the trainer's scoring. That
forward is where these come from, for a few rows only: ``trainer.trajectory_groups`` groups of this
rank's rows (``pick_groups``), copied to the CPU as the micro-batches go by, and handed to the
driver once (``take``) for the step's sample. The rest of the batch's log-probs are never kept.

A row is named by its ``uid`` and its response's token ids, which the driver matches against its
own batch (``rlcore.trainer.trajectories``): the balanced dispatch reorders rows, and a rank does
not know their places in the driver's batch. A row the update never ran (``skip_zero_advantage_rows``:
a group whose advantages are all zero) has no entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlcore.protocol import DataProto
from rlcore.workers.mismatch import STAND_IN

ROW_KEY = "sample_row"  # per-row int in the update's own selection: index into the kept rows, -1 elsewhere


def pick_groups(uids: Sequence[Any], n: int) -> list[list[int]]:
    """Row indices of ``n`` groups (rows sharing a uid), evenly spread over the batch's groups in
    order of first appearance: the first and the last group always, so a sample is not all from
    one end of a sorted batch."""
    groups: dict[Any, list[int]] = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    ordered = list(groups.values())
    if n >= len(ordered):
        return ordered
    picks = np.unique(np.linspace(0, len(ordered) - 1, n).round().astype(int))
    return [ordered[i] for i in picks]


class SampledRows:
    """``start(data)`` before a single-step update marks the rows to keep (adds ``ROW_KEY``);
    ``add(log_prob, micro)`` from the update's forward keeps theirs; ``stop()`` after the first pass;
    ``take()``: the kept rows as ``[{"uid", "ids", "log_probs"}]``, then forgotten."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.active = False
        self.rows: list[dict[str, Any]] = []

    def start(self, data: DataProto) -> None:
        b, uids = data.batch, data.non_tensor_batch.get("uid")
        self.rows = []
        self.active = (self.groups > 0 and uids is not None and "old_log_probs" not in b.keys()
                       and "responses" in b.keys() and "rollout_log_probs" in b.keys())
        if not self.active:
            return
        picked = [i for group in pick_groups(list(uids), self.groups) for i in group]
        width = b["responses"].shape[1]
        lengths = b["attention_mask"][:, -width:].sum(-1)
        index = torch.full((len(data),), -1, dtype=torch.long)
        for k, i in enumerate(picked):
            index[i] = k
            n = int(lengths[i])
            self.rows.append({"uid": str(uids[i]), "ids": b["responses"][i, :n].tolist(), "log_probs": None})
        b[ROW_KEY] = index

    def add(self, log_prob: torch.Tensor, micro: DataProto) -> None:
        if not self.active or micro.meta_info.get(STAND_IN, False) or ROW_KEY not in micro.batch.keys():
            return
        index = micro.batch[ROW_KEY]
        for r in torch.nonzero(index >= 0).flatten().tolist():
            row = self.rows[int(index[r])]
            row["log_probs"] = log_prob[r, :len(row["ids"])].detach().float().cpu().tolist()

    def stop(self) -> None:
        self.active = False

    def drop(self) -> None:
        """Forget an update given up midway: the next ``take`` hands over nothing of it."""
        self.rows, self.active = [], False

    def take(self) -> list[dict[str, Any]]:
        rows, self.rows = [r for r in self.rows if r["log_probs"] is not None], []
        self.active = False
        return rows
