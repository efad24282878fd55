"""DP_COMPUTE_PROTO round trip vs. a raw Ray call on the same tensors.

Two actors; a batch of N rows x 1024 tokens (int64 ids, int64 mask, float32 log-probs). Each
measured call sends half the rows to each actor and brings them back:

  raw    ray.get([actor.f.remote({k: chunk ...}) ...]) with torch tensors (Ray pickles them; the
         chunks are cloned first, as a view would ship its parent's whole storage)
  ours   wg.echo(data): DataProto chunk -> worker -> DataProto back -> concat

Usage: python -m benchmarks.dispatch [--rows 256 1024] [--repeats 5]
Prints the median seconds of each and the ratio ours / raw (lower is better).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
import torch

from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, Dispatch, RayResourcePool, RayWorkerGroup, Worker, register
from rlcore.trainer.builder import worker_priority  # the workers at the driver's priority, as a run's

TOKENS = 1024


class Echo(Worker):
    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    def echo_raw(self, tensors: dict) -> dict:
        return tensors


@ray.remote(num_cpus=0.5)
class RawEcho:
    def echo(self, tensors: dict) -> dict:
        return tensors


def make_batch(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return {
        "input_ids": torch.randint(0, 32000, (rows, TOKENS), generator=g),
        "attention_mask": torch.ones(rows, TOKENS, dtype=torch.int64),
        "old_log_probs": torch.randn(rows, TOKENS, generator=g),
    }


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _system_config=worker_priority())
    pool = RayResourcePool([2], num_cpus_per_process=0.5)
    wg = RayWorkerGroup(pool, ClassWithInitArgs(Echo))
    raw_actors = [RawEcho.remote() for _ in range(2)]
    zero_copy = os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "0")
    print(f"2 actors, {TOKENS} tokens per row, median of {args.repeats} (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS={zero_copy})")
    print(f"{'rows':>6} {'raw ray (s)':>12} {'ours (s)':>10} {'ours/raw':>9}")
    for rows in args.rows:
        tensors = make_batch(rows)
        data = DataProto.from_dict(tensors)
        half = rows // 2

        def raw():
            parts = [{k: v[i * half : (i + 1) * half].clone() for k, v in tensors.items()} for i in range(2)]
            out = ray.get([a.echo.remote(p) for a, p in zip(raw_actors, parts)])
            return {k: torch.cat([o[k] for o in out]) for k in tensors}

        def ours():
            return wg.echo(data)

        assert torch.equal(ours().batch["input_ids"], raw()["input_ids"])
        t_raw, t_ours = median_time(raw, args.repeats), median_time(ours, args.repeats)
        print(f"{rows:>6} {t_raw:>12.4f} {t_ours:>10.4f} {t_ours / t_raw:>9.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
