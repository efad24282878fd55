"""Validation and batch metrics against hand-counted numbers; validation of a batch that does not
divide across two ranks (padded for the dispatch, the padding dropped before scoring)."""

import numpy as np
import pytest
import torch

from rlcore.models.tiny import build_char_tokenizer
from rlcore.protocol import DataProto
from rlcore.rewards.manager import RuleRewardManager
from rlcore.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, Worker, register
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate

TOK = build_char_tokenizer()


class ScriptedRollout(Worker):
    """Answers each prompt with its ``script`` column (plus eos), right-padded to 4 tokens."""

    @register(Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        rows = [TOK(s)["input_ids"] + [TOK.eos_token_id] for s in prompts.non_tensor_batch["script"]]
        responses = torch.tensor([r + [TOK.pad_token_id] * (4 - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (4 - len(r)) for r in rows])
        assert prompts.meta_info["validate"] is True
        return DataProto.from_dict({"responses": responses, "response_mask": mask}, dict(prompts.non_tensor_batch))


def prompts(scripts, truths):
    n = len(scripts)
    return DataProto.from_dict({"input_ids": torch.ones(n, 2, dtype=torch.long)},
                               {"script": scripts, "ground_truth": truths, "data_source": ["arithmetic"] * n},
                               {"validate": True})


def test_validate_scores_greedy_responses_over_all_batches_on_two_ranks():
    group = LocalWorkerGroup(ClassWithInitArgs(ScriptedRollout), world_size=2)
    reward = RuleRewardManager(TOK, num_workers=0)
    batches = [prompts(["5", "12", "7"], ["5", "12", "8"]), prompts(["3"], ["4"])]  # 3 rows: padded to 4
    metrics = validate(group, batches, reward)
    assert metrics["val/reward_mean"] == pytest.approx(2 / 4)
    assert metrics["val/reward_std"] == pytest.approx(0.5)
    assert metrics["val/response_length_mean"] == pytest.approx((2 + 3 + 2 + 2) / 4)  # eos included
    assert metrics["val/response_length_max"] == 3


def test_batch_metrics_by_hand():
    data = DataProto.from_dict({
        "prompts": torch.tensor([[0, 7], [7, 7]]),
        "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]),
        "response_mask": torch.tensor([[1, 1], [1, 0]]),
        "token_level_scores": torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
        "advantages": torch.tensor([[1.0, 2.0], [3.0, 9.0]]),  # 9.0 sits under the mask
        "old_log_probs": torch.zeros(2, 2),
        "ref_log_prob": torch.tensor([[-1.0, -1.0], [-2.0, 5.0]]),
    }, {"uid": np.array(["a", "b"], dtype=object)}, {"rollout/tokens_per_s": 5.0, "temperature": 1.0})
    m = batch_metrics(data)
    assert (m["reward/score/mean"], m["reward/score/max"], m["reward/score/std"]) == (0.5, 1.0, 0.5)
    assert (m["critic/advantages/mean"], m["critic/advantages/max"], m["critic/advantages/min"]) == (2.0, 3.0, 1.0)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/clip_ratio"]) == (1.5, 2, 0.5)
    assert (m["prompt_length/mean"], m["prompt_length/min"]) == (1.5, 1)
    assert m["rollout/tokens_per_s"] == 5.0 and "temperature" not in m
    assert m["actor/kl_old_ref"] == pytest.approx(4 / 3)  # (1 + 1 + 2) / 3 valid tokens
    assert "critic/values/mean" not in m and "reward/rewards/mean" not in m


def test_mean_over_ranks():
    assert mean_over_ranks([{"a": 1.0, "b": 4.0}, {"a": 3.0, "b": 0.0}]) == {"a": 2.0, "b": 2.0}
