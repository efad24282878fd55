"""CriticWorker: a value model V(s_t) for PPO's GAE, FSDP2-sharded like the actor.

The network is the causal LM's transformer body (its LM head is dropped) plus a fresh
``nn.Linear(hidden, 1)`` value head, seeded identically on every rank. The value of response
token t is read at the position that predicts it (T_p - 1 + t), the state just before the token,
the same alignment as the actor's log-probs.

Config: sections ``model`` and ``critic`` (``trainer.device`` picks the device); an unknown key in
either is an error naming it.

    key                      default        meaning
    model.path               (required)     local HF directory of a causal LM (its body is used)
    model.dtype              "float32"      parameter dtype
    model.gradient_checkpointing False      recompute activations in backward
    model.mixed_precision    None           "bfloat16": bf16 compute, float32 parameters
    critic.lr                1e-5           peak learning rate
    critic.cliprange_value   0.5            values may move at most this far from ``values`` per update
    critic.loss_agg_mode     "token-mean"   aggregation of the per-token value loss
    critic.<training keys>                  optimizer, weight_decay, warmup_steps, lr_scheduler,
                                            total_steps, min_lr_ratio, grad_clip, ppo_mini_batch_size,
                                            ppo_micro_batch_size_per_gpu, use_dynamic_bsz,
                                            ppo_max_token_len_per_gpu, ppo_epochs, shuffle, seed:
                                            as for the actor (defaults in fsdp_utils.TRAIN_DEFAULTS)

Data read: input_ids, attention_mask, position_ids, responses; update_critic also response_mask,
values (the critic's values when the advantages were computed) and returns.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from omegaconf import DictConfig
from torch import nn

from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, register
from rlcore.trainer.core_algos import LOSS_AGG_MODES, compute_value_loss, masked_mean
from rlcore.workers.fsdp_utils import (
    MODEL_DEFAULTS,
    TRAIN_DEFAULTS,
    FSDPTrainWorker,
    ScalarHeadModel,
    apply_fsdp2,
    mixed_precision_policy,
    build_lr_scheduler,
    build_optimizer,
    forward_micro_batches,
    resolve_config,
    resolve_dtype,
    response_slice,
    setup_worker,
)

CRITIC_DEFAULTS = {**TRAIN_DEFAULTS, "lr": 1e-5, "cliprange_value": 0.5, "loss_agg_mode": "token-mean"}
INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]


class CriticWorker(FSDPTrainWorker):
    def __init__(self, config: Mapping | DictConfig) -> None:
        self.config = resolve_config(config, {"model": MODEL_DEFAULTS, "critic": CRITIC_DEFAULTS})
        self.train_cfg = self.config.critic
        if self.train_cfg.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"critic.loss_agg_mode {self.train_cfg.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoModelForCausalLM

        model_cfg = self.config.model
        self.device = setup_worker(self, self.config, self.train_cfg.seed)
        dtype = resolve_dtype(model_cfg.dtype)
        backbone = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=dtype).base_model
        if model_cfg.gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        head = nn.Linear(backbone.config.hidden_size, 1, dtype=dtype)
        self.module = apply_fsdp2(ScalarHeadModel(backbone, head), self.device, mixed_precision_policy(model_cfg))
        self.optimizer = build_optimizer(self.module.parameters(), self.train_cfg)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.train_cfg)

    def _values(self, micro: DataProto) -> torch.Tensor:
        b = micro.batch
        per_position = self.module(b["input_ids"], b["attention_mask"], b["position_ids"])
        return response_slice(per_position, b["responses"].shape[1]).float()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, T_r), one per response token; 0 on response padding."""
        data = data.select(batch_keys=INPUT_KEYS)
        self.module.eval()

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            values = self._values(micro)
            valid = micro.batch["attention_mask"][:, -values.shape[1]:].bool()
            return {"values": torch.where(valid, values, torch.zeros_like(values))}

        return DataProto.from_dict(forward_micro_batches(self.module, data, self.micro_batches(data), self.device, step))

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value regression towards ``returns``; returns means of the ``critic/*`` metrics."""
        data = data.select(batch_keys=INPUT_KEYS + ["response_mask", "values", "returns"])
        return self.run_updates(data, self._loss, prefix="critic")

    def _loss(self, micro: DataProto, **counts) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, b = self.train_cfg, micro.batch
        vpreds = self._values(micro)
        loss, metrics = compute_value_loss(
            vpreds, b["values"], b["returns"], b["response_mask"],
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **counts,
        )
        metrics["vpred_mean"] = float(masked_mean(vpreds.detach(), b["response_mask"]))
        return loss, metrics
