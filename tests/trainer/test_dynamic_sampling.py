"""rlcore.trainer.dapo: dynamic sampling's group collection (which groups a step trains on, how
many rounds it drew), the overlong penalty and mask on the rollout layout, with hand-worked numbers."""

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlcore.algos.advantages import get_advantage_estimator
from rlcore.engines.base import Generation
from rlcore.engines.layout import build_output
from rlcore.protocol import DataProto
from rlcore.trainer.config import ConfigError, load_config
from rlcore.trainer.dapo import (
    GroupCollector,
    add_overlong_penalty,
    check_dapo_config,
    filter_values,
    mask_truncated,
    stop_token_ids,
)

PAD, EOS, N = 0, 2, 2  # two responses per prompt


def rollout_round(scores: list[tuple[float, float]], prompt_width: int, lengths: list[int] | None = None) -> DataProto:
    """A scored round in the rollout layout: one prompt per pair of scores (uid = its row number,
    as prompts_to_proto names them), N responses each of width 4 (length 3 ending in eos by default)."""
    groups = len(scores)
    prompt_ids = torch.full((groups, prompt_width), 7)
    prompts = DataProto.from_dict(
        {"input_ids": prompt_ids, "attention_mask": torch.ones_like(prompt_ids),
         "position_ids": torch.arange(prompt_width).expand(groups, -1).clone()},
        {"uid": np.array([str(i) for i in range(groups)], dtype=object)},
    ).repeat(N)
    rows = groups * N
    lengths = torch.tensor(lengths if lengths is not None else [3] * rows)
    responses = torch.tensor([[5] * 4] * rows)
    responses[torch.arange(rows), (lengths - 1).clamp(max=3)] = torch.where(lengths < 4, EOS, 5)
    out = build_output(prompts, Generation(responses, lengths, torch.zeros(rows, 4)), PAD, 1.0)
    score = torch.tensor([float(s) for pair in scores for s in pair])
    token_scores = torch.zeros(rows, 4)
    token_scores[torch.arange(rows), lengths - 1] = score
    out.union(DataProto.from_dict({"reward_scores": score, "token_level_scores": token_scores}))
    return out


def test_rounds_are_drawn_until_enough_groups_have_signal_and_the_batch_is_exactly_that_many():
    collector = GroupCollector(num_groups=3, pad_token_id=PAD)
    first = rollout_round([(1, 1), (0, 1), (0, 0), (1, 0)], prompt_width=2)  # groups 1 and 3 differ
    collector.add(first, filter_values(first, "score"))
    assert (collector.rounds, collector.kept_groups, collector.full) == (1, 2, False)
    second = rollout_round([(0, 1), (1, 1), (1, 0), (0, 0)], prompt_width=3)  # groups 0 and 2 differ
    collector.add(second, filter_values(second, "score"))
    assert (collector.rounds, collector.kept_groups, collector.full) == (2, 4, True)

    batch, metrics = collector.batch()
    # the first three kept groups in draw order; round 2's group 2 is the surplus
    assert batch.non_tensor_batch["uid"].tolist() == ["1/1", "1/1", "1/3", "1/3", "2/0", "2/0"]
    assert batch.batch["reward_scores"].tolist() == [0, 1, 1, 0, 0, 1]
    assert metrics == {"dynamic_sampling/gen_rounds": 2.0, "dynamic_sampling/prompts_drawn": 8.0,
                       "dynamic_sampling/groups_kept_frac": 0.5, "dynamic_sampling/groups_dropped_frac": 0.5,
                       "dynamic_sampling/topped_up_groups": 0.0, "dynamic_sampling/surplus_groups": 1.0}
    # round 1's prompts were 2 wide: left-padded to round 2's 3, responses and masks unchanged
    assert batch.batch["input_ids"].shape == (6, 3 + 4)
    assert batch.batch["attention_mask"][:, :3].tolist() == [[0, 1, 1]] * 4 + [[1, 1, 1]] * 2
    assert batch.batch["response_mask"].sum(-1).tolist() == [3] * 6


