"""What the stall watchdog and the in-flight call records cost a training step.

Three measurements:

  phase   ``with run.timer("gen"): pass`` with the watchdog (default deadlines) against a bare Timer:
          microseconds per timed stage (the watchdog's begin/end: two lock round-trips, no wake-up)
  call    a trivial in-process group call with the group's in-flight record against the same call with
          the record replaced by a no-op: microseconds per group call
  step    short GRPO runs (trainer.backend=local, a tiny model: the fastest step there is, so the
          largest share) with trainer.watchdog.enable true and false, alternated; median step seconds,
          and the overhead the two micro numbers predict for the stages and group calls a step has

Usage: python -m benchmarks.watchdog [--steps 8] [--runs 2] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, Worker, register
from rlcore.single_controller.inflight import CallTracker
from rlcore.trainer.timing import Timer
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.watchdog import Watchdog


class Noop(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def noop(self):
        return None


class NoRecord:
    """A group's in-flight record that records nothing (the 'off' side of the call measurement)."""

    def begin(self, *args):
        return 0

    def attach(self, *args):
        pass

    def end(self, *args):
        pass


def per_item_us(fn, n: int, repeats: int) -> float:
    fn(n // 10)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(n)
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def phase_cost(n: int, repeats: int) -> dict[str, float]:
    bare = Timer()
    dog = Watchdog({}, Path(tempfile.mkdtemp(prefix="rlcore_watchdog_")))  # the shipped default deadline
    watched = Timer(watch=(dog.begin, dog.end))

    def loop(timer):
        def run(k):
            for _ in range(k):
                with timer("gen"):
                    pass
        return run

    try:
        off, on = per_item_us(loop(bare), n, repeats), per_item_us(loop(watched), n, repeats)
    finally:
        dog.close()
    return {"phase_bare_us": off, "phase_watched_us": on, "phase_overhead_us": on - off}


def call_cost(n: int, repeats: int) -> dict[str, float]:
    group = LocalWorkerGroup(ClassWithInitArgs(Noop))

    def run(k):
        for _ in range(k):
            group.noop()

    on = per_item_us(run, n, repeats)
    tracker, group._tracker = group._tracker, NoRecord()
    off = per_item_us(run, n, repeats)
    group._tracker = tracker
    return {"call_recorded_us": on, "call_unrecorded_us": off, "call_overhead_us": on - off}


def grpo_steps(model: str, out: Path, steps: int, enable: bool, tag: str) -> tuple[float, int, int]:
    """Median step seconds over steps 2..N, and the stages and group calls of one step."""
    overrides = [f"model.path={model}", f"trainer.output_dir={out}", f"trainer.run_name={tag}",
                 "trainer.backend=local", "trainer.loggers=[jsonl]", f"trainer.total_steps={steps}",
                 "trainer.val_freq=0", "trainer.save_freq=0", "trainer.export_hf=false", "trainer.cpus_per_proc=2",
                 "data.train_batch_size=16", "rollout.n=4", "actor.ppo_micro_batch_size_per_gpu=64",
                 f"trainer.watchdog.enable={str(enable).lower()}"]
    config_dir = str(Path(recipes.grpo.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("grpo", overrides=overrides)
    calls = []
    begin = CallTracker.begin

    def counted(self, *args):
        calls.append(1)
        return begin(self, *args)

    CallTracker.begin = counted
    try:
        run = recipes.grpo.train(cfg)
    finally:
        CallTracker.begin = begin
    rows = [r for r in read_jsonl_metrics(run.dir / "metrics.jsonl") if r["step"] >= 2]
    stages = len([k for k in rows[-1] if k.startswith("timing_s/")])  # every timed stage, and the step itself
    return statistics.median(r["timing_s/step"] for r in rows), stages, len(calls) // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2, help="runs with the watchdog on, and as many off, alternated")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, one 3-step run each way (the suite's check)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    n, repeats = (2000, 3) if args.quick else (20000, 7)
    steps, runs = (3, 1) if args.quick else (args.steps, args.runs)
    res = {**phase_cost(n, repeats), **call_cost(n // 4, repeats)}
    out = Path(tempfile.mkdtemp(prefix="rlcore_watchdog_bench_"))
    model = str(build_tiny_model(out / "model", hidden_size=32, num_heads=2, num_kv_heads=1))  # the fastest step
    on, off = [], []
    for i in range(runs):
        for enable, times in ((True, on), (False, off)):
            step_s, stages, calls = grpo_steps(model, out, steps, enable, f"{'on' if enable else 'off'}{i}")
            times.append(step_s)
    predicted = stages * max(res["phase_overhead_us"], 0.0) + calls * max(res["call_overhead_us"], 0.0)
    res.update({"step_on_s": statistics.median(on), "step_off_s": statistics.median(off), "stages_per_step": stages,
                "calls_per_step": calls, "predicted_overhead_us": predicted,
                "predicted_share": predicted * 1e-6 / statistics.median(off)})
    res["measured_on_over_off"] = res["step_on_s"] / res["step_off_s"]
    print(f"timed stage: {res['phase_bare_us']:.2f} us bare, {res['phase_watched_us']:.2f} us watched "
          f"(+{res['phase_overhead_us']:.2f} us)")
    print(f"group call (in-process no-op): {res['call_unrecorded_us']:.2f} us unrecorded, "
          f"{res['call_recorded_us']:.2f} us recorded (+{res['call_overhead_us']:.2f} us)")
    print(f"GRPO step (local, tiny model, {stages} timed stages, {calls} group calls): watchdog on "
          f"{res['step_on_s']:.3f} s, off {res['step_off_s']:.3f} s (on/off {res['measured_on_over_off']:.3f}; "
          f"medians of {runs} run(s) each, steps 2..{steps}); predicted overhead {predicted:.1f} us = "
          f"{100 * res['predicted_share']:.4f}% of a step")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
