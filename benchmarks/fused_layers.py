"""The fused RMSNorm and MLP tail (rlcore.models.fused_layers) against transformers' eager ops and
against ``torch.compile`` of those same ops, one forward and backward at a time, at SmolLM2's shapes.

    python -m benchmarks.fused_layers [--tokens 606] [--rounds 30] [--threads 2] [--dtypes fp32,bf16]

Per dtype, three ways of each op (the sides alternate round by round): ``hf`` (transformers' own
module), ``fused`` (this repo's autograd functions), ``compiled`` (inductor over transformers' math,
``dynamic=True`` since packs vary in length; compiled once per dtype, its compile seconds and the
number of graphs it built, also after a second length, reported). Reports each side's best and median
milliseconds; on a machine others load the best is the nearer to the op's own cost. Timing is reported,
never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rlcore.models.fused_layers import rms_norm, swiglu_down

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_norm_math(x, weight, eps: float):
    """transformers' LlamaRMSNorm.forward, as a function for torch.compile."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def hf_mlp_tail(gate, up, weight):
    return F.linear(F.silu(gate) * up, weight)


def step(fn, tensors, grad) -> float:
    inputs = [t.detach().requires_grad_() for t in tensors]
    start = time.perf_counter()
    fn(*inputs).backward(grad)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=606, help="a pack's length (benchmarks.update's 16-row packs)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtypes", default="fp32,bf16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, h, i = args.tokens, args.hidden, args.intermediate
    print(f"torch threads {torch.get_num_threads()}; {n} tokens, hidden {h}, intermediate {i}")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        g = torch.Generator().manual_seed(0)
        norm = LlamaRMSNorm(h, eps=1e-5).to(dtype)
        x, gx = (torch.randn(n, h, generator=g).to(dtype) for _ in range(2))
        gate, up = (torch.randn(n, i, generator=g).to(dtype) for _ in range(2))
        w_down = (torch.randn(h, i, generator=g) * 0.02).to(dtype)
        gy = torch.randn(n, h, generator=g).to(dtype)
        down = torch.nn.Linear(i, h, bias=False).to(dtype)
        down.weight.data = w_down
        torch._dynamo.reset()
        compiled_norm = torch.compile(hf_norm_math, dynamic=True)
        compiled_mlp = torch.compile(hf_mlp_tail, dynamic=True)
        cases = {
            "rms_norm hf": (lambda a, w: norm(a), (x, norm.weight), gx),
            "rms_norm fused": (lambda a, w: rms_norm(a, w, 1e-5), (x, norm.weight), gx),
            "rms_norm compiled": (lambda a, w: compiled_norm(a, w, 1e-5), (x, norm.weight), gx),
            "mlp tail hf": (lambda a, b, w: down(F.silu(a) * b), (gate, up, w_down), gy),
            "mlp tail fused": (lambda a, b, w: swiglu_down(a, b, down), (gate, up, w_down), gy),
            "mlp tail compiled": (compiled_mlp, (gate, up, w_down), gy),
        }
        start = time.perf_counter()
        for label, (fn, tensors, grad) in cases.items():
            if "compiled" in label:
                step(fn, tensors, grad)
                step(fn, [t[: n - 37] if t.shape[0] == n else t for t in tensors], grad[: n - 37])  # another length
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"{name}: compiling (two lengths each) {time.perf_counter() - start:.1f} s, {frames} graphs")
        times: dict[str, list[float]] = {label: [] for label in cases}
        for _ in range(args.rounds):
            for label, (fn, tensors, grad) in cases.items():
                times[label].append(step(fn, tensors, grad))
        for label, ts in times.items():
            print(f"{name} {label:20s} best {min(ts) * 1e3:7.3f} ms, median {statistics.median(ts) * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
