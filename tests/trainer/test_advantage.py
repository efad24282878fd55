"""Driver-side rewards and advantages against hand-computed numbers."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlcore.algos import AdaptiveKLController, register_advantage_estimator
from rlcore.protocol import DataProto
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.config import AlgorithmConfig


def algo(**overrides):
    return OmegaConf.merge(OmegaConf.structured(AlgorithmConfig), overrides)


def batch(scores, mask, uid=None, **tensors):
    non_tensors = {"uid": np.array(uid, dtype=object)} if uid is not None else {}
    return DataProto.from_dict({"token_level_scores": torch.tensor(scores), "response_mask": torch.tensor(mask),
                                **{k: torch.tensor(v) for k, v in tensors.items()}}, non_tensors)


def test_grpo_advantage_is_the_score_normalised_within_its_prompt_group():
    data = batch([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]], [[1, 1], [1, 1], [1, 0], [1, 1]], uid=["a", "a", "b", "b"])
    compute_rewards(data, algo(), kl_ctrl=None)
    compute_advantage(data, algo(adv_estimator="grpo"))
    # group a: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.70711; group b: equal scores -> 0
    a = 0.5 / math.sqrt(0.5)
    expected = torch.tensor([[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(data.batch["advantages"], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(data.batch["returns"], expected, atol=1e-5, rtol=0)


def test_kl_in_reward_subtracts_coef_times_k1_and_reports_the_batch_kl():
    data = batch([[0.0, 1.0]], [[1, 1]], old_log_probs=[[-1.0, -2.0]], ref_log_prob=[[-1.5, -1.0]])
    ctrl = build_kl_controller(algo(kl_ctrl={"type": "fixed", "kl_coef": 0.1}))
    metrics = compute_rewards(data, algo(use_kl_in_reward=True, kl_penalty="kl"), ctrl)
    # k1 = old - ref = [0.5, -1.0]; rewards = scores - 0.1 * k1
    torch.testing.assert_close(data.batch["token_level_rewards"], torch.tensor([[-0.05, 1.1]]))
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(-0.25), "actor/reward_kl_penalty_coeff": 0.1,
                       "check/nan_rewards": 0.0}  # every score finite (rlcore.trainer.consistency.check_rewards)


def test_adaptive_controller_from_config_moves_towards_the_target():
    ctrl = build_kl_controller(algo(kl_ctrl={"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 100}))
    assert isinstance(ctrl, AdaptiveKLController)
    data = batch([[1.0]], [[1]], old_log_probs=[[0.0]], ref_log_prob=[[-1.0]])  # KL 1.0: far above target
    compute_rewards(data, algo(use_kl_in_reward=True), ctrl)
    assert ctrl.value == pytest.approx(0.2 * (1 + 0.2 * 1 / 100))  # error clipped at +0.2, n_steps=1


def test_kl_in_reward_without_a_controller_is_an_error():
    data = batch([[1.0]], [[1]], old_log_probs=[[0.0]], ref_log_prob=[[0.0]])
    with pytest.raises(ValueError, match="KL controller"):
        compute_rewards(data, algo(use_kl_in_reward=True), None)


def test_gae_with_values_and_a_missing_input_named():
    data = batch([[0.0, 1.0]], [[1, 1]], values=[[0.25, 0.5]])
    compute_rewards(data, algo(), None)
    compute_advantage(data, algo(adv_estimator="gae", gamma=1.0, lam=1.0))
    # gamma = lam = 1: A_t = R - V_t = [0.75, 0.5] before whitening; returns = A + V = [1, 1]
    torch.testing.assert_close(data.batch["returns"], torch.tensor([[1.0, 1.0]]))
    no_values = batch([[0.0, 1.0]], [[1, 1]])
    compute_rewards(no_values, algo(), None)
    with pytest.raises(KeyError, match="values"):
        compute_advantage(no_values, algo(adv_estimator="gae"))


def test_a_registered_estimator_gets_what_it_asks_for_by_name():
    seen = {}

    @register_advantage_estimator("test_advantage_spy")
    def spy(token_level_rewards, response_mask, index, gamma):
        seen.update(index=list(index), gamma=gamma)
        return token_level_rewards * 2, token_level_rewards

    data = batch([[0.0, 3.0]], [[1, 1]], uid=["p"])
    compute_rewards(data, algo(), None)
    compute_advantage(data, algo(adv_estimator="test_advantage_spy", gamma=0.5))
    assert seen == {"index": ["p"], "gamma": 0.5}
    assert data.batch["advantages"].tolist() == [[0.0, 6.0]]


@pytest.mark.parametrize("actor, use_kl_in_reward, needed", [
    ({"ppo_epochs": 1, "ppo_mini_batch_size": None}, False, False),  # one step on the whole batch
    ({"ppo_epochs": 1, "ppo_mini_batch_size": 4}, False, False),  # all 4 prompts (32 rows): still the whole batch
    ({"ppo_epochs": 1, "ppo_mini_batch_size": 2}, False, True),  # two steps of 2 prompts (16 rows)
    ({"ppo_epochs": 2, "ppo_mini_batch_size": None}, False, True),
    ({"ppo_epochs": 1, "ppo_mini_batch_size": None}, True, True),  # the KL penalty reads them
])
def test_old_log_probs_are_needed_unless_the_update_is_one_step(actor, use_kl_in_reward, needed):
    cfg = OmegaConf.create({"actor": actor, "data": {"train_batch_size": 4}, "rollout": {"n": 8},
                            "algorithm": {"use_kl_in_reward": use_kl_in_reward}})
    assert needs_old_log_prob(cfg) is needed
