"""RewardModelWorker: scores whole sequences with a learned reward model (no grad), FSDP2-sharded.

The reward model is a decoder with a scalar head (``AutoModelForSequenceClassification`` with
one label, whose head is ``score``). HF's own pooling picks the last token that is not the pad
id; we pool at the last position the attention mask marks instead, which stays right however the
batch is padded and whatever ids the padding holds. The reward model must share the policy's
tokenizer: input_ids are scored as they are.

Config: ``model`` (the reward model's directory and dtype), ``reward_model``
(``RewardModelConfig``) and ``trainer.device``.

Data read: input_ids, attention_mask, position_ids, responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from transformers import AutoModelForSequenceClassification

from rlcore.models.config import ModelConfig, torch_dtype
from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, Worker, register
from rlcore.typed_config import read_section
from rlcore.workers.fsdp_utils import (
    ScalarHeadModel,
    apply_fsdp2,
    forward_micro_batches,
    micro_batch_indices,
    setup_worker,
)

INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]


@dataclass(frozen=True)
class RewardModelConfig:
    """The ``reward_model`` section: how a learned reward model scores (no grad)."""

    micro_batch_size_per_gpu: int = 4  # rows per forward on one rank
    use_dynamic_bsz: bool = False  # micro-batches packed by token count instead
    max_token_len_per_gpu: int = 16384  # token budget of a dynamic micro-batch


class RewardModelWorker(Worker):
    def __init__(self, config: Mapping | DictConfig) -> None:
        self.config = config
        self.model_cfg = read_section(config, "model", ModelConfig)
        self.model_cfg.require_path()
        self.rm_cfg = read_section(config, "reward_model", RewardModelConfig)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        model_cfg = self.model_cfg
        self.device = setup_worker(self, self.config, seed=0)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_cfg.require_local_dir(), num_labels=1, dtype=torch_dtype(model_cfg.dtype)
        )
        if not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise ValueError(f"{type(model).__name__} has no linear `score` head: expected a decoder reward model")
        module = ScalarHeadModel(model.base_model, model.score).requires_grad_(False)
        self.module = apply_fsdp2(module, self.device).eval()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B,) and ``token_level_scores`` (B, T_r): the score on the last valid response token."""
        cfg = self.rm_cfg
        data = data.select(batch_keys=INPUT_KEYS)

        def step(micro: DataProto) -> dict[str, torch.Tensor]:
            b = micro.batch
            per_position = self.module(b["input_ids"], b["attention_mask"], b["position_ids"]).float()
            mask = b["attention_mask"].bool()
            last = mask.shape[1] - 1 - mask.flip(-1).to(torch.int64).argmax(-1)  # rightmost valid position
            scores = per_position.gather(1, last.unsqueeze(1)).squeeze(1)
            response_len = mask[:, -b["responses"].shape[1]:].sum(-1)
            token_scores = torch.zeros(b["responses"].shape, dtype=scores.dtype, device=scores.device)
            rows = torch.nonzero(response_len > 0).squeeze(1)
            token_scores[rows, response_len[rows] - 1] = scores[rows]
            return {"rm_scores": scores, "token_level_scores": token_scores}

        indices = micro_batch_indices(data, cfg.micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.max_token_len_per_gpu,
                                      self.device)
        return DataProto.from_dict(forward_micro_batches(self.module, data, indices, self.device, step))
