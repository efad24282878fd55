"""ResponseHead.scoring's ``entropy_grad``: off where no loss term uses the entropy, it leaves the
gradients bit for bit as they were (the entropy's zero gradient no longer worked through every chunk)
and cuts the entropy out of the graph."""

import torch
from torch import nn

from rlcore.workers.response_head import ResponseHead

VOCAB, HIDDEN, CHUNK_MB = 97, 16, 5 * 97 * 4 / (1 << 20)  # 5 positions per chunk: several chunks


def head_grads(entropy_grad: bool, entropy_weight: float, keep_mb: float = 0.0):
    torch.manual_seed(0)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False)
    head = ResponseHead(linear, CHUNK_MB, keep_mb)
    hidden = torch.randn(3, 7, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (3, 7))
    with head.scoring(labels, temperature=0.7, entropy_grad=entropy_grad):
        scores = head(hidden)
    log_prob, entropy = scores[..., 0], scores[..., 1]
    weights = torch.linspace(-1, 1, 21).view(3, 7)
    (log_prob * weights).sum().add(entropy_weight * entropy.sum()).backward()
    return linear.weight.grad, hidden.grad, scores.detach()


def test_without_the_entropy_in_the_loss_its_gradient_switched_off_changes_no_bit():
    for keep_mb in (0.0, 2 * CHUNK_MB):  # recomputed logits, and the first chunks kept from the forward
        w_on, h_on, s_on = head_grads(True, 0.0, keep_mb)
        w_off, h_off, s_off = head_grads(False, 0.0, keep_mb)
        assert torch.equal(s_on, s_off)
        assert torch.equal(w_on, w_off) and torch.equal(h_on, h_off)


def test_with_it_switched_off_the_entropy_adds_no_gradient():
    w_bonus, h_bonus, _ = head_grads(True, 0.3)
    w_off, h_off, _ = head_grads(False, 0.3)
    w_plain, h_plain, _ = head_grads(True, 0.0)
    assert not torch.allclose(w_bonus, w_plain)  # the entropy term has a gradient when it is wanted ...
    assert torch.equal(w_off, w_plain) and torch.equal(h_off, h_plain)  # ... and none when it is not
