"""RMSNorm and the SiLU-gated MLP as autograd functions of their own, for the trained roles: less kept.

Why: transformers computes Llama's RMSNorm as separate eager ops (an fp32 copy of the input, pow, mean,
rsqrt, two multiplies, a cast back), and autograd keeps what each of them needs for its backward: the
input's fp32 copy and the normalised output, besides the weight. The MLP's ``down(act(gate) * up)``
keeps gate (for SiLU's backward), silu(gate) and up (for the product's) and the product (the down
projection's input). In a bf16 update at SmolLM2 that is 10.5 KB a token and layer more than the
backward needs: 1.2 of the 3.1 GiB a 4096-token micro-batch keeps (docs/real_models.md, "Memory").

Here each is one ``torch.autograd.Function`` with the same forward ops in the same order (outputs are
the same bits) that keeps less and recomputes the rest in its backward:

- ``RMSNormFunction`` keeps the input as it came (bf16 under mixed precision: no fp32 copy) and the
  per-row inverse RMS, (N, 1) fp32; its backward is the closed form
  ``dx = r * dy - x * r^3 * mean(dy * x)`` with ``dy = g * w`` in fp32 (one row dot product), rounded
  as autograd rounds it, and recomputes the normalised input once for the weight's gradient.
- ``SwiGLUDownFunction`` (a plain linear ``down``) keeps gate, up and the weight; ``SiluMulFunction``
  (a wrapped one, e.g. LoRA's) gate and up. silu(gate) and the product are recomputed (aten's own
  ``silu_backward``, so the gate's gradient is autograd's bits).

Gradients: bit for bit in bf16; in fp32 within rounding (tests/models/test_fused_layers.py says why).
Speed: the SmolLM2 update 2-3% faster on 2 CPU cores, fp32 and bf16 (the norm's backward is faster,
the MLP's recompute slower; docs/benchmarks.md, "Fused layers").

``install_fused_layers(model)`` swaps the ``forward`` of every module whose math is exactly this:
the RMSNorms and SiLU MLPs of transformers' Llama, Mistral, Qwen2 and Qwen3 (dense and the MoE's dense
MLPs), checked by class and, for the MLP, by its activation; anything else keeps transformers' code.
The trained roles install it where ``model.fused_layers`` (default on) says so.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from rlcore.models import cpu_matmul

# transformers' classes whose forward is exactly the math below (transformers 5.x; read in its modeling files)
RMSNORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm"})
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP"})
FUSED_MARK = "_rlcore_fused"  # set on a module whose forward was swapped


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the normalisation in fp32 (transformers'
    ``LlamaRMSNorm``, the same ops in the same order)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.float32)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (x32 * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x32 = x.to(torch.float32)
        normed = (x32 * rstd).to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed).sum_to_size(weight.shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            dy = (grad * weight).to(torch.float32)
            # d/dx of x * r with r = (mean(x^2) + eps)^-1/2: r * dy - x * r^3 * mean(dy * x)
            coef = torch.linalg.vecdot(dy, x32).unsqueeze(-1).mul_(rstd.pow(3)).div_(-x.shape[-1])
            # a multiply and an add, not addcmul: its fused multiply-add rounds once less than autograd does
            grad_x = dy.mul_(rstd).add_(x32 * coef).to(x.dtype)
        return grad_x, grad_weight, None


class SiluMulFunction(torch.autograd.Function):
    """``silu(gate) * up``, keeping gate and up (not silu(gate) as well) for the backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


class SwiGLUDownFunction(torch.autograd.Function):
    """``down(silu(gate) * up)`` for a plain linear ``down``, keeping gate and up (and the weight) only:
    the product, which the linear would keep as its input, is recomputed in the backward (two passes
    over (N, intermediate) against the matmuls' N x intermediate x hidden)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                onednn: bool = False):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias, ctx.onednn = bias is not None, onednn
        return cpu_matmul.linear(F.silu(gate) * up, weight, bias, onednn)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_weight = grad_2d.t().mm((silu * up).reshape(-1, up.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad_2d.sum(0)
        grad_product = cpu_matmul.input_grad(grad, weight, ctx.onednn)
        grad_up = grad_product * silu if ctx.needs_input_grad[1] else None
        grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate) if ctx.needs_input_grad[0] else None
        return grad_gate, grad_up, grad_weight, grad_bias, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SiluMulFunction.apply(gate, up)


def swiglu_down(gate: torch.Tensor, up: torch.Tensor, down: nn.Linear) -> torch.Tensor:
    """On oneDNN where ``down``'s own forward would be (``rlcore.models.cpu_matmul.install_cpu_matmul``)."""
    return SwiGLUDownFunction.apply(gate, up, down.weight, down.bias, getattr(down, cpu_matmul.MARK, False))


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if type(self.down_proj) is nn.Linear and not self.down_proj._forward_hooks and not self.down_proj._forward_pre_hooks:
        return swiglu_down(gate, up, self.down_proj)
    return self.down_proj(silu_mul(gate, up))  # a wrapped down projection (LoRA's, hooked): called as it is


def fusable(module: nn.Module) -> bool:
    """Whether ``module`` computes exactly what this module's functions do."""
    name = type(module).__name__
    if name in RMSNORM_CLASSES:
        return isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon")
    if name in MLP_CLASSES:
        act = getattr(module, "act_fn", None)
        silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
        return silu and all(hasattr(module, p) for p in ("gate_proj", "up_proj", "down_proj"))
    return False


def install_fused_layers(model: nn.Module, enabled: bool = True) -> dict[str, int]:
    """Swap the forward of each fusable RMSNorm and MLP in ``model`` (``enabled=False``: give them
    transformers' back; the benchmarks' A/B between updates); returns how many of each are now fused
    (``{"rms_norm": n, "silu_mul": m}``; zeros: nothing in ``model`` is fusable, or ``enabled=False``)."""
    counts = {"rms_norm": 0, "silu_mul": 0}
    for module in model.modules():
        if not fusable(module):
            continue
        norm = type(module).__name__ in RMSNORM_CLASSES
        if not enabled:
            if getattr(module, FUSED_MARK, False):
                del module.forward  # the instance's forward, revealing the class's
                delattr(module, FUSED_MARK)
            continue
        module.forward = types.MethodType(_norm_forward if norm else _mlp_forward, module)
        setattr(module, FUSED_MARK, True)
        counts["rms_norm" if norm else "silu_mul"] += 1
    return counts
