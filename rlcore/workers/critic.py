"""CriticWorker: a value model V(s_t) for PPO's GAE, FSDP2-sharded like the actor.

The network is the causal LM's transformer body (its LM head is dropped) plus a fresh
``nn.Linear(hidden, 1)`` value head, seeded identically on every rank. The value of response
token t is read at the position that predicts it (T_p - 1 + t), the state just before the token,
the same alignment as the actor's log-probs.

Config: ``model`` (``ModelConfig``), ``critic`` (``CriticConfig``: the actor's optimisation keys,
``cliprange_value`` and ``loss_agg_mode``) and ``trainer.device``; an unknown key or a value of the
wrong type is a ``ConfigError`` naming it.

Data read: input_ids, attention_mask, position_ids, responses; update_critic also response_mask,
values (the critic's values when the advantages were computed) and returns.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from omegaconf import DictConfig
from torch import nn
from transformers import AutoModelForCausalLM

from rlcore.algos.losses import LossScale, compute_value_loss
from rlcore.algos.stats import masked_mean
from rlcore.models.config import ModelConfig, torch_dtype
from rlcore.models.cpu_matmul import install_cpu_matmul
from rlcore.models.fused_layers import install_fused_layers
from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, register
from rlcore.typed_config import read_section
from rlcore.workers.config import CriticConfig
from rlcore.workers.fsdp_utils import (
    FSDPTrainWorker,
    ScalarHeadModel,
    apply_fsdp2,
    forward_micro_batches,
    mixed_precision_policy,
    setup_worker,
)
from rlcore.workers.optim import build_lr_scheduler, build_optimizer
from rlcore.workers.packing import load_kwargs, response_inputs
from rlcore.workers.precision import resolve_mixed_precision

INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]


class CriticWorker(FSDPTrainWorker):
    def __init__(self, config: Mapping | DictConfig) -> None:
        self.config = config  # the whole recipe config: setup_worker reads trainer.device from it
        self.model_cfg = read_section(config, "model", ModelConfig)
        self.model_cfg.require_path()
        self.train_cfg = read_section(config, "critic", CriticConfig)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        model_cfg = self.model_cfg
        self.device = setup_worker(self, self.config, self.train_cfg.seed)
        dtype = torch_dtype(model_cfg.dtype)
        backbone = AutoModelForCausalLM.from_pretrained(model_cfg.require_local_dir(), **load_kwargs(model_cfg)).base_model
        if model_cfg.fused_layers:  # RMSNorm and the MLP's SiLU product as fused autograd functions (same bits)
            install_fused_layers(backbone)
        install_cpu_matmul(backbone, model_cfg.cpu_matmul)  # fp32 linears on CPU through oneDNN
        if model_cfg.gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        head = nn.Linear(backbone.config.hidden_size, 1, dtype=dtype)
        self.compute_dtype = resolve_mixed_precision(model_cfg, backbone, self.device)  # "bfloat16" or None (fp32)
        self.module = apply_fsdp2(ScalarHeadModel(backbone, head), self.device, mixed_precision_policy(self.compute_dtype))
        self.optimizer = build_optimizer(self.module.parameters(), self.train_cfg)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, self.train_cfg)

    def _values(self, micro: DataProto) -> torch.Tensor:
        # padded, or packed (model.use_remove_padding): the rows' valid tokens end to end (rlcore.workers.packing)
        inputs = response_inputs(micro.batch, self.model_cfg.use_remove_padding, self.shares_prompts)
        per_position = self.module(**inputs.kwargs)
        return inputs.per_response(per_position[:, inputs.keep]).float()

    @register(Dispatch.DP_COMPUTE_PROTO, balance=True)  # rows split over ranks by token count
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` (B, T_r), one per response token; 0 on response padding."""
        data = data.select(batch_keys=INPUT_KEYS)
        self.module.eval()

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            values = self._values(micro)
            valid = micro.batch["attention_mask"][:, -values.shape[1]:].bool()
            return {"values": torch.where(valid, values, torch.zeros_like(values))}

        return DataProto.from_dict(forward_micro_batches(self.module, data, self.micro_batches(data), self.device, step))

    @register(Dispatch.DP_COMPUTE_METRIC, balance=True)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value regression towards ``returns``; returns means of the ``critic/*`` metrics."""
        data = data.select(batch_keys=INPUT_KEYS + ["response_mask", "values", "returns"])
        return self.run_updates(data, self._loss, prefix="critic")

    def _loss(self, micro: DataProto, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, b = self.train_cfg, micro.batch
        vpreds = self._values(micro)
        loss, metrics = compute_value_loss(
            vpreds, b["values"], b["returns"], b["response_mask"],
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, scale=scale,
        )
        metrics["vpred_mean"] = float(masked_mean(vpreds.detach(), b["response_mask"]))
        return loss, metrics
