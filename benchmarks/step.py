"""One GRPO step on the default setup: where the time goes, per stage and in the fixed part.

    python -m benchmarks.step [--steps 6] [--json out.json] [override ...]   e.g. rollout.backend=vllm
    python -m benchmarks.step --quick                                         (the test suite's smoke run)
    python -m benchmarks.step --model smollm2 [--steps 4]                     a real model (or --model <HF dir>)

``--model`` runs the recipe with ``+preset=smollm2`` (recipes/config/preset/smollm2.yaml: SmolLM2-135M-Instruct
on the arithmetic-in-words task, vLLM sampling, its micro-batch sizes) and ``model.path`` set to it.
The update's padding share is reported before and after packing: of the batch as sampled
(``actor/pad_frac_batch``) and of the positions its forwards computed (``actor/pad_frac_computed``: 0
with ``model.use_remove_padding``, the default; compare ``model.use_remove_padding=false``), with the
share of the valid tokens that packs holding each group's prompt once did not compute
(``actor/shared_prompt_frac``, ``model.pack_shared_prompts``, the default).
Per stage it also prints the useful FLOPs done and their share of this machine's matmul peak, measured
before and after the run (the better reading) for the dtype that stage computes in
(``benchmarks/machine_limit.py``): MFU for
generate (each group's prompt once, every response token), update (forward and backward over the
rows trained) and the reference / old log-prob forwards, the yardstick of what is left to gain.
Every run reports the peak resident memory (``VmHWM``) of the driver and of each rank's process, read
at every step's end, and the run's own memory record (``<run>/memory.json``,
``rlcore.trainer.process_memory``): the peak of the PSS summed over every process of the run (driver,
Ray's daemons, the ranks, an engine's own process), sampled every ``trainer.memory_watch_s``, and
each process's own peak: what decides whether a setting fits a machine (``benchmarks/memory.py``
samples any command finer).

Runs ``recipes.grpo`` with its defaults (the warm-started tiny model on the arithmetic task, hybrid
engine on Ray; the warm start is built once and cached) for a few steps without validation or
checkpoints. Over the steps after the first (warm-up) it reports:

1. per stage (``timing_s/*`` as the recipe logs them): median seconds, share of the step, tokens/s;
2. the fixed part of a step, the time outside the workers' own compute: Ray round trips (the
   worker-group calls' time minus the seconds the ranks spent inside the methods,
   ``WorkerGroup.busy_seconds``: dispatch, serialisation, the object store, scheduling; the
   recipe starts the reference forward before the driver's reward, and compute hidden behind the
   driver that way comes off this figure, so it is a lower bound), the
   driver's reward (decode + score), data (batching, collation), advantage, metric reduction,
   ``end_step`` (metric assembly and logging), and the rest of the driver's Python (the wall time
   between steps that none of these account for).

Each part is timed by wrapping the functions the recipe calls (``GroupMethod.__call__``, ``GroupFuture.get``,
``TrainingRun.next_prompts`` / ``end_step``, ``batch_metrics``, ``mean_over_ranks``), not by a
profiler, so the numbers carry no profiling overhead. ``trainer.backend=local`` runs the same with
every role in this process. Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig

import recipes.grpo
from benchmarks.machine_limit import MeasuredPeak, ModelShape, dtype_name, mfu
from rlcore.single_controller.worker_group import GroupFuture, GroupMethod
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.process_memory import rss_high_water
from rlcore.trainer.tracking import read_jsonl_metrics
from benchmarks.results import write_json

QUICK = ["data.train_batch_size=8", "rollout.max_new_tokens=8"]


class Stopwatch:
    """Seconds spent in each wrapped function, per step (outermost calls only)."""

    def __init__(self) -> None:
        self.per_step: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.step_ends: list[float] = []
        self._depth = 0
        self._restore: list = []

    def wrap(self, owner, attr: str, category: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if self._depth:  # nested inside another timed call: counted there
                return original(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[category] += time.perf_counter() - start
                self._depth -= 1

        setattr(owner, attr, timed)
        self._restore.append((owner, attr, original))

    def end_of_step(self) -> None:
        self.step_ends.append(time.perf_counter())
        self.per_step.append(dict(self.current))
        self.current = defaultdict(float)

    def restore(self) -> None:
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)


def stage_flops(rows: list[dict], run_config) -> dict[str, float]:
    """The median step's useful FLOPs per stage, from the logged lengths and the run's config."""
    shape = ModelShape.from_config(AutoConfig.from_pretrained(run_config.model.path))
    groups = int(run_config.data.train_batch_size)
    responses = groups * int(run_config.rollout.get("n", 1))
    prompt, response = median(rows, "prompt_length/mean"), median(rows, "response_length/mean")
    trained = median(rows, "actor/trained_rows_frac")
    trained = 1.0 if trained != trained else trained
    sampled = shape.sampling_flops(prompt, groups, responses, response)  # one forward over the batch, prompts once
    return {"gen": sampled, "ref": sampled, "old_log_prob": sampled,
            "update_actor": trained * shape.training_flops(prompt, groups, responses, response)}


def stage_dtypes(run_config) -> dict[str, str]:
    """The dtype each stage computes in, as the run resolved it (``<run>/config.yaml``)."""
    train = run_config.model.get("mixed_precision") or "float32"
    sample = run_config.rollout.get("dtype") or run_config.model.get("dtype") or "float32"
    return {"gen": "float32" if sample in ("fp32", "float32", "auto") else sample, "ref": train,
            "old_log_prob": train, "update_actor": train}


def run(overrides: list[str], steps: int) -> tuple[list[dict], dict[str, float], dict[str, int], DictConfig, dict]:
    """``steps`` GRPO steps: the logged metric rows after warm-up, the median seconds per step
    of each wrapped part (plus ``wall``, from one step's end to the next) and the peak RSS of the
    driver and each rank's process, the run's resolved config and its ``memory.json`` record ({} without one)."""
    out = tempfile.mkdtemp(prefix="rlcore_step_")
    overrides = [f"trainer.total_steps={steps}", "trainer.val_freq=0", "trainer.save_freq=0",
                 f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.run_name=bench",
                 "trainer.export_hf=false", "warmstart.dir=outputs/warmstart",
                 *overrides]
    config_dir = str((recipes.grpo.__file__.rsplit("/", 1)[0]) + "/config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("grpo", overrides=overrides)
    watch = Stopwatch()
    watch.wrap(GroupMethod, "__call__", "worker calls")
    watch.wrap(GroupFuture, "get", "worker calls")  # a non-blocking call's wait (the recipe's ref / old log-probs)
    watch.wrap(TrainingRun, "next_prompts", "data")
    watch.wrap(recipes.grpo, "batch_metrics", "metrics")
    watch.wrap(recipes.grpo, "mean_over_ranks", "metrics")
    end_step = TrainingRun.end_step

    def end_step_and_mark(self, *args, **kwargs):
        start = time.perf_counter()
        end_step(self, *args, **kwargs)
        watch.current["end_step"] += time.perf_counter() - start
        watch.current["worker compute"] = max(self.workers.group.busy_seconds())  # cumulative: differenced below
        peaks["driver"] = rss_high_water(os.getpid())
        for info in self.workers.group.worker_info:  # each rank's own process (the driver's with backend=local)
            peaks[f"rank{info['rank']}"] = rss_high_water(info["pid"])
        watch.end_of_step()

    peaks: dict[str, int] = {}
    TrainingRun.end_step = end_step_and_mark
    try:
        training = recipes.grpo.train(cfg)
    finally:
        TrainingRun.end_step = end_step
        watch.restore()
    rows = [r for r in read_jsonl_metrics(training.dir / "metrics.jsonl") if r["step"] >= 2]
    if not rows:
        raise SystemExit("need --steps >= 2 (the first step is warm-up)")
    busy = [s.pop("worker compute") for s in watch.per_step]
    for s, before, after in zip(watch.per_step[1:], busy, busy[1:]):
        s["worker compute"] = after - before
    parts = {key: statistics.median(s.get(key, 0.0) for s in watch.per_step[1:])
             for key in {k for s in watch.per_step[1:] for k in s}}
    parts["wall"] = statistics.median(b - a for a, b in zip(watch.step_ends, watch.step_ends[1:]))
    record = training.dir / "memory.json"
    memory = json.loads(record.read_text()) if record.exists() else {}
    return rows, parts, peaks, OmegaConf.load(training.dir / "config.yaml"), memory  # the config as the run resolved it


def median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="3 steps of 8 prompts x 8 tokens (the suite's check)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--model", help="a real model: +preset=smollm2 with model.path=MODEL (a HF dir, .gguf or smollm2)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of recipes/config/grpo.yaml")
    args = parser.parse_args()
    steps, overrides = (3, QUICK + args.overrides) if args.quick else (args.steps, args.overrides)
    if args.model:
        overrides = ["+preset=smollm2", f"model.path={args.model}", *overrides]
    matmul = MeasuredPeak(("float32", "bfloat16"), *((256, 0.2) if args.quick else (2048, 1.5)))
    matmul.measure("start")  # and again after the run: the better reading counts
    rows, parts, peaks, run_config, memory = run(overrides, steps)
    matmul.measure("end")
    dtypes = stage_dtypes(run_config)
    peak = {d: matmul.best[dtype_name(d)] for d in sorted(set(dtypes.values()))}
    flops = stage_flops(rows, run_config)

    step_s, wall = median(rows, "timing_s/step"), parts["wall"]
    print(f"\nGRPO step, defaults + {overrides or 'no overrides'}: median over steps 2..{steps}")
    print(f"matmul peak, the better of the run's start and end: {matmul.describe()}")
    print(f"{'stage':<16}{'seconds':>9}{'share':>8}{'tokens/s':>11}{'GFLOP':>9}{'of peak':>9}")
    stages = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("timing_s/")} - {"step"})
    table = {}
    for stage in stages + ["step"]:
        seconds, tps = median(rows, f"timing_s/{stage}"), median(rows, f"throughput/{stage}")
        table[stage] = {"seconds": seconds, "share": seconds / step_s, "tokens_per_s": tps}
        limit = ""
        if stage in flops and stage in dtypes and seconds == seconds:
            table[stage].update(flops=flops[stage], mfu=mfu(flops[stage], seconds, peak[dtypes[stage]]),
                                dtype=dtypes[stage])
            limit = f"{flops[stage] / 1e9:>9.1f}{table[stage]['mfu']:>9.0%} ({dtypes[stage]})"
        print(f"{stage:<16}{seconds:>9.3f}{seconds / step_s:>8.0%}{tps:>11.0f}{limit}")

    compute = parts.get("worker compute", 0.0)
    fixed = {
        "Ray round trips (worker calls - worker compute)": parts.get("worker calls", 0.0) - compute,
        "reward (decode + score, in the driver)": median(rows, "timing_s/reward"),
        "data (batching, collation)": parts.get("data", 0.0),
        "advantage": median(rows, "timing_s/adv"),
        "metric reduction (batch_metrics, mean_over_ranks)": parts.get("metrics", 0.0),
        "end_step (metric assembly, logging)": parts.get("end_step", 0.0),
    }
    accounted = parts.get("worker calls", 0.0) + sum(v for k, v in fixed.items() if not k.startswith("Ray"))
    fixed["other driver Python (the wall time none of the above covers)"] = max(wall - accounted, 0.0)
    total = sum(fixed.values())
    print(f"\nfixed part of a step (wall {wall:.3f} s between step ends; the workers' own compute {compute:.3f} s):")
    for name, seconds in fixed.items():
        print(f"  {name:<62}{seconds:>7.3f} s{seconds / wall:>6.0%}")
    print(f"  {'total fixed':<62}{total:>7.3f} s{total / wall:>6.0%}")
    print(f"rollout tokens/s (generated): {median(rows, 'rollout/tokens_per_s'):.0f}")
    print("peak resident memory: " + ", ".join(f"{who} {n / 2**30:.2f} GiB" for who, n in peaks.items()))
    if memory:
        print(f"peak PSS summed over the run's processes: {memory['peak_pss_total_bytes'] / 2**30:.2f} GiB (sampled "
              f"every {memory['interval_s']:g} s); each one's own peak: " + ", ".join(
                  f"{who} {n / 2**30:.2f}" for who, n in memory["peak_pss_bytes"].items() if n >= 2**26) + " GiB")
    padding = {"batch": median(rows, "actor/pad_frac_batch"), "computed": median(rows, "actor/pad_frac_computed"),
               "shared_prompt": median(rows, "actor/shared_prompt_frac")}
    shared = padding["shared_prompt"]
    print(f"padding share of the update: {padding['batch']:.0%} of the batch as sampled, {padding['computed']:.0%} of "
          f"the positions its forwards computed ({'packed' if padding['computed'] == 0 else 'padded micro-batches'}); "
          + ("" if shared != shared else f"{shared:.0%} of the valid tokens held once as shared prompts; ")
          + f"update {median(rows, 'timing_s/update_actor'):.3f} s")
    trained = median(rows, "actor/trained_rows_frac")  # with skip_zero_advantage_rows where it applies (no KL loss)
    print(f"rows the actor trained on: {'all' if trained != trained else f'{trained:.0%} (the rest had zero advantage)'}")
    write_json(args.json, {"overrides": overrides, "steps": steps, "stages": table, "fixed_s": fixed,
                           "fixed_total_s": total, "wall_s": wall, "trained_rows_frac": trained,
                           "padding_share": padding, "worker_compute_s": compute, "parts_s": parts,
                           "peak_rss_bytes": peaks, "matmul_peak_flops": peak, "matmul_peak_windows": matmul.windows,
                           "memory": memory})


if __name__ == "__main__":
    main()
