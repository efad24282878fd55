"""What one exact fingerprint of every weight costs (docs/correctness.md, "Weights.").

    python -m benchmarks.fingerprint [--model smollm2] [--repeat 5] [--threads 1 2] [--json out.json]

Loads the model's state dict (default SmolLM2-135M, ``model.path=smollm2``) and times
``weight_fingerprints`` over all of it, as each side of the check runs it:

- ``trainer_fp32_s``: the trainer's fp32 weights for an fp32 engine (no cast);
- ``trainer_to_bf16_s``: the same weights cast, chunk by chunk, to a bf16 engine's dtype;
- ``engine_bf16_s``: a bf16 engine's own weights;
- ``float_sums_s``: the float64 (elements, sum, sum of squares) the check used before, for scale.

Each the median of ``--repeat`` runs, wall and CPU seconds, per torch thread count. Also the process's peak resident
memory before and after (the fingerprint hashes 2 MiB chunks: no copy of a tensor, let alone of
the model). Timing is reported, never asserted; on a shared machine it is noisy, compare the
numbers of one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from rlcore.algos.consistency import weight_fingerprints
from rlcore.models.gguf import resolve_model_path
from benchmarks.results import write_json


def float_sums(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, float, float]]:
    """The previous checksum: element count, sum and sum of squares in float64."""
    out = {}
    for name, t in state.items():
        values = t.detach().double()
        out[name] = (values.numel(), float(values.sum()), float(values.square().sum()))
    return out


def median_s(fn, repeat: int) -> dict[str, float]:
    """Median wall seconds, and median CPU seconds of this process (steadier on a shared machine:
    time spent waiting for a core is not in it)."""
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json")
    args = parser.parse_args()
    state = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), torch_dtype=torch.float32).state_dict()
    held = {name: t.to(torch.bfloat16) for name, t in state.items()}
    bf16 = {name: "bfloat16" for name in state}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"model": args.model, "tensors": len(state), "parameters": sum(t.numel() for t in state.values())}
    for threads in args.threads:
        torch.set_num_threads(threads)
        result[f"threads_{threads}"] = {
            "trainer_fp32_s": median_s(lambda: weight_fingerprints(state.items()), args.repeat),
            "trainer_to_bf16_s": median_s(lambda: weight_fingerprints(state.items(), bf16), args.repeat),
            "engine_bf16_s": median_s(lambda: weight_fingerprints(held.items()), args.repeat),
        }
    # before the float sums, whose float64 copy of each tensor would set the peak
    result["peak_rss_mib"] = {"before": rss_before, "after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for threads in args.threads:
        torch.set_num_threads(threads)
        result[f"threads_{threads}"]["float_sums_s"] = median_s(lambda: float_sums(state), args.repeat)
    print(json.dumps(result, indent=2))
    write_json(args.json, result)


if __name__ == "__main__":
    main()
