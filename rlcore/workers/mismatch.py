"""The actor's half of the consistency check: the trainer-vs-sampler log-prob mismatch of each update.

Cheap by construction: no forward pass of its own. The trainer's log-probs of the sampled tokens
under the policy that was meant to sample them are either ``old_log_probs`` (computed by
``compute_log_prob`` when the update takes several optimizer steps) or, for a single-step update,
the update's own first forward (taken before any optimizer step). ``MismatchCollector`` gathers
``rlcore.algos.consistency.mismatch_sums`` from whichever is there, combines micro-batches and
ranks exactly (sums; one max) and returns ``check/*`` metrics that are the same on every rank.

``CheckConfig`` (``trainer.check``) is read here for the ratio band, and by the trainer
(``rlcore.trainer.consistency``) for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlcore.algos.consistency import merge_mismatch_sums, mismatch_metrics, mismatch_sums
from rlcore.protocol import DataProto
from rlcore.typed_config import to_section

STAND_IN = "stand_in"  # meta_info flag of a micro-batch run only for its collectives (FSDPTrainWorker)


@dataclass(frozen=True)
class CheckConfig:
    """``trainer.check``: is the trainer scoring what the sampler sampled, with the sampler's weights?"""

    enable: bool = True  # log check/* every step, compare weights every weight_checksum_freq steps
    ratio_band: list[float] = field(default_factory=lambda: [0.9, 1.1])  # a token's exp(trainer - sampler) outside is out of band
    # null for the next two: the band of the run's dtype pair (rlcore.trainer.check_bands: 1% and 1e-4 nats for
    # fp32 on both sides, wider where either side computes in bf16), calibrated from the first steps
    max_out_of_band: float | None = None  # share of current-version tokens that may leave ratio_band before the run warns
    max_abs_diff_mean: float | None = None  # their mean |trainer - sampler| log-prob allowed (nats) before the run warns
    calibrate: bool = True  # narrow the pair's band to the noise measured while the weights compare equal
    weight_checksum_freq: int = 10  # compare engine and trainer weights every N steps (and at step 1); 0: never
    probe: bool = True  # with each weight comparison, engine and trainer score a fixed sequence (rlcore.trainer.probe_check)
    strict: bool = False  # true: a measure out of its band stops the run (ConsistencyError) instead of warning once

    def __post_init__(self) -> None:
        if len(self.ratio_band) != 2 or not 0 < self.ratio_band[0] < 1 < self.ratio_band[1]:
            raise ValueError(f"trainer.check.ratio_band must be [low, high] with 0 < low < 1 < high, got "
                             f"{list(self.ratio_band)}")
        if not 0 <= (self.max_out_of_band or 0) <= 1 or (self.max_abs_diff_mean or 0) < 0:
            raise ValueError(f"trainer.check.max_out_of_band must be in [0, 1] and max_abs_diff_mean >= 0, got "
                             f"{self.max_out_of_band}, {self.max_abs_diff_mean}")
        if self.weight_checksum_freq < 0:
            raise ValueError(f"trainer.check.weight_checksum_freq must be >= 0 (0: never), got "
                             f"{self.weight_checksum_freq}")


def read_check_config(config: Mapping | Any) -> CheckConfig:
    """``trainer.check`` of a whole run config (defaults where absent)."""
    trainer = (config or {}).get("trainer") or {}
    return to_section(CheckConfig, trainer.get("check") or {}, "trainer.check")


class MismatchCollector:
    """One update's mismatch statistics. ``keys(data)``: the batch keys it reads (to add to the
    update's selection); ``start(data)`` before the update; ``add(log_prob, micro)`` from the loss
    of each micro-batch while ``collecting``; ``finish(device)`` the metrics."""

    def __init__(self, cfg: CheckConfig) -> None:
        self.cfg = cfg
        self.parts: list[dict[str, torch.Tensor]] = []
        self.active = self.collecting = self.with_lags = False

    def wanted(self, data: DataProto) -> bool:
        return self.cfg.enable and "rollout_log_probs" in data.batch.keys()

    def keys(self, data: DataProto) -> list[str]:
        if not self.wanted(data):
            return []
        return ["rollout_log_probs"] + (["token_versions"] if "token_versions" in data.batch.keys() else [])

    def start(self, data: DataProto) -> None:
        """From ``old_log_probs`` when the batch has them (and the rows' masks before the update
        touches them); else the update's first forward will add them (``collecting``)."""
        self.parts = []
        self.collecting = False
        self.active = self.wanted(data)
        if not self.active:
            return
        self.with_lags = "token_versions" in data.batch.keys() and data.meta_info.get("policy_version") is not None
        if "old_log_probs" in data.batch.keys():
            self.parts.append(self.sums(data.batch["old_log_probs"], data))
        else:
            self.collecting = True

    def add(self, log_prob: torch.Tensor, micro: DataProto) -> None:
        if self.collecting and not micro.meta_info.get(STAND_IN, False):
            self.parts.append(self.sums(log_prob.detach(), micro))

    def drop(self) -> None:
        """Forget an update given up midway (``rlcore.workers.update_stop``): no statistics of it are kept."""
        self.parts = []
        self.active = self.collecting = False

    def sums(self, trainer_log_probs: torch.Tensor, data: DataProto) -> dict[str, torch.Tensor]:
        b = data.batch
        lags = None
        version = data.meta_info.get("policy_version")
        if version is not None and "token_versions" in b.keys():
            lags = int(version) - b["token_versions"].to(trainer_log_probs.device)
        return mismatch_sums(trainer_log_probs, b["rollout_log_probs"].to(trainer_log_probs.device),
                             b["response_mask"].to(trainer_log_probs.device), tuple(self.cfg.ratio_band), lags)

    def finish(self, device: torch.device | None = None) -> dict[str, float]:
        """The ``check/*`` metrics over every rank's tokens (a collective when ranks > 1: every rank
        calls it, with or without tokens of its own)."""
        self.collecting = False
        if not self.active:
            return {}
        self.active = False
        if not self.parts:  # this rank trained no row (stand-ins only): zeros, for the other ranks' collective
            empty = torch.zeros((0, 1))
            self.parts.append(mismatch_sums(empty, empty, empty, tuple(self.cfg.ratio_band),
                                            empty.long() if self.with_lags else None))
        sums = merge_mismatch_sums(self.parts)
        self.parts = []
        if dist.is_initialized() and dist.get_world_size() > 1:
            keys = sorted(k for k in sums if k != "abs_max")
            packed = torch.stack([sums[k] for k in keys]).to(device)
            dist.all_reduce(packed)
            most = sums["abs_max"].to(device).clone()
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            sums = {**dict(zip(keys, packed.cpu())), "abs_max": most.cpu()}
        return mismatch_metrics(sums)
