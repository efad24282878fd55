"""vLLM's compiled RMSNorm kernels for its CPU build, which vLLM 0.32 leaves unused in eager mode.

Why: vLLM 0.32 dispatches RMSNorm through its IR ops (``vllm.ir.ops.rms_norm`` and
``fused_add_rms_norm``), whose compiled implementation (``vllm_c``) is registered for GPUs only; on
CPU every layer's two norms run as six native torch ops each (``pow``, ``mean``, ``rsqrt``, three
multiplies, an add), although the CPU build ships the fused kernels (``torch.ops._C.rms_norm``,
``_C.fused_add_rms_norm``). Measured at SmolLM2-135M, fp32, 16 prompts x 8 samples x 32 tokens on 2
Zen 4 cores: sampling 12.2 -> 11.6 s (the norms' ops 0.6 -> 0.05 s), outputs within fp32 rounding of
the native math (1.4e-6 at the norm's output).

``cpu_kernel_config(device)`` returns the ``kernel_config`` engine argument that puts them first on
CPU (vLLM appends its own defaults, so ``native`` stays the fallback where ``supports_args`` refuses:
a strided view, a weightless norm, a variance size override). Every process that reads that config
needs the implementations registered (``register``): the driver, where ``cpu_kernel_config`` does it
before vLLM hashes its config (which looks every named provider up), and an ``AsyncLLM``'s
engine-core process, where ``rlcore.engines.vllm_worker`` does it when vLLM imports it as the worker
extension, before the worker sets the priorities. Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import torch

PROVIDER = "rlcore_cpu_c"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
              variance_size: int | None = None) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                        variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # in place: x normed, x_residual = x + residual
    return x, x_residual


def _fits(x: torch.Tensor, weight: torch.Tensor | None, variance_size: int | None) -> bool:
    """The kernels read contiguous rows and a weight of the input's dtype, over the whole last dim."""
    return (variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()
            and x.device.type == "cpu")


def register() -> bool:
    """Register both implementations (once per process); False where vLLM or its CPU kernels are missing."""
    try:
        from vllm import ir
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    current_platform.import_kernels()  # loads the CPU build's torch.ops._C
    if not (hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")):
        return False
    if PROVIDER not in ir.ops.rms_norm.impls:
        ir.ops.rms_norm.register_impl(
            PROVIDER, supported=True,
            supports_args=lambda x, weight, epsilon, variance_size=None: _fits(x, weight, variance_size))(_rms_norm)
    if PROVIDER not in ir.ops.fused_add_rms_norm.impls:
        ir.ops.fused_add_rms_norm.register_impl(
            PROVIDER, supported=True, inplace=True,
            supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: (
                _fits(x, weight, variance_size) and x_residual.is_contiguous()))(_fused_add_rms_norm)
    return True


def cpu_kernel_config(device: str) -> dict:
    """Engine arguments that run RMSNorm on the CPU build's kernels (``{}`` elsewhere: vLLM's own choice)."""
    if torch.device(device).type != "cpu" or not register():
        return {}
    return {"kernel_config": {"ir_op_priority": {"rms_norm": [PROVIDER], "fused_add_rms_norm": [PROVIDER]}}}


def providers() -> dict[str, list[str]]:
    """The implementations this process's vLLM dispatches its norms to, first choice first (a check)."""
    from vllm import ir

    return {"rms_norm": ir.ops.rms_norm.get_priority(), "fused_add_rms_norm": ir.ops.fused_add_rms_norm.get_priority()}
