"""How close a stage gets to what this machine can do: its measured matmul peak and the FLOPs of a step.

A ratio to a slow peer says little about what is left; the share of the machine's own limit does.
Two halves, used by ``benchmarks/grpo_vs_trl.py`` and ``benchmarks/step.py``:

* ``matmul_peak(dtype)``: the best FLOP/s of a large square matmul in that dtype, with the threads
  this process has, measured now (a few repetitions, best taken: what the machine reaches when
  nothing else runs), by the best of torch.mm and oneDNN (``kernel_peaks``: MKL's fp32 kernel
  leaves ~20% of an AVX-512 machine unused). On the 2-core AVX2 EPYC this is ~110-130 GFLOP/s in
  fp32; on a 2-core Zen 4 VM, 218-226 (oneDNN; torch.mm 169-184).
  ``MeasuredPeak``: that measurement in several windows of one run (its start and its end), the best
  of them the yardstick. A window alone is at the mercy of the VM's neighbours: on a 2-core Zen 4 VM
  (AVX-512) the fp32 peak read 151, 161, 176 and 184 GFLOP/s in runs minutes apart, so an update of
  the same speed read 73% or 90% of "the peak". The best of two windows moves less, and only down.
* ``ModelShape.from_config`` and its ``forward_flops``: the matmul FLOPs of a decoder's forward over
  some tokens, 2 x (the matmul parameters a token passes through, LM head included) per token plus
  the attention scores and values, 4 x layers x (heads x head size) per token and position attended.
  Training is 3 forwards' worth (forward, and a backward twice as costly).

The FLOPs counted are the *useful* work: a group's prompt once (what sampling with a shared prompt
and packs that hold each prompt once compute), each response token once. A side that computes more
(a prompt per row, padding) gets no credit for it, so MFU compares work done to the same yardstick.
Elementwise work (norms, activations, softmax) is left out, as GPU MFU figures leave it out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlcore.models import cpu_matmul

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: str | torch.dtype) -> str:
    """The name the peaks are keyed by: "fp32", "float32", "torch.float32" or torch.float32 -> "float32"."""
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype) or getattr(torch, dtype.removeprefix("torch."))
    return str(dtype).removeprefix("torch.")


def kernel_peaks(dtype: str, size: int = 2048, seconds: float = 1.5) -> dict[str, float]:
    """Best FLOP/s of ``size`` x ``size`` matmuls in ``dtype`` over about ``seconds`` (after one warm-up), per
    kernel this torch has: ``torch.mm`` (MKL's sgemm in fp32 on x86; oneDNN in bf16) and ``oneDNN``
    (its fp32 JIT kernels). Why both: on the 2-core Zen 4 VM (AVX-512), MKL's fp32 kernel for Zen
    (``mkl_blas_def_sgemm_kernel_0_zen``) reached 169-184 GFLOP/s and oneDNN's 218-226, ~95% of the
    cores' 237 at 3.7 GHz, so torch.mm alone flattered every fp32 MFU by ~20%."""
    torch_dtype = DTYPES[dtype]
    a = torch.randn(size, size).to(torch_dtype)
    b = torch.randn(size, size).to(torch_dtype)
    kernels = {"torch.mm": torch.mm, "oneDNN": cpu_matmul.onednn_linear if cpu_matmul.available() else None}
    rates = {}
    for name, kernel in kernels.items():
        if kernel is None:
            continue
        kernel(a, b)  # warm-up: thread pool, kernel selection, the JIT
        best, deadline = 0.0, time.perf_counter() + seconds
        while True:
            start = time.perf_counter()
            kernel(a, b)
            best = max(best, 2 * size**3 / (time.perf_counter() - start))
            if time.perf_counter() > deadline:
                break
        rates[name] = best
    return rates


def matmul_peak(dtype: str, size: int = 2048, seconds: float = 1.5) -> float:
    """The best FLOP/s of any kernel (``kernel_peaks``): what this machine's matmuls can reach now."""
    return max(kernel_peaks(dtype, size, seconds).values())


@dataclass(frozen=True)
class ModelShape:
    """What a token costs in a decoder: matmul parameters passed through, and attention width."""

    matmul_params: int  # per token: q, k, v, o, the MLP's matrices of every layer, and the LM head
    layers: int
    attention_width: int  # heads x head size

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config of a Llama-like decoder (SmolLM2, Qwen2, the tiny models)."""
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        mlp = 3 * hidden * config.intermediate_size  # gate, up, down
        return cls(layers * (attention + mlp) + hidden * config.vocab_size, layers, heads * head_dim)

    def forward_flops(self, tokens: int, mean_context: float) -> float:
        """A forward over ``tokens`` tokens that each attend to ``mean_context`` positions on average."""
        return tokens * (2.0 * self.matmul_params + 4.0 * self.layers * self.attention_width * mean_context)

    def sampling_flops(self, prompt_len: float, groups: int, responses: int, response_len: float) -> float:
        """Sampling ``groups`` prompts of ``prompt_len`` tokens once each, then ``responses`` responses of
        ``response_len`` tokens (each token attends to the prompt and the response so far)."""
        prefill = groups * self.forward_flops(round(prompt_len), prompt_len / 2)
        return prefill + responses * self.forward_flops(round(response_len), prompt_len + response_len / 2)

    def training_flops(self, prompt_len: float, groups: int, responses: int, response_len: float) -> float:
        """A forward and backward (3 forwards) over the same tokens, each prompt held once per group."""
        return 3.0 * self.sampling_flops(prompt_len, groups, responses, response_len)


def mfu(flops: float, seconds: float, peak: float) -> float:
    """The share of the measured peak a stage reached."""
    return flops / seconds / peak if seconds > 0 and peak > 0 else float("nan")


class MeasuredPeak:
    """The matmul peak per dtype, measured in named windows of a run (``measure("start")``, then
    ``measure("end")``), each kernel apart (``kernel_peaks``); ``best`` is the highest any kernel
    reached in any window: the yardstick."""

    def __init__(self, dtypes, size: int = 2048, seconds: float = 1.5) -> None:
        self.dtypes, self.size, self.seconds = list(dtypes), size, seconds
        self.windows: dict[str, dict[str, dict[str, float]]] = {}  # window -> dtype -> kernel -> FLOP/s

    def measure(self, window: str) -> dict[str, float]:
        self.windows[window] = {d: kernel_peaks(d, self.size, self.seconds) for d in self.dtypes}
        return {d: max(rates.values()) for d, rates in self.windows[window].items()}

    @property
    def best(self) -> dict[str, float]:
        return {d: max(max(w[d].values()) for w in self.windows.values()) for d in self.dtypes}

    def describe(self) -> str:
        """``float32 220 GFLOP/s (start: oneDNN 218, torch.mm 179; end: ...)``: the best, and each window's kernels."""
        return ", ".join(f"{d} {self.best[d] / 1e9:.0f} GFLOP/s ("
                         + "; ".join(f"{name}: " + ", ".join(f"{k} {r / 1e9:.0f}" for k, r in w[d].items())
                                     for name, w in self.windows.items()) + ")"
                         for d in self.dtypes)
