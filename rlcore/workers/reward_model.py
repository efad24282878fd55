"""RewardModelWorker: a learned reward model, FSDP2-sharded like the actor. It scores whole
sequences, and a trainable one fits preference pairs with the Bradley-Terry loss.

The network is a decoder with a scalar head (``AutoModelForSequenceClassification`` with one label,
whose head is ``score``). HF's own pooling picks the last token that is not the pad id; we pool at
the last position the attention mask marks instead, which stays right however the batch is padded
and whatever ids the padding holds. The reward model must share the policy's tokenizer: input_ids
are scored as they are.

One class for two uses, as the actor class is both policy and reference:

- a frozen scorer (``trainable=False``; role "rm" of PPO/GRPO with ``reward.model.path``): the
  directory ``reward.model.path``, which must hold a trained score head (a causal LM there would
  score with a random head: refused); micro-batches from ``reward.model`` (``LearnedRewardConfig``).
- trained (``trainable=True``; ``recipes/reward_model.py``): starts from ``model.path``, a reward
  model or a causal LM (the warm-started policy) whose body gets a fresh head, seeded identically on
  every rank; optimised with the ``reward_model`` section (``RewardModelConfig``: the actor's
  optimisation keys, where a row is one pair). ``update_rm`` takes Bradley-Terry steps,
  ``compute_pair_scores`` scores held-out pairs, ``export_hf`` writes the HF directory that the
  scorer (and ``AutoModelForSequenceClassification.from_pretrained``) loads, and the sharded
  checkpoints are the actor's.

Config: ``model`` (the trained model's directory, dtype, mixed precision), ``reward_model`` or
``reward.model`` as above, and ``trainer.device``.

Data read: ``compute_rm_score``: input_ids, attention_mask, position_ids, responses (the rollout
layout). ``update_rm`` / ``compute_pair_scores``: the pair layout of ``rlcore.data.preference``
(input_ids, attention_mask, position_ids, response_mask, each (B, 2, T): chosen, rejected).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlcore.algos.losses import LossScale
from rlcore.algos.preference import bradley_terry_loss
from rlcore.models.config import ModelConfig
from rlcore.models.cpu_matmul import install_cpu_matmul
from rlcore.models.fused_layers import install_fused_layers
from rlcore.protocol import DataProto
from rlcore.rewards.manager import RewardConfig
from rlcore.single_controller import Dispatch, register
from rlcore.typed_config import read_section
from rlcore.workers.config import TrainConfig
from rlcore.workers.fsdp_utils import (
    FSDPTrainWorker,
    ScalarHeadModel,
    apply_fsdp2,
    forward_micro_batches,
    full_state_dict,
    micro_batch_indices,
    mixed_precision_policy,
    setup_worker,
)
from rlcore.workers.optim import build_lr_scheduler, build_optimizer
from rlcore.workers.packing import load_kwargs, pack
from rlcore.workers.precision import resolve_mixed_precision

INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
PAIR_KEYS = ["input_ids", "attention_mask", "position_ids", "response_mask"]


@dataclass(frozen=True)
class RewardModelConfig(TrainConfig):
    """The ``reward_model`` section: how ``recipes/reward_model.py`` trains a reward model. The
    actor's optimisation keys; a row is one (chosen, rejected) pair, so ``ppo_mini_batch_size`` and
    ``ppo_micro_batch_size_per_gpu`` count pairs and a dynamic micro-batch's token budget counts both
    sequences of a pair."""

    lr: float = 1e-5  # peak learning rate (the body and the fresh head alike)


class RewardModelWorker(FSDPTrainWorker):
    def __init__(self, config: Mapping | DictConfig, trainable: bool = False) -> None:
        self.config = config  # the whole recipe config: setup_worker reads trainer.device from it
        self.trainable = trainable
        self.model_cfg = read_section(config, "model", ModelConfig)
        if trainable:
            self.path = self.model_cfg.require_path()
            self.train_cfg = read_section(config, "reward_model", RewardModelConfig)
            c = self.train_cfg
            self.batching = (c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu)
        else:
            scoring = read_section(config, "reward", RewardConfig).model
            if not scoring.path:
                raise ValueError("the reward-model role scores with reward.model.path: set it to a reward model's HF "
                                 "directory (python -m recipes.reward_model writes one)")
            self.path = scoring.path
            self.batching = (scoring.micro_batch_size_per_gpu, scoring.use_dynamic_bsz, scoring.max_token_len_per_gpu)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        model_cfg = self.model_cfg
        self.device = setup_worker(self, self.config, self.train_cfg.seed if self.trainable else 0)
        path = ModelConfig(path=self.path).require_local_dir()
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, output_loading_info=True, **load_kwargs(model_cfg))
        if not isinstance(getattr(model, "score", None), nn.Linear):
            raise ValueError(f"{type(model).__name__} has no linear `score` head: expected a decoder reward model")
        self.fresh_head = any(key.startswith("score.") for key in info["missing_keys"])
        if self.fresh_head and not self.trainable:
            raise ValueError(f"{path} holds no trained score head (a causal LM?): it would score with random weights. "
                             "Point reward.model.path at a reward model (python -m recipes.reward_model writes one)")
        if model.config.pad_token_id is None:  # HF's own pooling, after export, needs it
            model.config.pad_token_id = AutoTokenizer.from_pretrained(path).pad_token_id
        self.hf_config = model.config
        self.body_prefix = model.base_model_prefix
        body = model.base_model
        if self.trainable and model_cfg.fused_layers:  # RMSNorm and the MLP's SiLU product fused (same bits)
            install_fused_layers(body)
        install_cpu_matmul(body, model_cfg.cpu_matmul)  # fp32 linears on CPU through oneDNN
        if self.trainable and model_cfg.gradient_checkpointing:
            body.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module = ScalarHeadModel(body, model.score)
        if not self.trainable:
            module.requires_grad_(False)
        self.compute_dtype = resolve_mixed_precision(model_cfg, model, self.device) if self.trainable else None
        self.module = apply_fsdp2(module, self.device, mixed_precision_policy(self.compute_dtype))
        if self.trainable:
            self.optimizer = build_optimizer(self.module.parameters(), self.train_cfg)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.train_cfg)
        else:
            self.module.eval()

    def micro_batches(self, data: DataProto) -> list:
        """Fixed row counts or a token budget (a pair row counts the tokens of both its sequences)."""
        if self.module is None:
            raise RuntimeError(f"{type(self).__name__}: call init_model() first")
        size, dynamic, budget = self.batching
        lengths = DataProto.from_dict({"attention_mask": data.batch["attention_mask"].flatten(1)})
        return micro_batch_indices(lengths, size, dynamic, budget, self.device)

    def _scores(self, b) -> torch.Tensor:
        """Each sequence's score at its last valid position; any leading shape ((B,) rows, (B, 2) pairs)."""
        shape = b["input_ids"].shape[:-1]
        ids, mask, pos = (b[k].reshape(-1, b[k].shape[-1]) for k in ("input_ids", "attention_mask", "position_ids"))
        if self.model_cfg.use_remove_padding:  # the rows' valid tokens end to end (rlcore.workers.packing)
            packed = pack(ids, mask, pos)
            return self.module(**packed.model_kwargs()).float()[0, packed.last_positions()].reshape(shape)
        per_position = self.module(ids, mask, pos).float()
        last = mask.shape[1] - 1 - mask.bool().flip(-1).to(torch.int64).argmax(-1)  # rightmost valid position
        return per_position.gather(1, last.unsqueeze(1)).squeeze(1).reshape(shape)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B,) and ``token_level_scores`` (B, T_r): the score on the last valid response token."""
        data = data.select(batch_keys=INPUT_KEYS)
        self.module.eval()

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            b = micro.batch
            scores = self._scores(b)
            response_len = b["attention_mask"][:, -b["responses"].shape[1]:].bool().sum(-1)
            token_scores = torch.zeros(b["responses"].shape, dtype=scores.dtype, device=scores.device)
            rows = torch.nonzero(response_len > 0).squeeze(1)
            token_scores[rows, response_len[rows] - 1] = scores[rows]
            return {"rm_scores": scores, "token_level_scores": token_scores}

        return DataProto.from_dict(forward_micro_batches(self.module, data, self.micro_batches(data), self.device, step))

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_pair_scores(self, data: DataProto) -> DataProto:
        """``chosen_scores`` and ``rejected_scores`` (B,) of pair rows, without grad."""
        data = data.select(batch_keys=PAIR_KEYS[:3])
        self.module.eval()

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            scores = self._scores(micro.batch)
            return {"chosen_scores": scores[:, 0], "rejected_scores": scores[:, 1]}

        return DataProto.from_dict(forward_micro_batches(self.module, data, self.micro_batches(data), self.device, step))

    @register(Dispatch.DP_COMPUTE_METRIC)
    def update_rm(self, data: DataProto) -> dict[str, float]:
        """Bradley-Terry steps on pair rows (``ppo_epochs`` passes, mini-batches of pairs); returns the
        means of ``rm/loss`` (the global mini-batch loss), ``rm/accuracy``, ``rm/margin``, the mean
        chosen and rejected scores (measured in the forward, before each step), grad norm and lr."""
        shape = data.batch["input_ids"].shape
        if len(shape) != 3 or shape[1] != 2:
            raise ValueError(f"update_rm trains on pair rows (B, 2, T): chosen and rejected, got input_ids {tuple(shape)}")
        return self.run_updates(data.select(batch_keys=PAIR_KEYS), self._bt_loss, prefix="rm")

    def _bt_loss(self, micro: DataProto, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        # run_updates counts the mini-batch's sequences from response_mask (B, 2, T): two per pair,
        # the count bradley_terry_loss expects for its DP-invariant share.
        scores = self._scores(micro.batch)
        return bradley_terry_loss(scores[:, 0], scores[:, 1], scale)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> None:
        """The reward model as a HF directory (config with ``num_labels=1``, safetensors, the tokenizer
        of the model it started from) that ``AutoModelForSequenceClassification.from_pretrained`` and
        the scorer load. Collective: every rank gathers, rank 0 writes."""
        state = full_state_dict(self.module)
        if dist.get_rank() == 0:
            renamed = {}
            for key, value in state.items():
                owner, _, rest = key.partition(".")
                renamed[f"{self.body_prefix}.{rest}" if owner == "backbone" else f"score.{rest}"] = value
            with torch.device("meta"):
                skeleton = AutoModelForSequenceClassification.from_config(self.hf_config)
            skeleton.save_pretrained(path, state_dict=renamed)
            AutoTokenizer.from_pretrained(self.path).save_pretrained(path)
        dist.barrier()
