"""rlcore.algos.sampling: the trainer's top-k / top-p filter, by hand and against HF's warpers."""

import math

import pytest
import torch
from algo_refs import close
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from rlcore.algos.sampling import filter_logits, kept_tokens, sampling_filter_active
from rlcore.algos.stats import entropy_from_logits, logprobs_from_logits

PROBS = [0.1, 0.4, 0.2, 0.3]


def log_probs(top_k=0, top_p=1.0, labels=None):
    logits = torch.log(torch.tensor([PROBS]))
    return torch.log_softmax(filter_logits(logits, top_k, top_p, labels), dim=-1)[0]


def test_top_k_then_top_p_by_hand():
    inf = float("-inf")
    close(log_probs(), torch.log(torch.tensor(PROBS)))  # no filter: untouched
    close(log_probs(top_k=2), [inf, math.log(4 / 7), inf, math.log(3 / 7)])
    # top-p 0.75: ascending 0.1, 0.2, 0.3, 0.4 has cumulative mass 0.1, 0.3, ...: only 0.1 is <= 0.25
    close(log_probs(top_p=0.75), [inf, math.log(4 / 9), math.log(2 / 9), math.log(3 / 9)])
    close(log_probs(top_p=0.35), [inf, 0.0, inf, inf])  # 0.1, 0.3, 0.6 <= 0.65: the top token alone
    # top-k 3 first (0.4, 0.3, 0.2, renormalised to 4/9, 3/9, 2/9), then top-p 0.75 on that:
    # 2/9 <= 0.25 goes too, so the order matters
    close(log_probs(top_k=3, top_p=0.75), [inf, math.log(4 / 7), inf, math.log(3 / 7)])
    # a label is kept whatever the filters say: 0.1 next to 0.4 and 0.3
    close(log_probs(top_k=2, labels=torch.tensor([0])), [math.log(0.125), math.log(0.5), inf, math.log(0.375)])
    # ties at the k-th logit are kept, as in HF and vLLM
    assert kept_tokens(torch.tensor([1.0, 2.0, 2.0, 0.0]), top_k=1).tolist() == [False, True, True, False]
    assert not sampling_filter_active(0, 1.0) and sampling_filter_active(5, 1.0) and sampling_filter_active(0, 0.9)
    with pytest.raises(ValueError, match="top_p"):
        kept_tokens(torch.zeros(3), top_p=0.0)


def test_filtered_log_prob_and_entropy_gradients_are_those_of_the_truncated_distribution():
    logits = torch.log(torch.tensor([PROBS])).requires_grad_(True)
    filtered = filter_logits(logits, top_k=2)
    lp = logprobs_from_logits(filtered, torch.tensor([1]))
    close(lp, [math.log(4 / 7)])
    lp.sum().backward()
    close(logits.grad, [[0.0, 1 - 4 / 7, 0.0, -3 / 7]])  # one-hot minus the truncated probabilities
    logits.grad = None
    entropy = entropy_from_logits(filter_logits(logits, top_k=2))
    p, q = 4 / 7, 3 / 7
    close(entropy, [-(p * math.log(p) + q * math.log(q))])
    entropy.sum().backward()
    # dH/dz_i = -p_i (log p_i + H) on kept tokens, 0 on dropped ones, and no NaN from the -inf
    h = -(p * math.log(p) + q * math.log(q))
    close(logits.grad, [[0.0, -p * (math.log(p) + h), 0.0, -q * (math.log(q) + h)]])


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.3), (7, 0.8), (1, 0.5)])
def test_filter_matches_hf_warpers(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    actual = filter_logits(logits, top_k, top_p)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    close(torch.log_softmax(actual, -1).nan_to_num(neginf=0.0), torch.log_softmax(expected, -1).nan_to_num(neginf=0.0))
