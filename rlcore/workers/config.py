"""The sections the training workers own: ``actor`` (also the reference's) and ``critic``.

Both share the optimisation and batching keys (``TrainConfig``); the actor's section is also the
settings object its policy loss reads (it extends ``PolicyLossConfig``), so every ``actor.*`` key
reaches a registered loss without a parameter list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlcore.algos.importance import IS_LEVELS
from rlcore.algos.kl import KL_KINDS
from rlcore.algos.losses import LOSS_AGG_MODES, PolicyLossConfig

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULERS = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and batching of a trained role."""

    optimizer: str = "adamw"  # "adamw" or "sgd" (plain SGD: handy for exact tests)
    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.01  # decoupled (AdamW) or L2 (SGD) weight decay
    warmup_steps: int = 0  # optimizer steps of linear warm-up from lr / warmup_steps to lr
    lr_scheduler: str = "constant"  # after warm-up: "constant", "cosine" or "linear" decay
    total_steps: int | None = None  # optimizer steps the decay spans (cosine / linear)
    min_lr_ratio: float = 0.0  # decay floor, as a fraction of lr
    grad_clip: float | None = 1.0  # max global grad norm; null or 0: no clipping
    ppo_mini_batch_size: int | None = None  # global rows per optimizer step; null: the whole batch
    ppo_micro_batch_size_per_gpu: int = 4  # rows per forward/backward on one rank
    use_dynamic_bsz: bool = False  # pack micro-batches by token count instead of rows
    ppo_max_token_len_per_gpu: int = 16384  # token budget of one dynamic micro-batch
    ppo_epochs: int = 1  # passes over the batch per update call
    shuffle: bool = True  # reshuffle rows into mini-batches every epoch
    seed: int = 1  # torch seed at init, and the mini-batch shuffle seed

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not one of {list(OPTIMIZERS)}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler {self.lr_scheduler!r} is not one of {list(LR_SCHEDULERS)}")
        if self.lr_scheduler != "constant" and (not self.total_steps or self.total_steps <= self.warmup_steps):
            raise ValueError(f"lr_scheduler {self.lr_scheduler!r} needs total_steps > warmup_steps, "
                             f"got total_steps={self.total_steps}")
        for key in ("lr", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "ppo_epochs"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.ppo_mini_batch_size is not None and self.ppo_mini_batch_size <= 0:
            raise ValueError(f"ppo_mini_batch_size must be > 0 or null, got {self.ppo_mini_batch_size}")


@dataclass(frozen=True)
class ActorConfig(TrainConfig, PolicyLossConfig):
    """The ``actor`` section: the policy's optimisation, its loss and the loss's extra terms."""

    entropy_coeff: float = 0.0  # loss -= entropy_coeff * entropy
    use_kl_loss: bool = False  # loss += kl_loss_coef * KL(pi || ref) (needs ref_log_prob: the ref role)
    kl_loss_coef: float = 0.001  # weight of that KL term in the loss
    kl_loss_type: str = "low_var_kl"  # the KL estimator (rlcore.algos.kl.KL_KINDS)
    use_rollout_is: bool = False  # truncated IS weights pi_old / pi_rollout on the loss (needs rollout_log_probs)
    rollout_is_cap: float = 2.0  # truncation of those weights
    rollout_is_level: str = "token"  # "token" or "sequence" weights

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        PolicyLossConfig.__post_init__(self)
        if self.kl_loss_type not in KL_KINDS:
            raise ValueError(f"kl_loss_type {self.kl_loss_type!r} is not one of {list(KL_KINDS)}")
        if self.rollout_is_level not in IS_LEVELS:
            raise ValueError(f"rollout_is_level {self.rollout_is_level!r} is not one of {list(IS_LEVELS)}")
        if self.rollout_is_cap <= 0:
            raise ValueError(f"rollout_is_cap must be > 0, got {self.rollout_is_cap}")


@dataclass(frozen=True)
class CriticConfig(TrainConfig):
    """The ``critic`` section: a value model's optimisation and its clipped value loss."""

    lr: float = 1e-5
    cliprange_value: float = 0.5  # values may move at most this far from the batch's ``values`` per update
    loss_agg_mode: str = "token-mean"  # aggregation of the per-token value loss (LOSS_AGG_MODES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")


def worker_device(config: Mapping | DictConfig | Any) -> torch.device:
    """The device of a run, ``trainer.device`` ("auto": CUDA when available), checked against this machine."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    name = str(((config or {}).get("trainer") or {}).get("device", "auto"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but CUDA is not available here; use 'cpu' or 'auto'")
    return torch.device(name)


def worker_deterministic(config: Mapping | DictConfig | Any) -> bool:
    """``trainer.deterministic`` of a run config: workers switch torch's deterministic mode on in their
    own process (``rlcore.engines.seeding.set_deterministic``), which the driver's setting does not reach."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    return bool(((config or {}).get("trainer") or {}).get("deterministic", False))
