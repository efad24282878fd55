"""rlcore.algos.preference: DPO/IPO on hand numbers, best/worst pairs, the dpo policy loss (DP-invariance),
and the Bradley-Terry reward-model loss."""

import math

import numpy as np
import pytest
import torch
from algo_refs import close

from rlcore.algos.losses import LossScale, PolicyLossConfig, PolicyLossInput, get_policy_loss
from rlcore.algos.preference import best_worst_pairs, bradley_terry_loss, compute_dpo_loss, dpo_policy_loss
from rlcore.protocol import DataProto


def test_best_worst_pairs_per_prompt_skips_ties():
    data = DataProto.from_dict({"row": torch.arange(6)}, {"uid": ["a", "a", "a", "b", "b", "c"]})
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 0.3])
    pairs = best_worst_pairs(data, scores)
    assert pairs.batch["row"].tolist() == [1, 0]  # a: best row 1, worst row 0; b ties; c has one sample
    with pytest.raises(ValueError, match=r"scores must have shape \(6,\)"):
        best_worst_pairs(data, scores[:3])


def dpo(log_prob, mask, data, scale=LossScale()):
    """The registered dpo loss as the actor calls it: the micro-batch rides in PolicyLossInput.data."""
    inp = PolicyLossInput(log_prob, log_prob.detach(), None, mask, scale=scale, data=data)
    return get_policy_loss("dpo")(inp, PolicyLossConfig(policy_loss="dpo"))


def pair_batch(seed=0):
    g = torch.Generator(torch.get_default_device()).manual_seed(seed)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    data = DataProto.from_dict({"ref_log_prob": -torch.rand(4, 3, generator=g)}, {"uid": ["p", "p", "q", "q"]},
                               {"dpo_beta": 0.5})
    return data, -torch.rand(4, 3, generator=g, requires_grad=False), mask


def test_dpo_loss_equals_hand_sums():
    data, log_prob, mask = pair_batch()
    loss, metrics = dpo(log_prob, mask, data)
    s, r = (log_prob * mask).sum(-1), (data.batch["ref_log_prob"] * mask).sum(-1)
    logits = (s[0::2] - s[1::2]) - (r[0::2] - r[1::2])
    expected = -torch.nn.functional.logsigmoid(0.5 * logits).mean()
    assert torch.allclose(loss, expected)
    ref_loss, _ = compute_dpo_loss(s[0::2], s[1::2], r[0::2], r[1::2], beta=0.5)
    assert torch.allclose(loss, ref_loss) and "dpo/accuracy" in metrics


def test_dpo_contributions_sum_to_the_global_mean():
    data, log_prob, mask = pair_batch()
    whole, _ = dpo(log_prob, mask, data)
    # 2 ranks with one pair each: each contributes loss * 1 / (4 / 2) * 2; ranks are averaged.
    parts = [dpo(log_prob[i:i + 2], mask[i:i + 2], data[i:i + 2], LossScale(global_seqs=4, dp_size=2))[0]
             for i in (0, 2)]
    assert torch.allclose(sum(parts) / 2, whole)


def test_dpo_loss_refuses_split_or_shuffled_pairs():
    data, log_prob, mask = pair_batch()
    with pytest.raises(ValueError, match="whole \\(chosen, rejected\\) pairs"):
        dpo(log_prob[:3], mask[:3], data[:3])
    shuffled = data[np.array([0, 2, 1, 3])]
    with pytest.raises(ValueError, match="rows of different prompts paired together"):
        dpo(log_prob, mask, shuffled)
    with pytest.raises(ValueError, match="PolicyLossInput.data is None"):
        dpo(log_prob, mask, None)


def test_dpo_loss_declares_the_batch_keys_it_reads():
    assert get_policy_loss("dpo") is dpo_policy_loss
    assert dpo_policy_loss.batch_keys == ("ref_log_prob",)


# ------------------------------------------------------------------ DPO / IPO on hand numbers


def dpo_inputs():
    # logits = (pc - pr) - (rc - rr) = [2, -1]
    return (torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]),
            torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]))


def test_dpo_sigmoid_with_label_smoothing():
    def nls(x):  # -logsigmoid(x)
        return math.log1p(math.exp(-x))

    loss, m = compute_dpo_loss(*dpo_inputs(), beta=0.5)
    close(loss, (nls(1.0) + nls(-0.5)) / 2)
    assert m["dpo/reward_chosen"] == pytest.approx(0.25)  # 0.5 * [1, 0]
    assert m["dpo/reward_rejected"] == pytest.approx(0.0)  # 0.5 * [-1, 1]
    assert m["dpo/reward_margin"] == pytest.approx(0.25)  # mean of [1, -0.5]
    assert m["dpo/accuracy"] == pytest.approx(0.5)

    smooth, _ = compute_dpo_loss(*dpo_inputs(), beta=0.5, label_smoothing=0.1)
    close(smooth, (0.9 * nls(1.0) + 0.1 * nls(-1.0) + 0.9 * nls(-0.5) + 0.1 * nls(0.5)) / 2)


def test_dpo_ipo_and_errors():
    loss, _ = compute_dpo_loss(*dpo_inputs(), beta=0.5, loss_type="ipo")
    close(loss, ((2 - 1) ** 2 + (-1 - 1) ** 2) / 2)  # target margin 1 / (2 * 0.5) = 1
    with pytest.raises(ValueError, match="loss_type"):
        compute_dpo_loss(*dpo_inputs(), loss_type="hinge2")
    with pytest.raises(ValueError, match="sigmoid loss only"):
        compute_dpo_loss(*dpo_inputs(), loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        compute_dpo_loss(*(t.unsqueeze(0) for t in dpo_inputs()))


def test_bradley_terry_loss_equals_hand_numbers():
    """-log sigmoid(margin) = log(1 + exp(-margin)); margins 1, -2 and a tie (0, not counted as right)."""
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 2.0, 2.0])
    per_pair = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(2.0)), math.log(2.0)]  # 0.3133, 2.1269, 0.6931
    loss, m = bradley_terry_loss(chosen, rejected)
    assert loss.item() == pytest.approx(sum(per_pair) / 3, rel=1e-6)  # 1.04445
    assert m["accuracy"] == pytest.approx(1 / 3) and m["margin"] == pytest.approx(-1 / 3)
    assert m["chosen_score"] == pytest.approx(1.0) and m["rejected_score"] == pytest.approx(4 / 3)
    # a micro-batch's share of a 4-pair (8-sequence) mini-batch on 2 ranks: sum / 4 pairs * 2
    share, _ = bradley_terry_loss(chosen, rejected, LossScale(global_seqs=8, dp_size=2))
    assert share.item() == pytest.approx(sum(per_pair) / 4 * 2, rel=1e-6)  # 1.56667


def test_bradley_terry_gradient_and_errors():
    chosen = torch.tensor([0.5, -1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 1.0], requires_grad=True)
    loss, _ = bradley_terry_loss(chosen, rejected)
    loss.backward()
    # d/dc of mean -log sigmoid(c - r) = -(1 - sigmoid(c - r)) / P = -sigmoid(r - c) / 2
    expected = [-1 / (1 + math.exp(0.5)) / 2, -1 / (1 + math.exp(-2.0)) / 2]
    assert chosen.grad.tolist() == pytest.approx(expected, rel=1e-6)
    assert rejected.grad.tolist() == pytest.approx([-g for g in expected], rel=1e-6)
    with pytest.raises(ValueError, match="shape"):
        bradley_terry_loss(torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="global_seqs must be > 0"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(2), LossScale(global_seqs=0))
