"""rlcore.algos.stats: masked statistics, log-probs and entropy against hand-computed numbers."""

import math

import pytest
import torch
from algo_refs import PAD, close

from rlcore.algos import stats


def test_masked_stats_ignore_padding_and_match_hand_values():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), PAD]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(stats.masked_sum(x, mask), 6.0)
    close(stats.masked_mean(x, mask), 2.0)
    close(stats.masked_mean(x, mask, dim=-1), [1.5, 3.0])
    close(stats.masked_var(x, mask), 1.0)  # (1 + 0 + 1) / (3 - 1)
    close(stats.masked_var(x, mask, unbiased=False), 2.0 / 3.0)
    close(stats.masked_whiten(x, mask), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], atol=1e-4)
    close(stats.masked_whiten(x, mask, shift_mean=False), [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]], atol=1e-4)
    close(stats.masked_mean(x, torch.zeros_like(mask)), 0.0)
    with pytest.raises(ValueError, match="no entries"):
        stats.masked_var(x, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shape"):
        stats.masked_sum(x, mask[:, :2])


def test_logprobs_and_entropy_from_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)], [1.0, 1.0]]])  # (1, 2, V=2)
    labels = torch.tensor([[1, 0]])
    close(stats.logprobs_from_logits(logits, labels), [[math.log(0.75), math.log(0.5)]])
    close(stats.entropy_from_logits(logits), [[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]])

    torch.manual_seed(0)
    big = torch.randn(3, 5, 11) * 4
    lab = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(big.double(), -1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
    close(stats.logprobs_from_logits(big, lab), ref)
    bf16 = stats.logprobs_from_logits(big.bfloat16(), lab)
    assert bf16.dtype == torch.bfloat16
    close(bf16.float(), ref, atol=0.1)
    with pytest.raises(ValueError, match="labels shape"):
        stats.logprobs_from_logits(big, lab[:, :4])




def test_check_same_shape_names_both_tensors():
    stats.check_same_shape("a", torch.zeros(2, 3), "b", torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"a has shape \(2, 3\) but b has shape \(3,\)"):
        stats.check_same_shape("a", torch.zeros(2, 3), "b", torch.zeros(3))
