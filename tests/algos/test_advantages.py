"""rlcore.algos.advantages: every registered estimator against references computed by hand or by plain loops."""

import math

import numpy as np
import pytest
import torch
from algo_refs import PAD, close, whiten_ref

from rlcore.algos import advantages as adv_mod
from rlcore.algos import get_advantage_estimator, register_advantage_estimator


def gae_ref(rewards, values, mask, gamma, lam):
    """Plain GAE over the valid positions of each row only."""
    adv_out, ret_out = [], []
    for r, v, m in zip(rewards, values, mask):
        idx = [t for t, keep in enumerate(m) if keep]
        adv_row, ret_row = [0.0] * len(m), [0.0] * len(m)
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            adv_row[t], ret_row[t] = last, last + v[t]
        adv_out.append(adv_row)
        ret_out.append(ret_row)
    return adv_out, ret_out


@pytest.mark.parametrize("mask", [[[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 0, 1, 1], [1, 1, 0, 0]]])
def test_gae_matches_python_loop_with_padding(mask):
    rewards = [[0.1, -0.2, 1.0, PAD], [0.3, 0.5, PAD, PAD]]
    values = [[0.5, 0.4, 0.2, PAD], [0.1, -0.3, PAD, PAD]]
    if mask[0][1] == 0:  # interior masked token (e.g. tool output): skipped, not a value source
        values[0][1], rewards[0][1] = PAD, PAD
    exp_adv, exp_ret = gae_ref(rewards, values, mask, gamma=0.9, lam=0.8)
    kw = dict(token_level_rewards=torch.tensor(rewards), values=torch.tensor(values),
              response_mask=torch.tensor(mask, dtype=torch.float32), gamma=0.9, lam=0.8)

    adv, ret = adv_mod.compute_gae_advantage_return(**kw, whiten=False)
    close(adv, exp_adv)
    close(ret, exp_ret)

    adv_w, ret_w = get_advantage_estimator("gae")(**kw)  # whiten=True by default
    close(ret_w, exp_ret)
    flat = [a for row, m in zip(exp_adv, mask) for a, keep in zip(row, m) if keep]
    white = iter(whiten_ref(flat))
    close(adv_w, [[next(white) if keep else 0.0 for keep in m] for m in mask], atol=1e-4)


def test_gae_hand_numbers_single_row():
    # gamma=0.9, lam=0.8, V=[1, 2], r=[0, 1], last token bootstraps from 0:
    # delta1 = 1 - 2 = -1 ; delta0 = 0 + 0.9*2 - 1 = 0.8 ; A0 = 0.8 + 0.72*(-1) = 0.08
    adv, ret = adv_mod.compute_gae_advantage_return(
        torch.tensor([[0.0, 1.0, PAD]]), torch.tensor([[1.0, 2.0, PAD]]), torch.tensor([[1, 1, 0]]),
        gamma=0.9, lam=0.8, whiten=False)
    close(adv, [[0.08, -1.0, 0.0]])
    close(ret, [[1.08, 1.0, 0.0]])


def outcome_batch():
    """Five sequences of different lengths; the score sits on the last valid token.
    Groups: a -> scores [1, 0, 2], b -> [3, 1], c -> [5] (a singleton)."""
    index = np.array(["a", "b", "a", "b", "a", "c"], dtype=object)
    scores = [1.0, 3.0, 0.0, 1.0, 2.0, 5.0]
    lengths = [3, 1, 2, 3, 2, 2]
    T = 4
    rewards = torch.zeros(len(scores), T)
    mask = torch.zeros(len(scores), T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        rewards[i, n - 1] = s
        mask[i, :n] = 1
    return rewards, mask, index


def broadcast_ref(per_seq, mask):
    return [[a if keep else 0.0 for keep in m] for a, m in zip(per_seq, mask.tolist())]


def test_grpo_two_groups_and_singleton():
    rewards, mask, index = outcome_batch()
    eps = 1e-6
    # group a: scores 1, 0, 2 -> mean 1, unbiased std 1; group b: 3, 1 -> mean 2, std sqrt(2);
    # group c: singleton -> mean 0, std 1.
    s2 = math.sqrt(2.0)
    expected = [0.0, 1 / (s2 + eps), -1 / (1 + eps), -1 / (s2 + eps), 1 / (1 + eps), 5 / (1 + eps)]
    adv, ret = get_advantage_estimator("grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, broadcast_ref(expected, mask))
    close(ret, adv)
    # index given as a plain list of uids gives the same
    adv_list, _ = adv_mod.compute_grpo_outcome_advantage(rewards, mask, list(index))
    close(adv_list, adv)
    with pytest.raises(ValueError, match="one group id per sequence"):
        adv_mod.compute_grpo_outcome_advantage(rewards, mask, index[:3])


def test_dr_grpo_drops_std():
    rewards, mask, index = outcome_batch()
    expected = [0.0, 1.0, -1.0, -1.0, 1.0, 5.0]
    adv, _ = get_advantage_estimator("dr_grpo")(token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, broadcast_ref(expected, mask))
    adv2, _ = adv_mod.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)
    close(adv2, adv)


def test_rloo_leave_one_out_baseline():
    rewards, mask, index = outcome_batch()
    # a: 1-(0+2)/2=0, 0-(1+2)/2=-1.5, 2-(1+0)/2=1.5 ; b: 3-1=2, 1-3=-2 ; c: no others -> 5
    expected = [0.0, 2.0, -1.5, -2.0, 1.5, 5.0]
    adv, ret = get_advantage_estimator("rloo")(token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, broadcast_ref(expected, mask))
    close(ret, adv)


def test_reinforce_plus_plus_return_to_go_and_whitening():
    rewards = torch.tensor([[1.0, 0.0, 2.0, PAD], [0.0, 3.0, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # gamma 0.5: row0 G2=2, G1=0+0.5*2=1, G0=1+0.5*1=1.5 ; row1 G1=3, G0=1.5
    expected_ret = [[1.5, 1.0, 2.0, 0.0], [1.5, 3.0, 0.0, 0.0]]
    adv, ret = get_advantage_estimator("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    close(ret, expected_ret)
    w = whiten_ref([1.5, 1.0, 2.0, 1.5, 3.0])
    close(adv, [[w[0], w[1], w[2], 0.0], [w[3], w[4], 0.0, 0.0]], atol=1e-4)


def test_reinforce_plus_plus_baseline():
    rewards, mask, index = outcome_batch()
    centred = [0.0, 1.0, -1.0, -1.0, 1.0, 5.0]  # score minus group mean (a singleton's mean is 0)
    flat = [c for c, m in zip(centred, mask.tolist()) for keep in m if keep]
    white = iter(whiten_ref(flat))
    expected = [[next(white) if keep else 0.0 for keep in m] for m in mask.tolist()]
    adv, _ = get_advantage_estimator("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=index)
    close(adv, expected, atol=1e-4)


def test_remax_subtracts_greedy_baseline():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = get_advantage_estimator("remax")(
        token_level_rewards=rewards, reward_baselines=torch.tensor([0.25, 1.0]), response_mask=mask)
    close(ret, [[1.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    close(adv, [[0.75, 0.75, 0.75, 0.0], [-0.5, -1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="reward_baselines"):
        adv_mod.compute_remax_outcome_advantage(rewards, torch.tensor([0.25]), mask)


def test_registry_rejects_unknown_and_duplicate_names():
    with pytest.raises(ValueError, match="known:.*grpo"):
        get_advantage_estimator("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae")(lambda: None)
