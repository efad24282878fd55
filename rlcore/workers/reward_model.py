"""RewardModelWorker: scores whole sequences with a learned reward model (no grad), FSDP2-sharded.

The reward model is a decoder with a scalar head (``AutoModelForSequenceClassification`` with
one label, whose head is ``score``). HF's own pooling picks the last token that is not the pad
id; we pool at the last position the attention mask marks instead, which stays right however the
batch is padded and whatever ids the padding holds. The reward model must share the policy's
tokenizer: input_ids are scored as they are.

Config: sections ``model`` and ``reward_model`` (``trainer.device`` picks the device); an unknown
key in either is an error naming it.

    key                                   default      meaning
    model.path                            (required)   local HF directory of the reward model
    model.dtype                           "float32"    parameter dtype
    reward_model.micro_batch_size_per_gpu 4            rows per forward on one rank
    reward_model.use_dynamic_bsz          False        micro-batches packed by token count instead
    reward_model.max_token_len_per_gpu    16384        token budget of a dynamic micro-batch

Data read: input_ids, attention_mask, position_ids, responses.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from omegaconf import DictConfig

from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, Worker, register
from rlcore.workers.fsdp_utils import (
    ScalarHeadModel,
    apply_fsdp2,
    forward_micro_batches,
    micro_batch_indices,
    resolve_config,
    resolve_dtype,
    setup_worker,
)

RM_MODEL_DEFAULTS = {"path": None, "dtype": "float32"}
RM_DEFAULTS = {"micro_batch_size_per_gpu": 4, "use_dynamic_bsz": False, "max_token_len_per_gpu": 16384}
INPUT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]


class RewardModelWorker(Worker):
    def __init__(self, config: Mapping | DictConfig) -> None:
        self.config = resolve_config(config, {"model": RM_MODEL_DEFAULTS, "reward_model": RM_DEFAULTS})

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoModelForSequenceClassification

        model_cfg = self.config.model
        self.device = setup_worker(self, self.config, seed=0)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_cfg.path, num_labels=1, dtype=resolve_dtype(model_cfg.dtype)
        )
        if not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise ValueError(f"{type(model).__name__} has no linear `score` head: expected a decoder reward model")
        module = ScalarHeadModel(model.base_model, model.score).requires_grad_(False)
        self.module = apply_fsdp2(module, self.device).eval()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B,) and ``token_level_scores`` (B, T_r): the score on the last valid response token."""
        cfg = self.config.reward_model
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

        indices = micro_batch_indices(data, cfg.micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.max_token_len_per_gpu)
        return DataProto.from_dict(forward_micro_batches(self.module, data, indices, self.device, step))
