"""ActorWorker: the policy being trained (role "actor") or the frozen reference policy (role "ref").

One class for both because they are the same network read the same way; the reference simply has
no optimizer. The model is FSDP2-sharded over the worker group's ranks (see ``fsdp_utils``), so the
same code runs in-process (one rank) and as N Ray actors.

Config: an OmegaConf DictConfig or a plain dict with sections ``model`` and ``actor``
(``trainer.device`` picks the device; other sections are ignored). An unknown key in ``model`` or
``actor`` is an error naming it. Every key, with its default:

    key                                 default        meaning
    model.path                          (required)     local HF directory (AutoModelForCausalLM)
    model.dtype                         "float32"      parameter dtype: float32, bfloat16, float16
    model.gradient_checkpointing        False          recompute activations in backward (actor only)
    model.mixed_precision               None           "bfloat16": bf16 compute, float32 parameters
    actor.optimizer                     "adamw"        "adamw" or "sgd"
    actor.lr                            1e-6           peak learning rate
    actor.weight_decay                  0.01           weight decay
    actor.warmup_steps                  0              optimizer steps of linear warm-up
    actor.lr_scheduler                  "constant"     after warm-up: "constant", "cosine", "linear"
    actor.total_steps                   None           optimizer steps the decay spans (cosine/linear)
    actor.min_lr_ratio                  0.0            decay floor as a fraction of lr
    actor.grad_clip                     1.0            max global grad norm (None or 0: no clipping)
    actor.ppo_mini_batch_size           None           global rows per optimizer step (None: whole batch)
    actor.ppo_micro_batch_size_per_gpu  4              rows per forward/backward on one rank
    actor.use_dynamic_bsz               False          micro-batches packed by token count instead
    actor.ppo_max_token_len_per_gpu     16384          token budget of a dynamic micro-batch
    actor.ppo_epochs                    1              passes over the batch per update_policy call
    actor.shuffle                       True           reshuffle rows into mini-batches every epoch
    actor.seed                          1              torch seed at init, and the shuffle seed
    actor.policy_loss                   "ppo"          policy-loss registry name: "ppo", "dual_clip",
                                                       "clip_higher", "reinforce" or a registered one
    actor.clip_ratio_low                0.2            ratio clip below: 1 - clip_ratio_low
    actor.clip_ratio_high               0.2            ratio clip above: 1 + clip_ratio_high
    actor.clip_ratio_c                  3.0            dual-clip cap for negative advantages
    actor.loss_agg_mode                 "token-mean"   one of core_algos.LOSS_AGG_MODES
    actor.entropy_coeff                 0.0            loss -= entropy_coeff * entropy
    actor.use_kl_loss                   False          loss += kl_loss_coef * KL(pi || ref) (needs ref_log_prob)
    actor.kl_loss_coef                  0.001          weight of that KL term
    actor.kl_loss_type                  "low_var_kl"   KL estimator (core_algos.kl_penalty kinds)
    actor.use_rollout_is                False          truncated IS weights pi_old / pi_rollout on the
                                                       loss (needs rollout_log_probs)
    actor.rollout_is_cap                2.0            truncation of those weights
    actor.rollout_is_level              "token"        "token" or "sequence" weights

Data read: input_ids, attention_mask, position_ids, responses (every method); response_mask,
old_log_probs (optional for a single-step update), advantages (update_policy), plus ref_log_prob /
rollout_log_probs when enabled.
``meta_info["temperature"]`` (default 1.0) divides the logits, as the sampler did, so that
log-probs describe the distribution the responses were drawn from.

A policy loss registered with ``core_algos.register_policy_loss`` is called with the standard
signature; if it also declares a ``data`` parameter it receives the micro-batch DataProto, whole,
so a recipe's loss can read keys of its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from omegaconf import DictConfig

from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, register
from rlcore.trainer.core_algos import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_is_weights,
    entropy_from_logits,
    get_policy_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
)
from rlcore.workers import fsdp_utils
from rlcore.workers.fsdp_utils import (
    MODEL_DEFAULTS,
    TRAIN_DEFAULTS,
    FSDPTrainWorker,
    apply_fsdp2,
    build_lr_scheduler,
    build_optimizer,
    forward_micro_batches,
    mixed_precision_policy,
    resolve_config,
    resolve_dtype,
    response_slice,
    setup_worker,
)

ACTOR_DEFAULTS = {
    **TRAIN_DEFAULTS,
    "policy_loss": "ppo",
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "clip_ratio_c": 3.0,
    "loss_agg_mode": "token-mean",
    "entropy_coeff": 0.0,
    "use_kl_loss": False,
    "kl_loss_coef": 0.001,
    "kl_loss_type": "low_var_kl",
    "use_rollout_is": False,
    "rollout_is_cap": 2.0,
    "rollout_is_level": "token",
}

INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
ROLES = ("actor", "ref")


class ActorWorker(FSDPTrainWorker):
    def __init__(self, config: Mapping | DictConfig, role: str = "actor") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.config = resolve_config(config, {"model": MODEL_DEFAULTS, "actor": ACTOR_DEFAULTS})
        self.train_cfg = self.config.actor
        if self.train_cfg.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode {self.train_cfg.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
        self.policy_loss_fn = get_policy_loss(self.train_cfg.policy_loss)
        self.loss_takes_data = "data" in inspect.signature(self.policy_loss_fn).parameters

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoModelForCausalLM

        model_cfg = self.config.model
        self.device = setup_worker(self, self.config, self.train_cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=resolve_dtype(model_cfg.dtype))
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
        # A loss that reads the micro-batch itself (e.g. DPO) decides which keys it needs.
        keys = INPUT_KEYS + ["response_mask"] + ([] if self.loss_takes_data else ["advantages"])
        if not self.loss_takes_data and ("old_log_probs" in data.batch.keys() or not self._single_step(len(data))):
            keys.append("old_log_probs")
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if cfg.use_rollout_is:
            keys.append("rollout_log_probs")
        try:
            selected = data.select(batch_keys=keys)
        except KeyError as e:
            hint = (" (it may be left out only when the update is one optimizer step: ppo_epochs=1 and "
                    "ppo_mini_batch_size null or the whole batch)") if "old_log_probs" in str(e) else ""
            raise KeyError(f"update_policy: {e.args[0]}{hint}") from None
        return self.run_updates(data if self.loss_takes_data else selected, self._loss, prefix="actor")

    def _single_step(self, rows: int) -> bool:
        """Whether updating on ``rows`` rows of this rank takes exactly one optimizer step."""
        cfg = self.train_cfg
        return cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size in (None, rows * self.world_size)

    def _loss(self, micro: DataProto, **counts) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the mini-batch loss; ``counts`` are the global
        ``global_tokens``/``global_seqs``/``dp_size`` that make it DP-invariant."""
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
        loss, pg_metrics = self.policy_loss_fn(
            log_prob, old_log_prob, b.get("advantages", None), mask,
            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode, is_weights=is_weights, **counts,
            **({"data": micro} if self.loss_takes_data else {}),
        )
        metrics.update(pg_metrics)
        if cfg.entropy_coeff:
            entropy = entropy_from_logits(logits)
            loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, **counts)
        else:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, b["ref_log_prob"], cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, cfg.loss_agg_mode, **counts)
            metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
        return loss, metrics

    # ------------------------------------------------------------------ export
    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """A HF directory (weights, config, tokenizer) that from_pretrained and vLLM load."""
        fsdp_utils.export_hf(self.module, self.config.model.path, path)