def test_round_cap_tops_the_batch_up_with_dropped_groups_whose_advantage_is_zero():
    collector = GroupCollector(num_groups=3, pad_token_id=PAD)
    only = rollout_round([(0, 0), (1, 0), (1, 1), (0, 0)], prompt_width=2)  # one group with signal
    collector.add(only, filter_values(only, "score"))
    batch, metrics = collector.batch()  # the recipe stops at max_num_gen_batches=1
    assert batch.non_tensor_batch["uid"].tolist() == ["1/1", "1/1", "1/0", "1/0", "1/2", "1/2"]
    assert metrics["dynamic_sampling/topped_up_groups"] == 2.0
    assert metrics["dynamic_sampling/groups_kept_frac"] == 0.25
    grpo = get_advantage_estimator("grpo")
    adv, _ = grpo(token_level_rewards=batch.batch["token_level_scores"], response_mask=batch.batch["response_mask"],
                  index=batch.non_tensor_batch["uid"])
    assert adv[:2].abs().sum() > 0 and adv[2:].abs().sum() == 0  # the top-up adds no gradient


def test_without_a_filter_every_group_of_one_round_is_kept():
    collector = GroupCollector(num_groups=4, pad_token_id=PAD)
    collector.add(rollout_round([(0, 0), (1, 0), (1, 1), (0, 0)], prompt_width=2), None)
    assert collector.full
    batch, metrics = collector.batch()
    assert len(batch) == 8 and metrics["dynamic_sampling/groups_dropped_frac"] == 0.0


def test_overlong_penalty_lands_on_the_last_token_and_the_reward_metric_sees_it():
    batch = rollout_round([(1, 1), (0, 1)], prompt_width=2, lengths=[1, 2, 3, 4])
    add_overlong_penalty(batch, max_len=4, buffer_len=2, penalty_factor=1.0)  # free up to 2, then -0.5, -1
    assert batch.batch["overlong_penalty"].tolist() == [0.0, 0.0, -0.5, -1.0]
    assert batch.batch["token_level_scores"].tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, -0.5, 0], [0, 0, 0, 0]]
    assert batch.batch["reward_scores"].tolist() == [1, 1, 0, 1]  # the rule score is kept apart
    # group 0 (1, 1) still ties on the score, but not on the penalised reward
    assert filter_values(batch, "score").tolist() == [1, 1, 0, 1]
    assert filter_values(batch, "reward").tolist() == [1, 1, -0.5, 0]


def test_overlong_filter_zeroes_the_loss_mask_of_cut_responses_only():
    batch = rollout_round([(1, 0), (0, 1)], prompt_width=2, lengths=[3, 4, 4, 2])
    batch.batch["responses"][1, 3] = EOS  # row 1 ended with eos at the limit: finished
    cut = mask_truncated(batch, max_len=4, stop_ids=[EOS])
    assert cut.tolist() == [False, False, True, False]
    assert batch.batch["response_mask"].sum(-1).tolist() == [3, 4, 0, 2]
    assert batch.batch["attention_mask"][:, 2:].sum(-1).tolist() == [3, 4, 4, 2]  # the forward pass is unchanged


def test_stop_ids_follow_the_engines_stopping_rule(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 11]}))
    tokenizer = type("Tok", (), {"eos_token_id": 2})()
    cfg = OmegaConf.create({"model": {"path": str(tmp_path)}, "rollout": {"stop_token_ids": [40], "ignore_eos": False}})
    assert stop_token_ids(cfg, tokenizer) == [2, 11, 40]
    cfg.rollout.ignore_eos = True
    assert stop_token_ids(cfg, tokenizer) == [40]


def test_settings_dapo_cannot_run_with_are_refused():
    sections = ["rollout", "algorithm"]
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        check_dapo_config(load_config({"rollout": {"n": 1}, "algorithm": {"filter_groups": {"enable": True}}}, sections))
    with pytest.raises(ConfigError, match="exceeds rollout.max_new_tokens"):
        check_dapo_config(load_config({"rollout": {"n": 2, "max_new_tokens": 4},
                                       "algorithm": {"overlong_buffer": {"enable": True, "len": 5}}}, sections))
    with pytest.raises(ConfigError, match="max_num_gen_batches must be >= 1"):
        load_config({"algorithm": {"filter_groups": {"max_num_gen_batches": 0}}}, sections)
