"""Online-DPO pieces: best/worst pairs and the dpo policy loss (hand numbers, DP-invariance)."""

import numpy as np
import pytest
import torch

from rlcore.protocol import DataProto
from rlcore.trainer.core_algos import compute_dpo_loss, get_policy_loss
from rlcore.algos.preference import best_worst_pairs


def test_best_worst_pairs_per_prompt_skips_ties():
    data = DataProto.from_dict({"row": torch.arange(6)}, {"uid": ["a", "a", "a", "b", "b", "c"]})
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 0.3])
    pairs = best_worst_pairs(data, scores)
    assert pairs.batch["row"].tolist() == [1, 0]  # a: best row 1, worst row 0; b ties; c has one sample
    with pytest.raises(ValueError, match=r"scores must have shape \(6,\)"):
        best_worst_pairs(data, scores[:3])


def pair_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    data = DataProto.from_dict({"ref_log_prob": -torch.rand(4, 3, generator=g)}, {"uid": ["p", "p", "q", "q"]},
                               {"dpo_beta": 0.5})
    return data, -torch.rand(4, 3, generator=g, requires_grad=False), mask


def test_dpo_loss_equals_hand_sums():
    data, log_prob, mask = pair_batch()
    loss, metrics = get_policy_loss("dpo")(log_prob, None, None, mask, data=data)
    s, r = (log_prob * mask).sum(-1), (data.batch["ref_log_prob"] * mask).sum(-1)
    logits = (s[0::2] - s[1::2]) - (r[0::2] - r[1::2])
    expected = -torch.nn.functional.logsigmoid(0.5 * logits).mean()
    assert torch.allclose(loss, expected)
    ref_loss, _ = compute_dpo_loss(s[0::2], s[1::2], r[0::2], r[1::2], beta=0.5)
    assert torch.allclose(loss, ref_loss) and "dpo/accuracy" in metrics


def test_dpo_contributions_sum_to_the_global_mean():
    data, log_prob, mask = pair_batch()
    fn = get_policy_loss("dpo")
    whole, _ = fn(log_prob, None, None, mask, data=data)
    # 2 ranks with one pair each: each contributes loss * 1 / (4 / 2) * 2; ranks are averaged.
    parts = [fn(log_prob[i:i + 2], None, None, mask[i:i + 2], data=data[i:i + 2], global_seqs=4, dp_size=2)[0]
             for i in (0, 2)]
    assert torch.allclose(sum(parts) / 2, whole)


def test_dpo_loss_refuses_split_or_shuffled_pairs():
    data, log_prob, mask = pair_batch()
    fn = get_policy_loss("dpo")
    with pytest.raises(ValueError, match="whole \\(chosen, rejected\\) pairs"):
        fn(log_prob[:3], None, None, mask[:3], data=data[:3])
    shuffled = data[np.array([0, 2, 1, 3])]
    with pytest.raises(ValueError, match="rows of different prompts paired together"):
        fn(log_prob, None, None, mask, data=shuffled)
