"""The trained roles' fp32 matmuls on CPU through oneDNN, where torch's own (MKL's sgemm) leaves the cores idle.

Why: torch computes an fp32 ``F.linear`` on x86 with MKL. On AMD's AVX-512 cores MKL runs its Zen
kernel (``mkl_blas_def_sgemm_kernel_0_zen``), and on the 2-core Zen 4 VM it reached 150-184 GFLOP/s
on a 2048 x 2048 matmul where oneDNN's JIT kernels (in every x86 build of torch, as
``torch.ops.mkldnn._linear_pointwise``) reached 211-226, ~95% of the cores' limit
(``benchmarks/machine_limit.py``). At the SmolLM2 update's shapes (600-token packs, hidden 576,
MLP 1536, vocabulary 49k) oneDNN was faster for the forward (``x @ W.T``: 142-201 -> 166-202) and the
input's gradient (``g @ W``: 166-202 -> 208-222), and slower for the weight's gradient (``g.T @ x``,
transposed operands) at three of five shapes, so that one stays on torch.

The numbers are fp32's: oneDNN accumulates in fp32 as MKL does, in another order (differences of a
few ulps, ~1e-6 relative; tests/models/test_cpu_matmul.py). Anything else (CUDA, bf16 under mixed
precision, a torch without oneDNN) takes torch's path unchanged, so the switch costs nothing there.

``install_cpu_matmul(model)`` swaps the forward of every plain ``nn.Linear`` in ``model`` (LoRA's base
layers included: peft calls them; hooks still run around the new forward) for ``LinearFunction``, and
switches on the modules that compute their own linears: the fused MLP's down projection
(``rlcore.models.fused_layers``) follows its linear's ``MARK``, and a module carrying a bool ``onednn``
(the response head, ``rlcore.workers.response_head``, whose ``rlcore.algos.token_scores`` calls ``linear``
and ``input_grad``) gets it set. ``model.cpu_matmul`` (``onednn``, the default, or ``torch``).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
MARK = "_rlcore_cpu_matmul"  # set on a linear whose forward was swapped
FLAG = "onednn"  # a bool attribute of a module that computes its own linears: install_cpu_matmul sets it
CHOICES = ("onednn", "torch")


def available() -> bool:
    """Whether this torch has oneDNN's linear (every x86 build does)."""
    return _LINEAR is not None


def onednn_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2d @ weight.T + bias`` by oneDNN, as it is (2-D ``x2d``; ``weight`` may be a strided view)."""
    return _LINEAR(x2d, weight, bias, "none", [], "")


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` / ``input_grad`` of these operands run on oneDNN: fp32 on CPU, oneDNN present."""
    return available() and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, onednn: bool = True) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``x @ weight.T + bias``), on oneDNN where ``uses_onednn``. No autograd
    of its own: ``LinearFunction`` or the caller's backward differentiates it."""
    if not (onednn and uses_onednn(x, weight)):
        return F.linear(x, weight, bias)
    out = onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def input_grad(grad: torch.Tensor, weight: torch.Tensor, onednn: bool = True) -> torch.Tensor:
    """``grad @ weight``: a linear's input gradient from its output's, on oneDNN where ``uses_onednn``
    (``weight.T`` handed over as a view: oneDNN reads the strides, no copy)."""
    if not (onednn and uses_onednn(grad, weight)):
        return grad.matmul(weight)
    out = onednn_linear(grad.reshape(-1, grad.shape[-1]), weight.t())
    return out.view(*grad.shape[:-1], weight.shape[1])


class LinearFunction(torch.autograd.Function):
    """``nn.Linear``'s forward and backward with the forward and the input's gradient through ``linear``
    and ``input_grad``; keeps what autograd's linear keeps (the input and the weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_x = input_grad(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def linear_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 onednn: bool = True) -> torch.Tensor:
    """A linear layer's call, differentiable: ``LinearFunction`` where ``uses_onednn``, else ``F.linear``."""
    if onednn and uses_onednn(x, weight):
        return LinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear_layer(x, self.weight, self.bias)


def install_cpu_matmul(model: nn.Module, choice: str = "onednn") -> int:
    """Swap the forward of every plain ``nn.Linear`` of ``model`` for ``LinearFunction`` and set ``FLAG`` on the
    modules that carry it (``choice="torch"``: give them torch's back; the benchmarks' A/B between
    updates). Returns how many linears are swapped now."""
    if choice not in CHOICES:
        raise ValueError(f"model.cpu_matmul must be one of {list(CHOICES)}, got {choice!r}")
    swapped = 0
    for module in model.modules():
        if isinstance(getattr(module, FLAG, None), bool):
            setattr(module, FLAG, choice == "onednn")
        if type(module) is not nn.Linear:
            continue
        if choice == "torch":
            if getattr(module, MARK, False):
                del module.forward  # the instance's forward, revealing the class's
                delattr(module, MARK)
            continue
        module.forward = types.MethodType(_linear_forward, module)
        setattr(module, MARK, True)
        swapped += 1
    return swapped
