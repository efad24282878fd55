"""ActorWorker: the policy being trained (role "actor") or the frozen reference policy (role "ref").

One class for both because they are the same network read the same way; the reference simply has
no optimizer. The model is FSDP2-sharded over the worker group's ranks (see ``fsdp_utils``), so the
same code runs in-process (one rank) and as N Ray actors.

Config: a recipe's whole config (dict or OmegaConf); the worker reads ``model`` (``ModelConfig``),
``actor`` (``ActorConfig``: optimisation, the policy loss and its settings, KL and entropy terms,
IS correction) and ``trainer.device``; a key those sections do not have, or a value of the wrong
type, is a ``ConfigError`` naming it.

LoRA (``actor.lora.rank > 0``, ``rlcore.workers.lora``): the actor trains adapters only, hands
engines and exports the merged weights, and serves ``compute_ref_log_prob`` itself with the
adapters off (its frozen base is the reference policy).

Data read: input_ids, attention_mask, position_ids, responses (every method); response_mask,
old_log_probs (optional for a single-step update), advantages (update_policy), plus ref_log_prob /
rollout_log_probs when enabled.
``meta_info["temperature"]`` (default 1.0) divides the logits, as the sampler did, and
``meta_info["top_k"]`` / ``["top_p"]`` (set by the rollout when they filter) truncate them the same
way, so that log-probs describe the distribution the responses were drawn from.

The policy loss (``actor.policy_loss``) is a registered function ``fn(PolicyLossInput, cfg)``
(``rlcore.algos.losses``); the input carries the micro-batch itself, so a loss can read keys of
its own, which it names in a ``batch_keys`` attribute (the DPO loss reads ``ref_log_prob``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM

from rlcore.algos.consistency import weight_fingerprints
from rlcore.algos.importance import compute_is_weights
from rlcore.algos.kl import kl_penalty
from rlcore.algos.losses import LossScale, PolicyLossInput, agg_loss, get_policy_loss
from rlcore.algos.stats import masked_mean
from rlcore.models.config import ModelConfig
from rlcore.models.cpu_matmul import install_cpu_matmul
from rlcore.models.fused_layers import install_fused_layers
from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, register
from rlcore.single_controller.abandon import AbandonedCallError
from rlcore.typed_config import read_section
from rlcore.workers import fsdp_utils
from rlcore.workers.config import ActorConfig
from rlcore.workers.fsdp_utils import (
    FSDPTrainWorker,
    apply_fsdp2,
    forward_micro_batches,
    iter_full_tensors,
    mixed_precision_policy,
    setup_worker,
)
from rlcore.workers.optim import build_lr_scheduler, build_optimizer
from rlcore.workers.lora import lora_scaling, merge_lora_tensors, trainable_parameters, wrap_lora
from rlcore.workers.mismatch import MismatchCollector, read_check_config
from rlcore.workers.moe import MoEActor, micro_share
from rlcore.workers.precision import resolve_mixed_precision
from rlcore.workers.packing import load_kwargs, response_inputs
from rlcore.workers.response_head import install_response_head
from rlcore.workers.sampled_rows import SampledRows

INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
ROLES = ("actor", "ref")


class ActorWorker(FSDPTrainWorker):
    moe: MoEActor | None = None  # set by init_model for an MoE model (rlcore.workers.moe)

    def __init__(self, config: Mapping | DictConfig, role: str = "actor") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.config = config  # the whole recipe config: setup_worker reads trainer.device from it
        self.model_cfg = read_section(config, "model", ModelConfig)
        self.model_cfg.require_path()
        self.train_cfg = read_section(config, "actor", ActorConfig)
        self.policy_loss_fn = get_policy_loss(self.train_cfg.policy_loss)
        self.lora = role == "actor" and self.train_cfg.lora.enabled  # a ref is the base model, never adapted
        self.mismatch = MismatchCollector(read_check_config(config))  # check/*: trainer vs sampler log-probs
        trainer = (config or {}).get("trainer") or {}
        self.sampled = SampledRows(int(trainer.get("trajectory_groups") or 0))  # the trajectory sample's rows

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        model_cfg = self.model_cfg
        self.device = setup_worker(self, self.config, self.train_cfg.seed)
        model = AutoModelForCausalLM.from_pretrained(model_cfg.require_local_dir(), **load_kwargs(model_cfg))
        if model_cfg.fused_layers:  # RMSNorm and the MLP's SiLU product as fused autograd functions (same bits)
            install_fused_layers(model)
        # scores tokens without (B, T, V) logits; keeps up to actor.keep_logits_mb of them for the backward
        self.head = install_response_head(model, self.train_cfg.logits_chunk_mb, self.train_cfg.keep_logits_mb)
        install_cpu_matmul(model, model_cfg.cpu_matmul)  # fp32 linears on CPU through oneDNN (the head too)
        # MoE: frozen routers (actor only) and router-replay hooks; None for a dense model
        self.moe = MoEActor.build(model, self.role == "actor" and self.train_cfg.freeze_router, self.train_cfg.router_replay)
        if self.role == "ref":
            model.requires_grad_(False)
        elif model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            model = wrap_lora(model, self.train_cfg.lora)  # before sharding: FSDP2 shards the adapters too
        self.compute_dtype = resolve_mixed_precision(model_cfg, model, self.device)  # "bfloat16" or None (fp32)
        self.module = apply_fsdp2(model, self.device, mixed_precision_policy(self.compute_dtype))
        if self.role == "actor":
            self.optimizer = build_optimizer(trainable_parameters(self.module), self.train_cfg)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.train_cfg)

    # ------------------------------------------------------------------ forward
    def _forward(self, micro: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the response tokens and the entropies of the distributions they were drawn
        from, both (B, T_r) in fp32 (PPO ratios of bf16 log-probs would be noise). The logits are
        divided by the sampler's temperature and cut by its top-k / top-p (``rlcore.algos.sampling``:
        its log-probs are of the truncated distribution), and computed in chunks inside the head,
        never for every position at once (``rlcore.workers.response_head``)."""
        meta = micro.meta_info
        # padded, or packed (model.use_remove_padding): the rows' valid tokens end to end (rlcore.workers.packing)
        inputs = response_inputs(micro.batch, self.model_cfg.use_remove_padding, self.shares_prompts)
        moe_kwargs = {}
        if self.moe is not None:
            self.moe.before_forward(micro, inputs.packed)  # router replay: this micro-batch's recorded experts
            moe_kwargs["output_router_logits"] = True
        with self.head.scoring(inputs.labels, meta.get("temperature", 1.0), meta.get("top_k", 0), meta.get("top_p", 1.0),
                               entropy_grad=bool(self.train_cfg.entropy_coeff)):
            out = self.module(**inputs.kwargs, use_cache=False, logits_to_keep=inputs.keep, **moe_kwargs)
        self._router_logits = out.router_logits if self.moe is not None else None  # for _loss's MoE terms
        self._router_mask = None if inputs.packed is not None else micro.batch["attention_mask"]  # packed: all valid
        scores = inputs.per_response(out.logits)
        return scores[..., 0], scores[..., 1]

    def _infer(self, data: DataProto) -> dict[str, torch.Tensor]:
        data = data.select(batch_keys=INPUT_KEYS + self._moe_keys(data))
        self.module.eval()

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            log_prob, entropy = self._forward(micro)
            return {"log_prob": log_prob, "entropy": entropy}

        return forward_micro_batches(self.module, data, self.micro_batches(data), self.device, step)

    @register(Dispatch.DP_COMPUTE_PROTO, balance=True)  # rows split over ranks by token count (trainer.balance_batch)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` (B, T_r) of the responses, without grad."""
        out = self._infer(data)
        return DataProto.from_dict({"old_log_probs": out["log_prob"], "entropys": out["entropy"]})

    @register(Dispatch.DP_COMPUTE_PROTO, balance=True)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, T_r) under the reference policy: a ref worker's model, or a LoRA
        actor's frozen base with its adapters switched off (the same weights, without a copy)."""
        if self.lora:
            with self.module.disable_adapter():
                return DataProto.from_dict({"ref_log_prob": self._infer(data)["log_prob"]})
        if self.role != "ref":
            raise RuntimeError(f"compute_ref_log_prob needs role 'ref' or a LoRA actor, this worker's role is "
                               f"{self.role!r} without actor.lora.rank")
        return DataProto.from_dict({"ref_log_prob": self._infer(data)["log_prob"]})

    # ------------------------------------------------------------------ update
    @register(Dispatch.DP_COMPUTE_METRIC, balance=True)  # balanced shards; the loss is DP-invariant (LossScale)
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
        keys += self._moe_keys(data) + self.mismatch.keys(data)
        try:
            selected = data.select(batch_keys=list(dict.fromkeys(keys)))
        except KeyError as e:
            hint = (" (it may be left out only when the update is one optimizer step: ppo_epochs=1 and "
                    "ppo_mini_batch_size null or the whole batch)") if "old_log_probs" in str(e) else ""
            raise KeyError(f"update_policy: {e.args[0]}{hint}") from None
        self.mismatch.start(selected)  # from old_log_probs, or from the update's first forward (_loss)
        self.sampled.start(selected)  # likewise: the trainer's log-probs of the trajectory sample's rows
        dropped = self._mask_mismatched(selected) if cfg.use_rollout_is and cfg.rollout_is_mode == "mask" else {}
        rows_with_grad = self._rows_with_grad() if "advantages" in have else None
        try:
            metrics = {**self.run_updates(selected, self._loss, "actor", rows_with_grad), **dropped}
        except AbandonedCallError:  # given up before its first optimizer step: keep none of its statistics
            self.mismatch.drop()
            self.sampled.drop()
            raise
        self.sampled.stop()
        return {**metrics, **self.mismatch.finish(self.device)}

    @register(Dispatch.ONE_TO_ALL)
    def take_sampled_log_probs(self) -> list[dict]:
        """The trainer's log-probs of the trajectory sample's rows from the last single-step update's
        own forward (``rlcore.workers.sampled_rows``), then forgotten; [] after any other update."""
        return self.sampled.take()

    def _rows_with_grad(self):
        """With ``skip_zero_advantage_rows``, the mask of rows that can move the policy: those with a
        non-zero advantage on a valid token. Only where every other row's gradient is exactly zero:
        a loss marked ``zero_without_advantage``, no KL loss term, no entropy bonus, no MoE router
        losses (they see every token). None: train on every row."""
        cfg = self.train_cfg
        exact = (cfg.skip_zero_advantage_rows and getattr(self.policy_loss_fn, "zero_without_advantage", False)
                 and not (cfg.use_kl_loss and cfg.kl_loss_coef) and not cfg.entropy_coeff and self.moe is None)
        if not exact:
            return None
        return lambda mini: ((mini.batch["advantages"] != 0) & mini.batch["response_mask"].bool()).any(-1)

    def _mask_mismatched(self, data: DataProto) -> dict[str, float]:
        """``rollout_is_mode=mask``: take the tokens (or sequences) whose IS weight is out of bounds
        out of ``response_mask`` before the update, so they leave the loss's token / sequence counts
        too, not only its numerator (a zero weight alone would still dilute the mean). Without
        ``old_log_probs`` (a single-step update) they come from one forward pass here: the same
        numbers the update's own, detached, log-probs would be. Returns the masking metrics, which
        the micro-batches, seeing only the kept tokens, cannot report."""
        cfg, b = self.train_cfg, data.batch
        mask = b["response_mask"]
        old = b["old_log_probs"] if "old_log_probs" in b.keys() else self._infer(data)["log_prob"].to(mask.device)
        if self.mismatch.collecting:  # measured before the out-of-band tokens leave the mask
            self.mismatch.add(old, data)
            self.mismatch.collecting = False
        self.sampled.add(old, data)
        self.sampled.stop()
        weights, metrics = compute_is_weights(old, b["rollout_log_probs"], mask, cap=cfg.rollout_is_cap,
                                              level=cfg.rollout_is_level, mode="mask", lower=cfg.rollout_is_lower)
        b["response_mask"] = mask * (weights > 0).to(mask.dtype)
        return {f"actor/{k}": v for k, v in metrics.items() if k in ("is/masked_frac", "is/masked_seq_frac")}

    def _single_step(self, rows: int) -> bool:
        """Whether updating on ``rows`` rows of this rank takes exactly one optimizer step."""
        cfg = self.train_cfg
        return cfg.ppo_epochs == 1 and cfg.ppo_mini_batch_size in (None, rows * self.world_size)

    def _loss(self, micro: DataProto, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the mini-batch loss; ``scale`` holds the global counts that
        make it DP-invariant."""
        cfg, b = self.train_cfg, micro.batch
        mask = b["response_mask"]
        log_prob, entropy = self._forward(micro)
        self.mismatch.add(log_prob, micro)  # single-step update: its first forward is the trainer's scoring
        self.sampled.add(log_prob, micro)  # the same, for the rows of the trajectory sample
        # No old_log_probs: a single-step update (see update_policy), whose own log-probs are the old ones.
        old_log_prob = b["old_log_probs"] if "old_log_probs" in b.keys() else log_prob.detach()
        metrics: dict[str, float] = {}
        is_weights = None
        if cfg.use_rollout_is:
            is_weights, is_metrics = compute_is_weights(
                old_log_prob, b["rollout_log_probs"], mask, cap=cfg.rollout_is_cap, level=cfg.rollout_is_level,
                mode=cfg.rollout_is_mode, lower=cfg.rollout_is_lower,
            )
            # mask mode: _mask_mismatched already took the dropped tokens out; it reports how many
            metrics.update({k: v for k, v in is_metrics.items() if k not in ("is/masked_frac", "is/masked_seq_frac")})
        inputs = PolicyLossInput(log_prob, old_log_prob, b.get("advantages", None), mask, is_weights, scale, micro)
        loss, pg_metrics = self.policy_loss_fn(inputs, cfg)
        metrics.update(pg_metrics)
        if cfg.entropy_coeff:
            loss = loss - cfg.entropy_coeff * agg_loss(entropy, mask, cfg.loss_agg_mode, scale)
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, b["ref_log_prob"], cfg.kl_loss_type)
            loss = loss + cfg.kl_loss_coef * agg_loss(kl, mask, cfg.loss_agg_mode, scale)
            metrics["kl_loss"] = float(masked_mean(kl.detach(), mask))
        if self.moe is not None:
            loss = self._add_moe_terms(loss, micro, scale, metrics)
        return loss, metrics

    def _moe_keys(self, data: DataProto) -> list[str]:
        return self.moe.batch_keys(data) if self.moe is not None else []

    def _add_moe_terms(self, loss: torch.Tensor, micro: DataProto, scale: LossScale,
                       metrics: dict[str, float]) -> torch.Tensor:
        """``loss`` plus the coefficients times the load-balancing and z-loss of this forward's router
        logits (its share of the mini-batch, ``micro_share``); both reported whatever the coefficients."""
        cfg = self.train_cfg
        aux, z = self.moe.loss_terms(self._router_logits, self._router_mask)
        metrics["moe_aux_loss"], metrics["moe_z_loss"] = float(aux.detach()), float(z.detach())
        return loss + float(micro_share(micro, scale)) * (cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z)

    # ------------------------------------------------------------------ export
    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """A HF directory (weights, config, tokenizer) that from_pretrained and vLLM load (a LoRA
        actor's with its adapters merged in)."""
        fsdp_utils.export_hf(self.module, self.model_cfg.path, path, self.full_weights_uncopied())

    @register(Dispatch.COLLECTIVE_RANK_ZERO)
    def weight_checksums(self, dtypes: dict[str, str] | None = None) -> dict[str, Any]:
        """What an engine should hold (the consistency check): ``{"tensors": {HF name: (dtype, elements,
        hash)}}``, the ``tensor_fingerprint`` of each weight ``get_full_state_dict`` would hand it, cast
        to ``dtypes[name]`` (the engine's: the bytes the engine holds after the sync's copy), and
        ``"dtype"``, the one the log-probs are computed in. Gathered one parameter at a time, as
        ``push_weights`` does (no copy of the model); rank 0's answer."""
        tensors = iter_full_tensors(self.module)
        if self.rank != 0:
            for _ in tensors:  # the same gathers in the same order as rank 0
                pass
            return {}
        dtype = self.compute_dtype or str(next(self.module.parameters()).dtype).removeprefix("torch.")
        return {"tensors": weight_fingerprints(self.engine_weights(tensors), dtypes), "dtype": dtype}

    @register(Dispatch.ONE_TO_ALL)
    def probe_log_probs(self, ids: list[int]) -> dict[str, Any]:
        """The consistency check's probe (``rlcore.trainer.probe_check``): ``ids`` scored as a response
        to its first token, through the same forward the update scores with (a LoRA actor's adapters
        on), and ``"dtype"``, the one it computes in. Every rank runs it (FSDP gathers); all answer alike."""
        x = torch.tensor([list(ids)], dtype=torch.long)
        data = DataProto.from_dict({"input_ids": x, "attention_mask": torch.ones_like(x),
                                    "position_ids": torch.arange(x.shape[1])[None], "responses": x[:, 1:]})
        dtype = self.compute_dtype or str(next(self.module.parameters()).dtype).removeprefix("torch.")
        replay = self.moe.replay if self.moe is not None else None
        if replay is not None:  # no sampled routing to replay: the probe routes as the model does, like the engine
            saved, self.moe.replay = replay.routed, None
            replay.set(None)
        try:
            return {"log_probs": self._infer(data)["log_prob"][0].float().cpu().tolist(), "dtype": dtype}
        finally:
            if replay is not None:
                self.moe.replay, replay.routed = replay, saved

    def engine_weights(self, named):
        """A LoRA actor's entries merged into the base model's (``merge_lora_tensors``); a plain one's as they are."""
        return merge_lora_tensors(named, lora_scaling(self.train_cfg.lora)) if self.lora else named
