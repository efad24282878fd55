"""ActorWorker: the policy being trained (role "actor") or the frozen reference policy (role "ref").

One class for both because they are the same network read the same way; the reference simply has
no optimizer. The model is FSDP2-sharded over the worker group's ranks (see ``fsdp_utils``), so the
same code runs in-process (one rank) and as N Ray actors.

Config: a recipe's whole config (dict or OmegaConf); the worker reads ``model`` (``ModelConfig``),
``actor`` (``ActorConfig``: optimisation, the policy loss and its settings, KL and entropy terms,
IS correction) and ``trainer.device``; a key those sections do not have, or a value of the wrong
type, is a ``ConfigError`` naming it.

Data read: input_ids, attention_mask, position_ids, responses (every method); response_mask,
old_log_probs (optional for a single-step update), advantages (update_policy), plus ref_log_prob /
rollout_log_probs when enabled.
``meta_info["temperature"]`` (default 1.0) divides the logits, as the sampler did, so that
log-probs describe the distribution the responses were drawn from.

The policy loss (``actor.policy_loss``) is a registered function ``fn(PolicyLossInput, cfg)``
(``rlcore.algos.losses``); the input carries the micro-batch itself, so a loss can read keys of
its own, which it names in a ``batch_keys`` attribute (the DPO loss reads ``ref_log_prob``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM

from rlcore.algos.importance import compute_is_weights
from rlcore.algos.kl import kl_penalty
from rlcore.algos.losses import LossScale, PolicyLossInput, agg_loss, get_policy_loss
from rlcore.algos.stats import entropy_from_logits, logprobs_from_logits, masked_mean
from rlcore.models.config import ModelConfig, torch_dtype
from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, register
from rlcore.typed_config import read_section
from rlcore.workers import fsdp_utils
from rlcore.workers.config import ActorConfig
from rlcore.workers.fsdp_utils import (
    FSDPTrainWorker,
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    forward_micro_batches,
    mixed_precision_policy,
    response_slice,
    setup_worker,
)

INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
ROLES = ("actor", "ref")


class ActorWorker(FSDPTrainWorker):
    def __init__(self, config: Mapping | DictConfig, role: str = "actor") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.config = config  # the whole recipe config: setup_worker reads trainer.device from it
        self.model_cfg = read_section(config, "model", ModelConfig)
        self.model_cfg.require_path()
        self.train_cfg = read_section(config, "actor", ActorConfig)
        self.policy_loss_fn = get_policy_loss(self.train_cfg.policy_loss)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        model_cfg = self.model_cfg
        self.device = setup_worker(self, self.config, self.train_cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_cfg.require_local_dir(), dtype=torch_dtype(model_cfg.dtype))
        if self.role == "ref":
            model.requires_grad_(False)
        elif model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.module = apply_fsdp2(model, self.device, mixed_precision_policy(model_cfg))
        if self.role == "actor":
            self.optimizer = build_optimizer(self.module.parameters(), self.train_cfg)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.train_cfg)

    # ------------------------------------------------------------------ forward
    def _forward(self, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens and the logits that scored them, both (B, T_r[, V])."""
        b = micro.batch
        logits = self.module(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"], use_cache=False
        ).logits
        # fp32 for the log-softmax: PPO ratios of bf16 log-probs would be noise
        logits = response_slice(logits, b["responses"].shape[1]).float() / micro.meta_info.get("temperature", 1.0)
        return logprobs_from_logits(logits, b["responses"]), logits

    def _infer(self, data: DataProto) -> dict[str, torch.Tensor]:
        data = data.select(batch_keys=INPUT_KEYS)
        self.module.eval()

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            log_prob, logits = self._forward(micro)
            return {"log_prob": log_prob, "entropy": entropy_from_logits(logits)}

        return forward_micro_batches(self.module, data, self.micro_batches(data), self.device, step)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` (B, T_r) of the responses, without grad."""
        out = self._infer(data)
        return DataProto.from_dict({"old_log_probs": out["log_prob"], "entropys": out["entropy"]})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, T_r) under the reference policy."""
        if self.role != "ref":
            raise RuntimeError(f"compute_ref_log_prob needs role 'ref', this worker's role is {self.role!r}")
        return DataProto.from_dict({"ref_log_prob": self._infer(data)["log_prob"]})

    # ------------------------------------------------------------------ update
    @register(Dispatch.DP_COMPUTE_METRIC)
    def update_policy(self, data: DataProto) -> dict[str, float]:
        """PPO epochs over mini-batches of this rank's rows; returns means of the ``actor/*`` metrics.

        ``old_log_probs`` may be left out when the update is a single optimizer step (``ppo_epochs``
        1, one mini-batch): the weights are then still the ones the batch was scored against, so the
        update's own log-probs, detached, are exactly the old ones, and ``compute_log_prob`` (a
        whole forward pass) can be skipped. With more steps the policy moves between them, and
        the old log-probs must come from before the first.
        """
        cfg = self.train_cfg
        have = data.batch.keys()
        keys = INPUT_KEYS + ["response_mask"] + [k for k in ("advantages",) if k in have]
        keys += list(getattr(self.policy_loss_fn, "batch_keys", ()))  # what the loss itself reads (DPO: ref_log_prob)
        if "old_log_probs" in have or not self._single_step(len(data)):
            keys.append("old_log_probs")
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if cfg.use_rollout_is:
            keys.append("rollout_log_probs")
        try:
            selected = data.select(batch_keys=list(dict.fromkeys(keys)))
        except KeyError as e:
            hint = (" (it may be left out only when the update is one optimizer step: ppo_epochs=1 and "
                    "ppo_mini_batch_size null or the whole batch)") if "old_log_probs" in str(e) else ""
            raise KeyError(f"update_policy: {e.args[0]}{hint}") from None
        return self.run_updates(selected, self._loss, prefix="actor")

    def _single_step(self, rows: int) -> bool:
        """Whether updating on ``rows`` rows of this rank takes exactly one optimizer step."""
        cfg = self.train_cfg
        return cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size in (None, rows * self.world_size)

    def _loss(self, micro: DataProto, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the mini-batch loss; ``scale`` holds the global counts that
        make it DP-invariant."""
        cfg, b = self.train_cfg, micro.batch
        mask = b["response_mask"]
        log_prob, logits = self._forward(micro)
        # No old_log_probs: a single-step update (see update_policy), whose own log-probs are the old ones.
        old_log_prob = b["old_log_probs"] if "old_log_probs" in b.keys() else log_prob.detach()
        metrics: dict[str, float] = {}
        is_weights = None
        if cfg.use_rollout_is:
            is_weights, is_metrics = compute_is_weights(
                old_log_prob, b["rollout_log_probs"], mask, cap=cfg.rollout_is_cap, level=cfg.rollout_is_level
            )
            metrics.update(is_metrics)
        inputs = PolicyLossInput(log_prob, old_log_prob, b.get("advantages", None), mask, is_weights, scale, micro)
        loss, pg_metrics = self.policy_loss_fn(inputs, cfg)
        metrics.update(pg_metrics)
        if cfg.entropy_coeff:
            entropy = entropy_from_logits(logits)
            loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, scale)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, b["ref_log_prob"], cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, cfg.loss_agg_mode, scale)
            metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
        return loss, metrics

    # ------------------------------------------------------------------ export
    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """A HF directory (weights, config, tokenizer) that from_pretrained and vLLM load."""
        fsdp_utils.export_hf(self.module, self.model_cfg.path, path)
