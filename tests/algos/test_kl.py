"""rlcore.algos.kl: the k1/k2/k3 estimators, the KL controllers, the KL-in-reward penalty."""

import math

import pytest
import torch
from algo_refs import close

from rlcore.algos import kl


def test_kl_penalty_kinds_on_hand_numbers():
    logp = torch.tensor([-1.0, -2.0, -6.0])
    ref = torch.tensor([-1.5, -1.0, -1.0])  # logp - ref = 0.5, -1, -5
    close(kl.kl_penalty(logp, ref, "k1"), [0.5, -1.0, -5.0])
    close(kl.kl_penalty(logp, ref, "kl"), [0.5, -1.0, -5.0])
    close(kl.kl_penalty(logp, ref, "abs"), [0.5, 1.0, 5.0])
    close(kl.kl_penalty(logp, ref, "k2"), [0.125, 0.5, 12.5])
    close(kl.kl_penalty(logp, ref, "mse"), [0.125, 0.5, 12.5])
    # k3: exp(d) - d - 1 with d = ref - logp = -0.5, 1, 5 (e^5 - 6 = 142.4 -> clamped to 10)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.e - 2, 10.0]
    close(kl.kl_penalty(logp, ref, "k3"), k3)
    close(kl.kl_penalty(logp, ref, "low_var_kl"), k3)
    with pytest.raises(ValueError, match="unknown kl_penalty kind"):
        kl.kl_penalty(logp, ref, "k4")
    assert set(kl.KL_KINDS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"}  # each checked above


def test_k3_gradient_stays_finite_for_huge_log_ratio():
    logp = torch.tensor([-200.0, -1.0], requires_grad=True)
    kl.kl_penalty(logp, torch.tensor([0.0, -1.5]), "k3").sum().backward()
    assert torch.isfinite(logp.grad).all()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1 at ref - logp = -0.5
    close(logp.grad[1], 1 - math.exp(-0.5))


def test_adaptive_kl_controller_update_formula_and_state():
    ctl = kl.get_kl_controller("adaptive", init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error = clip(9/6 - 1) = 0.2
    close(ctl.value, 0.2 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=5.4, n_steps=100)  # error = -0.1
    expected = 0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000)
    close(ctl.value, expected)
    restored = kl.AdaptiveKLController(init_kl_coef=1.0, target_kl=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    close(restored.value, expected)

    fixed = kl.get_kl_controller("fixed", kl_coef=0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="known: fixed, adaptive"):
        kl.get_kl_controller("pid")
    with pytest.raises(ValueError, match="target_kl"):
        kl.AdaptiveKLController(0.1, 0.0, 10)


def test_apply_kl_penalty_rewards_metrics_and_controller_update():
    scores = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    logp = torch.tensor([[-1.0, -1.0, float("inf")], [-2.0, -2.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -2.0, -2.0]])  # k1: [0.5, 1, -], [-1, 0, 0]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ctl = kl.AdaptiveKLController(init_kl_coef=0.1, target_kl=1.0, horizon=100)
    rewards, metrics = kl.apply_kl_penalty(scores, logp, ref, mask, ctl, kind="k1")
    close(rewards, [[-0.05, 0.9, 0.0], [2.1, 0.0, 0.0]])
    batch_kl = ((0.5 + 1.0) / 2 + (-1.0) / 3) / 2
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(batch_kl)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    error = max(batch_kl / 1.0 - 1, -0.2)
    close(ctl.value, 0.1 * (1 + error * 2 / 100))
