"""The trained roles' fp32 linears on oneDNN (rlcore.models.cpu_matmul): fp32's numbers in another summation
order, the gradients of nn.Linear, torch's path wherever oneDNN does not apply, and the switch both ways."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from rlcore.algos.token_scores import token_log_probs_and_entropy
from rlcore.models import cpu_matmul
from rlcore.models.cpu_matmul import LinearFunction, input_grad, install_cpu_matmul, linear, uses_onednn
from rlcore.models.fused_layers import install_fused_layers

pytestmark = pytest.mark.skipif(cpu_matmul._LINEAR is None, reason="this torch has no oneDNN linear")


def calls_to_onednn(monkeypatch) -> list:
    """Record each oneDNN call (the operands' shapes) and still make it."""
    calls, real = [], cpu_matmul._LINEAR
    monkeypatch.setattr(cpu_matmul, "_LINEAR", lambda x, w, *rest: calls.append((tuple(x.shape), tuple(w.shape))) or real(x, w, *rest))
    return calls


@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_gradient_are_fp32_products_in_float64s_tolerance(bias):
    g = torch.Generator().manual_seed(0)
    x, w, grad = torch.randn(2, 37, 48, generator=g), torch.randn(24, 48, generator=g), torch.randn(2, 37, 24, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    out = linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (2, 37, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
    assert (out - F.linear(x, w, b)).abs().max() < 1e-4  # torch's fp32 in its own order: a few ulps apart
    torch.testing.assert_close(input_grad(grad, w).double(), grad.double() @ w.double(), rtol=1e-5, atol=1e-5)


def test_the_linear_function_gives_nn_linears_gradients():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(12, 16, generator=g).requires_grad_()
    b = torch.randn(12, generator=g).requires_grad_()
    upstream = torch.randn(5, 7, 12, generator=g)
    LinearFunction.apply(x, w, b).backward(upstream)
    mine = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).backward(upstream)
    for a, ref in zip(mine, (x.grad, w.grad, b.grad), strict=True):
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)


def test_only_fp32_on_cpu_takes_onednn(monkeypatch):
    calls = calls_to_onednn(monkeypatch)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    assert uses_onednn(x, w) and not uses_onednn(x.bfloat16(), w.bfloat16()) and not uses_onednn(x.double(), w.double())
    assert torch.equal(linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))  # torch's own path
    assert torch.equal(linear(x, w, onednn=False), F.linear(x, w))
    assert calls == []
    linear(x, w)
    assert calls == [((3, 8), (4, 8))]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def test_a_model_on_onednn_gives_torchs_logits_and_gradients_and_the_switch_goes_both_ways(monkeypatch):
    """Every linear of the decoder (q, k, v, o, gate, up, down: 7 a layer), the fused MLP's down projection
    included, runs on oneDNN; logits and gradients agree with torch's path to fp32's rounding."""
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(2))
    reference = tiny_llama()
    install_fused_layers(reference)
    model = tiny_llama()
    install_fused_layers(model)
    model.own_linears = nn.Module()  # a module computing its own linears, as the response head does: its flag is set
    model.own_linears.onednn = False
    assert install_cpu_matmul(model) == 2 * 7 + 1  # the lm_head too
    assert model.own_linears.onednn is True
    calls = calls_to_onednn(monkeypatch)
    for m in (reference, model):
        m(ids, labels=ids).loss.backward()
    assert len(calls) >= 2 * 7 + 1
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert install_cpu_matmul(model, "torch") == 0 and model.own_linears.onednn is False
    calls.clear()
    model(ids)
    assert calls == [] and not any(hasattr(m, cpu_matmul.MARK) for m in model.modules())
    with pytest.raises(ValueError, match="model.cpu_matmul must be one of"):
        install_cpu_matmul(model, "mkl")


def test_the_heads_scores_on_onednn_agree_with_torchs(monkeypatch):
    calls = calls_to_onednn(monkeypatch)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 16, generator=g).requires_grad_()
    weight = torch.randn(40, 16, generator=g).requires_grad_()
    labels = torch.randint(0, 40, (9,), generator=g)
    results = []
    for onednn in (True, False):
        lp, ent = token_log_probs_and_entropy(hidden, weight, labels, chunk_tokens=4, onednn=onednn)
        (lp.sum() + 0.5 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
        # on oneDNN: 3 chunks' logits, their recompute and input gradients in the backward; then none
        assert len(calls) == (9 if onednn else 0)
        calls.clear()
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
