"""rlcore.algos.token_scores: chunked log-probs and entropy equal the full-logits computation, in value
and gradient, and never hold more than one chunk of logits."""

import pytest
import torch

from rlcore.algos.sampling import filter_logits
from rlcore.algos.stats import entropy_from_logits, logprobs_from_logits
from rlcore.algos import token_scores
from rlcore.algos.token_scores import chunk_tokens_for, token_log_probs_and_entropy


def _full(hidden, weight, bias, labels, temperature, top_k, top_p):
    """The plain path in the inputs' dtype (float64 here: the reference the fp32 chunks must meet to 1e-6;
    an fp32 ``logsumexp - sum(p z)`` misses small entropies by ~4e-6)."""
    logits = filter_logits((hidden @ weight.T + bias) / temperature, top_k, top_p, labels)
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (7, 0.9)])
@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunks_equal_the_full_logits_in_value_and_gradient(chunk, top_k, top_p):
    g = torch.Generator(torch.get_default_device()).manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 5), generator=g)
    ref_lp, ref_ent = _full(hidden, weight, bias, labels, 0.7, top_k, top_p)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    ref_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    lp, ent = token_log_probs_and_entropy(hidden, weight, labels, bias=bias, temperature=0.7, top_k=top_k,
                                          top_p=top_p, chunk_tokens=chunk)
    assert lp.shape == ent.shape == labels.shape and lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp.float(), rtol=1e-6, atol=1e-6)  # fp32: log-probs near -22 carry ~2e-6
    torch.testing.assert_close(ent, ref_ent.float(), rtol=0, atol=1e-6)
    (lp.sum() + 0.3 * ent.sum()).backward()
    for name, t, ref in zip(("hidden", "weight", "bias"), (hidden, weight, bias), ref_grads):
        torch.testing.assert_close(t.grad, ref, rtol=1e-5, atol=1e-5, msg=f"grad of {name}")


def test_hand_values():
    # V=2, one position: logits (0, log 3) -> p = (1/4, 3/4)
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[0.0, 0.0], [torch.log(torch.tensor(3.0)), 0.0]])
    lp, ent = token_log_probs_and_entropy(hidden, weight, torch.tensor([1]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.75])))
    torch.testing.assert_close(ent, torch.tensor([-(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75)))]))


def test_no_grad_path_and_chunk_sizes():
    assert chunk_tokens_for(49152, 64) == 341  # SmolLM2's vocabulary: 341 positions make 64 MiB of fp32 logits
    assert chunk_tokens_for(66, 64) > 100_000 and chunk_tokens_for(10**9, 1) == 1
    hidden, weight = torch.randn(4, 6, 8), torch.randn(30, 8)
    labels = torch.randint(0, 30, (4, 6))
    with torch.no_grad():
        lp, _ = token_log_probs_and_entropy(hidden, weight, labels, chunk_tokens=5)
    assert not lp.requires_grad
    with pytest.raises(ValueError, match="must agree"):
        token_log_probs_and_entropy(hidden, weight, labels[:, :3])
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_log_probs_and_entropy(hidden, weight, labels, chunk_tokens=0)


def test_backward_keeps_no_chunk_of_logits():
    """What autograd saves for the backward: the inputs only, no (positions, V) tensor."""
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(4096, 16, requires_grad=True)
    labels = torch.randint(0, 4096, (64,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = token_log_probs_and_entropy(hidden, weight, labels, chunk_tokens=8)
    assert saved and max(saved) <= weight.numel()  # the weight itself; never 8 x 4096 logits or more
    assert all(n != 8 * 4096 for n in saved)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("used", ["log_prob", "entropy"])
@pytest.mark.parametrize("top_k", [0, 5])
def test_gradient_when_the_loss_reads_one_output_only(used, top_k):
    """A PPO loss without an entropy bonus never reads the entropy (its gradient comes as None and that
    term is skipped); an entropy-only loss never reads the log-prob: both equal float64 autograd."""
    g = torch.Generator(torch.get_default_device()).manual_seed(1)
    hidden = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 6, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (4,), generator=g)
    coef = torch.randn(4, generator=g, dtype=torch.float64)
    pick = 0 if used == "log_prob" else 1
    ref = _full(hidden, weight, torch.zeros(40, dtype=torch.float64), labels, 1.3, top_k, 1.0)[pick]
    ref_grads = torch.autograd.grad((ref * coef).sum(), (hidden, weight))
    out = token_log_probs_and_entropy(hidden, weight, labels, temperature=1.3, top_k=top_k, chunk_tokens=3)[pick]
    grads = torch.autograd.grad((out * coef.float()).sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k,entropy_coef", [(0, 0.0), (0, 0.3), (5, 0.3)])
def test_logits_kept_for_the_backward_give_the_recomputed_gradients_bit_for_bit(top_k, entropy_coef):
    """``keep_tokens``: the first whole chunks' logits are kept from the forward and the backward works on
    them instead of recomputing them (here 2 of the 3 chunks of 8 positions kept, the third recomputed);
    the gradients are those of recomputing every chunk exactly. A second backward (retain_graph) has
    nothing kept any more and recomputes: still the same."""
    g = torch.Generator(torch.get_default_device()).manual_seed(2)
    hidden = torch.randn(20, 16, generator=g, requires_grad=True)
    weight = torch.randn(300, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 300, (20,), generator=g)
    coef = torch.randn(20, generator=g)

    def grads(keep, twice=False):
        lp, ent = token_log_probs_and_entropy(hidden, weight, labels, temperature=0.7, top_k=top_k, chunk_tokens=8,
                                              keep_tokens=keep)
        loss = (lp * coef).sum() + entropy_coef * ent.sum() if entropy_coef else (lp * coef).sum()
        first = torch.autograd.grad(loss, (hidden, weight), retain_graph=twice)
        return (lp, ent, *first), (torch.autograd.grad(loss, (hidden, weight)) if twice else None)

    ref, _ = grads(0)
    kept, again = grads(17, twice=True)  # 17 positions: chunks [0, 8) and [8, 16) kept, [16, 20) recomputed
    for got, want in zip(kept, ref):
        assert torch.equal(got, want)
    for got, want in zip(again, ref[2:]):
        assert torch.equal(got, want)


def test_kept_logits_are_what_the_forward_holds_until_its_backward(monkeypatch):
    """The memory it costs: the kept chunks (and only where a backward can follow), freed by the backward."""
    hidden = torch.randn(24, 16, requires_grad=True)
    weight = torch.randn(100, 16, requires_grad=True)
    labels = torch.randint(0, 100, (24,))
    lp, _ = token_log_probs_and_entropy(hidden, weight, labels, chunk_tokens=8, keep_tokens=16)
    node = lp.grad_fn.next_functions[0][0]  # the reshape's input: the chunked scores' node
    assert [tuple(z.shape) for z in node.kept] == [(8, 100), (8, 100)]
    lp.sum().backward()
    assert node.kept == [] and hidden.grad is not None
    asked = []
    apply = token_scores._ChunkScores.apply
    monkeypatch.setattr(token_scores._ChunkScores, "apply", lambda *args: asked.append(args[-2]) or apply(*args))  # keep_tokens
    with torch.no_grad():
        token_log_probs_and_entropy(hidden, weight, labels, chunk_tokens=8, keep_tokens=16)
    token_log_probs_and_entropy(hidden.detach(), weight.detach(), labels, chunk_tokens=8, keep_tokens=16)
    token_log_probs_and_entropy(hidden.detach(), weight, labels, chunk_tokens=8, keep_tokens=16)
    assert asked == [0, 0, 16]  # no backward can follow the first two: nothing kept
