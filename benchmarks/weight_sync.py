"""Weight sync to engine servers, in buckets, against a plain copy of the same bytes.

    python -m benchmarks.weight_sync [--preset small] [--bucket-mb 64] [--backend hf|vllm] [--json out.json]

An actor (FSDP2, one Ray rank) streams its weights to an engine server (a Ray actor of its own)
with ``push_weights``: one parameter gathered at a time from the shards, packed into buckets of
``--bucket-mb``, each bucket put once in Ray's object store and loaded by the engine. The
reference is a plain ``copy_`` of the same state dict into an HF model's parameters in one process
(what an in-memory sync cannot beat). Prints both times, their ratio, the bytes and the largest
bucket the engine held. Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch
from transformers import AutoModelForCausalLM

from rlcore.engines import RolloutConfig
from rlcore.engines.server import start_engine_servers
from rlcore.models import ModelConfig, build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlcore.workers import ActorWorker
from rlcore.trainer.builder import worker_priority  # the workers at the driver's priority, as a run's
from benchmarks.results import write_json


def plain_copy_s(model_dir: str, repeats: int) -> tuple[float, int]:
    src = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    dst = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in src.items():
                dst[name].copy_(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times), sum(t.numel() * t.element_size() for t in src.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=("tiny", "small"))
    p.add_argument("--bucket-mb", type=float, default=64)
    p.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 repeats")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.preset, args.repeats = "tiny", 2
    model_dir = build_tiny_model(tempfile.mkdtemp(), preset=args.preset)
    copy_s, nbytes = plain_copy_s(model_dir, args.repeats)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             _system_config=worker_priority())
    cfg = {"model": {"path": model_dir}, "trainer": {"device": "cpu"}}
    actor = RayWorkerGroup(RayResourcePool([1], num_cpus_per_process=1, name_prefix="bench_sync"),
                           ClassWithInitArgs(ActorWorker, cfg))
    actor.init_model()
    [engine] = start_engine_servers(1, ModelConfig(path=model_dir),
                                    RolloutConfig(backend=args.backend, dtype="float32"), num_cpus=1)
    bucket = int(args.bucket_mb * 2**20)
    actor.push_weights([engine], 0, bucket)  # warm-up
    runs = [actor.push_weights([engine], v + 1, bucket) for v in range(args.repeats)]
    push_s = statistics.median(r["sync/push_s"] for r in runs)
    res = {"preset": args.preset, "backend": args.backend, "bytes": nbytes, "bucket_bytes": bucket,
           "plain_copy_s": copy_s, "push_s": push_s, "push_over_copy": push_s / copy_s,
           "buckets": runs[-1]["sync/buckets"], "peak_bucket_bytes": runs[-1]["sync/peak_bucket_bytes"],
           "engine_load_s": statistics.median(r["sync/engine_load_s_max"] for r in runs)}
    print(f"{args.preset} model, {nbytes / 2**20:.1f} MiB of weights, engine {args.backend}, buckets of "
          f"{args.bucket_mb:g} MiB ({res['buckets']:.0f} buckets, largest {res['peak_bucket_bytes'] / 2**20:.1f} MiB)")
    print(f"  plain copy_ of the state dict   {copy_s * 1e3:8.1f} ms")
    print(f"  push_weights to the engine      {push_s * 1e3:8.1f} ms  ({res['push_over_copy']:.1f}x; the engine's "
          f"own loading {res['engine_load_s'] * 1e3:.1f} ms of it)")
    write_json(args.json, res)
    ray.shutdown()


if __name__ == "__main__":
    main()
