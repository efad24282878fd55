"""RewardWorker: RuleRewardManager (tests/rewards/test_manager.py) as an SPMD worker group, in-process and
as 2 Ray ranks, gives the manager's own scores, texts and whole-batch metrics."""

import pytest
import torch

from rlcore.models.tiny import build_char_tokenizer
from rlcore.protocol import DataProto
from rlcore.rewards import RuleRewardManager
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup
from rlcore.workers.reward import RewardWorker

TOK = build_char_tokenizer()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def response_batch(rows, ground_truths, sources, **non_tensors) -> DataProto:
    """Token-id rows, every token valid, right-padded with PAD (mask 0)."""
    width = max(len(r) for r in rows)
    responses = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return DataProto.from_dict({"responses": responses, "response_mask": mask},
                               {"ground_truth": list(ground_truths), "data_source": list(sources), **non_tensors})


def test_worker_groups_match_the_manager(tmp_path, tiny_model_dir, ray_cluster):
    reward_file = tmp_path / "lengths.py"
    reward_file.write_text("def length_reward(response, ground_truth, **extra):\n    return len(response) / 10\n")
    config = {"model": {"path": tiny_model_dir},
              "reward": {"reward_fn": "arithmetic", "num_workers": 1,
                         "reward_fn_by_source": {"lengthy": f"{reward_file}:length_reward"}}}
    rows = [ids("15") + [EOS], ids("16") + [EOS], ids("abc"), [], ids("7") + [EOS]]
    data = response_batch(rows, ["15", "15", "-", "0", "7"], ["arithmetic", "arithmetic", "lengthy", "lengthy",
                                                               "arithmetic"], uid=["u0", "u1", "u2", "u3", "u4"])
    expected = RuleRewardManager.from_config(config)(data)
    assert torch.equal(expected.batch["reward_scores"], torch.tensor([1.0, 0.0, 0.3, 0.0, 1.0]))

    local = LocalWorkerGroup(ClassWithInitArgs(RewardWorker, config), world_size=1).compute_reward(data)
    pool = RayResourcePool([2], num_cpus_per_process=0.25, name_prefix="reward")
    group = RayWorkerGroup(pool, ClassWithInitArgs(RewardWorker, config), default_timeout=60)
    try:
        # 5 rows over 2 ranks: one padding row, which must not count in the metrics
        remote = group.compute_reward.options(pad=True)(data)
    finally:
        group.shutdown()
    for out in (local, remote):
        assert len(out) == 5
        assert torch.equal(out.batch["token_level_scores"], expected.batch["token_level_scores"])
        assert torch.equal(out.batch["reward_scores"], expected.batch["reward_scores"])
        assert list(out.non_tensor_batch) == ["response_text", "reward_components"]
        assert list(out.non_tensor_batch["reward_components"]) == [{"arithmetic": 1.0}, {"arithmetic": 0.0},
                                                                   {"length_reward": 0.3}, {"length_reward": 0.0},
                                                                   {"arithmetic": 1.0}]
        assert list(out.non_tensor_batch["response_text"]) == ["15", "16", "abc", "", "7"]
        assert out.meta_info == pytest.approx(expected.meta_info)
    assert expected.meta_info["reward/lengthy/mean"] == pytest.approx(0.15)
    assert expected.meta_info["reward/frac_correct"] == pytest.approx(2 / 5)  # 0.3 is partial credit, not correct
    assert data.union(remote).batch["token_level_scores"] is not None  # ready to merge into the batch
