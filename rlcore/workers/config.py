"""The sections the training workers own: ``actor`` (also the reference's) and ``critic``.

Both share the optimisation and batching keys (``TrainConfig``); the actor's section is also the
settings object its policy loss reads (it extends ``PolicyLossConfig``), so every ``actor.*`` key
reaches a registered loss without a parameter list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlcore.algos.importance import IS_LEVELS, IS_MODES
from rlcore.algos.kl import KL_KINDS
from rlcore.algos.losses import LOSS_AGG_MODES, PolicyLossConfig

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULERS = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation and batching of a trained role.

    Batch sizes mean what verl's mean. ``ppo_mini_batch_size`` counts prompts of
    ``data.train_batch_size``, so a pasted verl value takes verl's optimizer steps; the trainer hands
    the workers it builds the global rows instead (prompts x ``rollout.n``, once, in
    ``rlcore.trainer.config.to_worker_config``), and that is what this field holds inside a worker.
    The micro-batch keys count rows on one rank (``_per_gpu``), in the run config and the worker alike.
    """

    optimizer: str = "adamw"  # "adamw" or "sgd" (plain SGD: handy for exact tests)
    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.01  # decoupled (AdamW) or L2 (SGD) weight decay
    warmup_steps: int = 0  # optimizer steps of linear warm-up from lr / warmup_steps to lr
    lr_scheduler: str = "constant"  # after warm-up: "constant", "cosine" or "linear" decay
    total_steps: int | None = None  # optimizer steps the decay spans (cosine / linear); null in a recipe's config:
                                    # the whole run, filled in by the trainer (rlcore.trainer.config.scheduled_steps)
    min_lr_ratio: float = 0.0  # decay floor, as a fraction of lr
    grad_clip: float | None = 1.0  # max global grad norm; null or 0: no clipping
    ppo_mini_batch_size: int | None = None  # prompts per optimizer step, as in verl (x rollout.n rows); null: the whole batch
    ppo_micro_batch_size_per_gpu: int = 4  # rows per forward/backward on one rank (also the log-prob forwards)
    ppo_micro_batch_size: int | None = None  # verl's deprecated global micro-batch: refused (use the _per_gpu key)
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
        if self.lr_scheduler != "constant" and self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise ValueError(f"lr_scheduler {self.lr_scheduler!r} needs total_steps > warmup_steps, "
                             f"got total_steps={self.total_steps}")
        for key in ("lr", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "ppo_epochs"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        if self.ppo_mini_batch_size is not None and self.ppo_mini_batch_size <= 0:
            raise ValueError(f"ppo_mini_batch_size must be > 0 or null, got {self.ppo_mini_batch_size}")
        if self.ppo_micro_batch_size is not None:  # verl divides it by the ranks; a silent guess here would differ
            raise ValueError(f"ppo_micro_batch_size={self.ppo_micro_batch_size} is verl's deprecated global "
                             "micro-batch size: use ppo_micro_batch_size_per_gpu (rows per rank) instead")


@dataclass(frozen=True)
class LoraConfig:
    """The ``actor.lora`` section: train low-rank adapters (peft's LoRA) instead of every weight.

    Only the adapters get gradients and optimizer state; the frozen base doubles as the reference
    policy (adapters switched off), and engines and exports get the merged weights W + alpha/rank * B A.
    """

    rank: int = 0  # adapter rank r; 0: off (full fine-tuning)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    target_modules: Any = "all-linear"  # "all-linear" (every linear but the output head), or module names: [q_proj, v_proj]
    dropout: float = 0.0  # dropout on the adapters' input while training

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0: off), got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        names = self.target_modules
        if isinstance(names, str):
            ok = bool(names)
        else:
            ok = isinstance(names, (list, tuple)) and bool(names) and all(isinstance(n, str) and n for n in names)
            object.__setattr__(self, "target_modules", list(names) if ok else names)  # a ListConfig -> a list
        if not ok:
            raise ValueError(f"lora.target_modules must be 'all-linear' or a non-empty list of module names, "
                             f"got {names!r}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class ActorConfig(TrainConfig, PolicyLossConfig):
    """The ``actor`` section: the policy's optimisation, its loss and the loss's extra terms."""

    entropy_coeff: float = 0.0  # loss -= entropy_coeff * entropy
    # 96: SmolLM2's 16 x 32 response positions make one chunk, whose head matmuls made the update 2.7% faster than 64's two
    logits_chunk_mb: float = 96.0  # log-probs / entropy from the LM head this many MiB of fp32 logits at a time (rlcore.algos.token_scores)
    keep_logits_mb: float = 192.0  # up to this many MiB of a micro-batch's logits kept for its backward, not recomputed (0: none)
    skip_zero_advantage_rows: bool = True  # rows whose advantages are all 0 skip forward/backward where their gradient is exactly 0
    use_kl_loss: bool = False  # loss += kl_loss_coef * KL(pi || ref) (needs ref_log_prob: the ref role)
    kl_loss_coef: float = 0.001  # weight of that KL term in the loss
    kl_loss_type: str = "low_var_kl"  # the KL estimator (rlcore.algos.kl.KL_KINDS)
    use_rollout_is: bool = False  # truncated IS weights pi_old / pi_rollout on the loss (needs rollout_log_probs)
    rollout_is_cap: float = 2.0  # truncation of those weights (mask mode: the upper bound)
    rollout_is_level: str = "token"  # "token", "sequence" (product of ratios) or "geometric" (their geometric mean)
    rollout_is_mode: str = "truncate"  # "truncate": min(w, cap); "mask": drop tokens / sequences with w outside [lower, cap]
    rollout_is_lower: float | None = None  # mask mode's lower bound; null: 1 / rollout_is_cap
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning (rank 0: off)
    # MoE policies only (rlcore.workers.moe); a dense model ignores the coefficients
    moe_aux_loss_coef: float = 0.0  # loss += coef * load-balancing loss (E * sum f_e P_e; k when balanced)
    moe_z_loss_coef: float = 0.0  # loss += coef * router z-loss (mean logsumexp(router logits)^2)
    freeze_router: bool = False  # router weights get no gradient and stay out of the optimizer
    router_replay: bool = False  # forwards route to the sampled experts (batch key routed_experts: rollout.record_routing)

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        PolicyLossConfig.__post_init__(self)
        if self.logits_chunk_mb <= 0:
            raise ValueError(f"logits_chunk_mb must be > 0, got {self.logits_chunk_mb}")
        if self.keep_logits_mb < 0:
            raise ValueError(f"keep_logits_mb must be >= 0, got {self.keep_logits_mb}")
        if self.moe_aux_loss_coef < 0 or self.moe_z_loss_coef < 0:
            raise ValueError(f"moe_aux_loss_coef and moe_z_loss_coef must be >= 0, got "
                             f"{self.moe_aux_loss_coef}, {self.moe_z_loss_coef}")
        if self.kl_loss_type not in KL_KINDS:
            raise ValueError(f"kl_loss_type {self.kl_loss_type!r} is not one of {list(KL_KINDS)}")
        if self.rollout_is_level not in IS_LEVELS:
            raise ValueError(f"rollout_is_level {self.rollout_is_level!r} is not one of {list(IS_LEVELS)}")
        if self.rollout_is_cap <= 0:
            raise ValueError(f"rollout_is_cap must be > 0, got {self.rollout_is_cap}")
        if self.rollout_is_mode not in IS_MODES:
            raise ValueError(f"rollout_is_mode {self.rollout_is_mode!r} is not one of {list(IS_MODES)}")
        if self.rollout_is_lower is not None:
            if self.rollout_is_mode != "mask":
                raise ValueError("rollout_is_lower applies to rollout_is_mode=mask only (truncation has just the cap)")
            if not 0 < self.rollout_is_lower <= self.rollout_is_cap:
                raise ValueError(f"rollout_is_lower must be in (0, rollout_is_cap={self.rollout_is_cap}], "
                                 f"got {self.rollout_is_lower}")


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


def trainer_setting(config: Mapping | DictConfig | Any, key: str, default: Any) -> Any:
    """``trainer.<key>`` of the run config a worker is built with (a dict, a DictConfig or None), else ``default``."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    return ((config or {}).get("trainer") or {}).get(key, default)


def worker_device(config: Mapping | DictConfig | Any) -> torch.device:
    """The device of a run, ``trainer.device`` ("auto": CUDA when available), checked against this machine."""
    name = str(trainer_setting(config, "device", "auto"))
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
    return bool(trainer_setting(config, "deterministic", False))


def worker_release_memory(config: Mapping | DictConfig | Any) -> bool:
    """``trainer.release_memory`` of a run config (default off; on in the SmolLM2 presets): workers hand the
    memory a phase freed back to the machine in their own process (``rlcore.engines.host_memory``): glibc's
    free heap pages after an update and a weight sync, a vLLM engine's KV cache between generations. Off,
    the next phase finds those pages still mapped instead of faulting each one in again."""
    return bool(trainer_setting(config, "release_memory", False))


def worker_keep_large_blocks(config: Mapping | DictConfig | Any) -> bool:
    """``trainer.keep_large_blocks`` of a run config (default on): the worker's process serves large blocks from
    glibc's heap and keeps freed memory there within a phase (``rlcore.engines.host_memory.keep_large_blocks``)."""
    return bool(trainer_setting(config, "keep_large_blocks", True))


def worker_trim_in_update(config: Mapping | DictConfig | Any) -> bool:
    """``trainer.trim_in_update`` of a run config (default off): with ``release_memory``, glibc's heap is
    trimmed inside each update as well, before each backward and between its layers
    (``rlcore.engines.host_memory.trim_between_layers``): ~0.5 GiB lower peak at SmolLM2, but every page
    handed back is faulted in again, +12% of the update's time measured quiet (docs/real_models.md, "Memory")."""
    return bool(trainer_setting(config, "trim_in_update", False))
