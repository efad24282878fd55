"""The dtype a vLLM engine samples in when ``rollout.dtype`` is null: bf16 only where it is fast.

Why not always bf16 (what vLLM and most RL stacks default to): on a CPU without native bf16
arithmetic (no AVX512-BF16, no AMX: e.g. an AVX2-only x86 CPU) every bf16 matmul is emulated, and
vLLM's CPU build sampled ~5x slower in bf16 than in fp32 on such a machine (25M parameters, 256 x
128 tokens: ``benchmarks/rollout.py``), which turned a 2x lead over TRL into a 0.89x deficit. On
CUDA GPUs with bf16 support, on CPUs with AVX512-BF16 or AMX tiles, and on ARM CPUs with the bf16
extension, bf16 is the faster choice and halves the weights and KV cache.

The flags are torch's own view of the CPU (the kernels it can dispatch to), not ``/proc/cpuinfo``.
"""

from __future__ import annotations

import platform

import torch


def native_bf16(device: str = "cpu") -> tuple[bool, str]:
    """Whether ``device`` computes bf16 natively, and the reason, for the log and the benchmarks."""
    if device.startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA bf16" if ok else "CUDA without bf16"
    if platform.machine().lower() in ("aarch64", "arm64"):
        ok = bool(torch.cpu.get_capabilities().get("bf16", False)) if hasattr(torch.cpu, "get_capabilities") else False
        return ok, "ARM bf16 extension" if ok else "ARM CPU without bf16"
    if torch.cpu._is_amx_tile_supported():
        return True, "AMX tiles"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "AVX512-BF16"
    return False, f"CPU capability {torch.backends.cpu.get_cpu_capability()} (no AVX512-BF16, no AMX)"


def default_vllm_dtype(device: str = "cpu") -> str:
    """``bfloat16`` where ``device`` computes it natively, else ``float32`` (see the module docstring)."""
    return "bfloat16" if native_bf16(device)[0] else "float32"
