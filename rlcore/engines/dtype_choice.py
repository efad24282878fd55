"""Which dtypes a run computes in when its config leaves them open: a vLLM engine's ``rollout.dtype``
null, and the trainer's ``model.mixed_precision: auto``. Both are decided from what the machine is
(its bf16 support) and what the model is (its width), never by timing anything, so the same command
on the same kind of machine always makes the same run (the trainer records the choice and why).

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


# Training in bf16 (``model.mixed_precision: auto``). Native bf16 speeds up wide matmuls, but on a
# narrow model the casts and bf16 element-wise ops eat the gain. Measured forward + backward on a
# 2-core Xeon with AMX: the 0.3M toy model (hidden 128) 0.21 s in fp32 vs 0.27 s in bf16 (slower);
# the 25M model (hidden 512) 3.1 s vs 1.4 s; SmolLM2-135M (hidden 576) 2.6x faster in bf16. A timed
# probe at start-up chose between them before, and on a busy machine two runs of one command chose
# differently (speedups of 0.45-1.54 against a 1.5 bar): a width rule cannot flip.
BF16_MIN_HIDDEN = 512


def mixed_precision_choice(hidden_size: int, device: str = "cpu") -> tuple[str | None, str]:
    """``model.mixed_precision: auto`` resolved: ("bfloat16" or None for fp32, why). bf16 on a GPU with
    bf16; on a CPU with native bf16 only for models at least ``BF16_MIN_HIDDEN`` wide; else fp32."""
    native, why = native_bf16(device)
    if not native:
        return None, why
    if device.startswith("cuda"):
        return "bfloat16", why
    if hidden_size >= BF16_MIN_HIDDEN:
        return "bfloat16", f"{why}; hidden size {hidden_size} >= {BF16_MIN_HIDDEN}"
    return None, f"{why}, but hidden size {hidden_size} < {BF16_MIN_HIDDEN}: bf16 casts cost more than they save"
