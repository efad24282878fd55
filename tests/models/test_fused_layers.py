"""rlcore.models.fused_layers: the fused RMSNorm and SiLU product give transformers' outputs and
gradients bit for bit (the same forward ops; a backward whose roundings match autograd's), in fp32 and
in bf16 (the mixed-precision compute dtype), keep less for the backward, and are installed only where
the model's math is theirs."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaMLP, LlamaRMSNorm

from rlcore.models.fused_layers import install_fused_layers, rms_norm, silu_mul, swiglu_down
from saved_bytes import saved_bytes

DTYPES = [torch.float32, torch.bfloat16]


def norm_and_grads(norm, x, grad, fused):
    x = x.clone().requires_grad_()
    out = rms_norm(x, norm.weight, norm.variance_epsilon) if fused else norm(x)
    out.backward(grad)
    weight_grad, norm.weight.grad = norm.weight.grad, None
    return out, x.grad, weight_grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 64), (3, 5, 576), (1, 200, 96)])
def test_rms_norm_matches_transformers_bit_for_bit(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    norm.weight.data = (torch.randn(shape[-1], generator=g) * 0.2 + 1).to(dtype)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    grad = torch.randn(*shape, generator=g).to(dtype)
    ours, ref = norm_and_grads(norm, x, grad, True), norm_and_grads(norm, x, grad, False)
    assert ours[0].dtype == ref[0].dtype == dtype
    for a, b, what in zip(ours, ref, ("output", "input grad", "weight grad")):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_autograd_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    gate, up, grad = (torch.randn(45, 96, generator=g).to(dtype) for _ in range(3))
    ours_in = [t.clone().requires_grad_() for t in (gate, up)]
    ref_in = [t.clone().requires_grad_() for t in (gate, up)]
    ours, ref = silu_mul(*ours_in), F.silu(ref_in[0]) * ref_in[1]
    assert torch.equal(ours, ref)
    for a, b in zip(torch.autograd.grad(ours, ours_in, grad), torch.autograd.grad(ref, ref_in, grad)):
        assert torch.equal(a, b)


def test_silu_mul_gradient_is_the_derivative_in_float64():
    """Beyond autograd's bits: torch's gradcheck in float64 (the RMSNorm computes in fp32 whatever its
    input, as transformers' does, so its derivative is checked through the bit-equality above)."""
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(silu_mul, (gate, up))


def test_fused_layers_keep_less_for_the_backward():
    """bf16 RMSNorm: the input (bf16) and a per-row fp32 scale, not an fp32 copy and a normalised one
    besides; the SiLU product: gate and up, not silu(gate) as well; with the down projection, not the
    product either."""
    n, h, i = 64, 32, 48
    norm = LlamaRMSNorm(h).to(torch.bfloat16)
    x = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    weight = norm.weight.nbytes
    assert saved_bytes(lambda: rms_norm(x, norm.weight, 1e-6)) == x.nbytes + weight + n * 4
    assert saved_bytes(lambda: norm(x)) >= 2 * x.nbytes + x.nbytes + weight  # fp32 copy + bf16 normalised
    gate, up = (torch.randn(n, i, requires_grad=True) for _ in range(2))
    assert saved_bytes(lambda: silu_mul(gate, up)) == 2 * gate.nbytes
    assert saved_bytes(lambda: F.silu(gate) * up) == 3 * gate.nbytes
    down = torch.nn.Linear(i, h)  # the MLP's whole tail: its product not kept as the projection's input either
    assert saved_bytes(lambda: swiglu_down(gate, up, down)) == 2 * gate.nbytes + down.weight.nbytes
    assert saved_bytes(lambda: down(F.silu(gate) * up)) == 4 * gate.nbytes + down.weight.nbytes


def tiny_config(cls=LlamaConfig, **overrides):
    kw = dict(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    return cls(**{**kw, **overrides})


def model_grads(model, ids, checkpointing=False):
    model.zero_grad(set_to_none=True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    logits = model(input_ids=ids, use_cache=False).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [LlamaConfig, Qwen3Config])
def test_a_fused_model_gives_transformers_logits_and_gradients(dtype, cls):
    """A whole (tiny) model, fused against itself unfused, in fp32 and all-bf16 (what FSDP2's bf16
    param_dtype computes in), also with gradient checkpointing (the fused functions' saved tensors go
    through its hooks): the same logits bit for bit; the same gradients bit for bit in bf16 and to
    fp32 rounding in fp32. Why not bitwise there: in fp32 transformers' RMSNorm casts its input to fp32
    as a no-op, so autograd sums three gradients into the residual stream (the residual's and the two
    of the norm's ops that read it: the product and the square) in its own order, where the fused
    backward hands autograd the norm's two already summed; in bf16 the cast is an op of its own and
    the order is the same (a sum of two is the same whatever the order)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()) if cls is LlamaConfig else \
        __import__("transformers").Qwen3ForCausalLM(tiny_config(cls))
    model.to(dtype)
    ids = torch.randint(0, 50, (2, 23))
    ref = model_grads(model, ids)
    counts = install_fused_layers(model)
    norms_per_layer = 2 if cls is LlamaConfig else 4  # Qwen3 adds q_norm and k_norm
    assert counts == {"rms_norm": 2 * norms_per_layer + 1, "silu_mul": 2}
    for checkpointing in (False, True):
        ours = model_grads(model, ids, checkpointing)
        assert torch.equal(ours[0], ref[0])
        for name in ref[1]:
            if dtype == torch.bfloat16:
                assert torch.equal(ours[1][name], ref[1][name]), name
            else:  # one summation order apart: a few ulps (seen: 1.2e-7 relative to the largest entry)
                torch.testing.assert_close(ours[1][name], ref[1][name], rtol=1e-5, atol=1e-6 * float(ref[1][name].abs().max()))
    assert install_fused_layers(model, enabled=False) == {"rms_norm": 0, "silu_mul": 0}
    assert all("forward" not in vars(m) for m in model.modules())  # transformers' forwards again


def test_only_the_same_math_is_fused():
    """An MLP with another activation keeps transformers' code (its norms are still fused); modules of
    other classes are never touched."""
    model = LlamaForCausalLM(tiny_config(hidden_act="gelu"))
    assert install_fused_layers(model) == {"rms_norm": 5, "silu_mul": 0}
    assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, LlamaMLP))

    class OtherNorm(torch.nn.Module):  # RMSNorm-like, but not one of transformers' classes read
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(4)), 1e-6

    other = OtherNorm()
    assert install_fused_layers(other) == {"rms_norm": 0, "silu_mul": 0}
    assert "forward" not in vars(other)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_down_matches_autograd(dtype, bias):
    g = torch.Generator().manual_seed(3)
    down = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    gate, up = (torch.randn(1, 45, 96, generator=g).to(dtype) for _ in range(2))
    grad = torch.randn(1, 45, 40, generator=g).to(dtype)

    def run(fn):
        down.zero_grad(set_to_none=True)
        inputs = [t.clone().requires_grad_() for t in (gate, up)]
        out = fn(*inputs)
        out.backward(grad)
        return [out, *(t.grad for t in inputs), down.weight.grad] + ([down.bias.grad] if bias else [])

    ours = run(lambda a, b: swiglu_down(a, b, down))
    ref = run(lambda a, b: down(F.silu(a) * b))
    for a, b, what in zip(ours, ref, ("output", "gate grad", "up grad", "weight grad", "bias grad")):
        assert torch.equal(a, b), what
