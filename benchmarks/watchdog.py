"""What the stall watchdog and the in-flight call records cost a training step.

Three measurements:

  phase   ``with run.timer(stage): pass`` (gen, reward, adv, update_actor in turn) with the watchdog (the
          shipped deadlines) against a bare Timer: microseconds per timed stage (the watchdog's begin/end:
          two lock round-trips, and a notify where a stage's deadline comes before the one it waited for)
  call    a trivial in-process group call with the group's in-flight record against the same call with
          the record replaced by a no-op: microseconds per group call
  step    two GRPO runs (trainer.backend=local, a tiny model: the fastest step there is, so the largest
          share) whose steps alternate with and without the watchdog and the records (even steps on in one
          run, odd in the other); median step seconds each way, and the overhead the two micro numbers
          predict for the stages and group calls a step has

Usage: python -m benchmarks.watchdog [--steps 31] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, Dispatch, LocalWorkerGroup, Worker, register
from rlcore.single_controller.inflight import CallTracker
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.timing import Timer
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.watchdog import Watchdog
from benchmarks.results import write_json


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
    dog = Watchdog({}, Path(tempfile.gettempdir()) / "rlcore_watchdog_never_written")  # shipped deadlines: no stall
    watched = Timer(watch=(dog.begin, dog.end))

    names = ["gen", "reward", "adv", "update_actor"]  # a step's stages in turn: each with its own deadline

    def loop(timer):
        def run(k):
            for i in range(k):
                with timer(names[i % 4]):
                    pass
        return run

    try:
        off, on = per_item_us(loop(bare), n, repeats), per_item_us(loop(watched), n, repeats)
        thread_cpu = thread_cpu_s(dog._thread)
    finally:
        dog.close()
    return {"phase_bare_us": off, "phase_watched_us": on, "phase_overhead_us": on - off,
            "watchdog_thread_cpu_s": thread_cpu, "phases_timed": n * (repeats + 0.1)}


def thread_cpu_s(thread) -> float:
    """User + system CPU seconds of ``thread`` so far (Linux's /proc; NaN elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/task/{thread.native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, IndexError, ValueError):
        return float("nan")


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


def grpo_steps(model: str, out: Path, steps: int, on_parity: int) -> tuple[list[float], list[float], int, int]:
    """One GRPO run whose steps alternate: those of ``on_parity`` (0: even, 1: odd) with the watchdog and the
    in-flight records, the others without either (the watchdog disabled, every group view's record a no-op).
    Alternating within one run pairs each step with its neighbour, so the load of other jobs on the machine,
    which comes and goes over seconds, hits both sides alike; two runs of opposite parity cancel what the
    step's parity does. Step 1 (warm-up) is left out. Returns (on steps' seconds, off steps' seconds,
    timed stages a step, group calls a step)."""
    overrides = [f"model.path={model}", f"trainer.output_dir={out}", f"trainer.run_name=alternating{on_parity}",
                 "trainer.backend=local", "trainer.loggers=[jsonl]", f"trainer.total_steps={steps}",
                 "trainer.val_freq=0", "trainer.save_freq=0", "trainer.export_hf=false", "trainer.cpus_per_proc=2",
                 "data.train_batch_size=16", "rollout.n=4", "actor.ppo_micro_batch_size_per_gpu=64"]
    config_dir = str(Path(recipes.grpo.__file__).parent / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("grpo", overrides=overrides)
    calls, end_step, begin = [], TrainingRun.end_step, CallTracker.begin

    def counted(self, *args):
        calls.append(1)
        return begin(self, *args)

    def end_step_and_toggle(self, step, *args, **kwargs):
        end_step(self, step, *args, **kwargs)
        on = (step + 1) % 2 == on_parity  # what the next step runs with
        self.watchdog.enabled = on
        for view in (self.workers.group, self.workers.actor, self.workers.ref, self.workers.rollout):
            if view is not None:
                view.__dict__.setdefault("_real_tracker", view._tracker)
                view._tracker = view._real_tracker if on else NoRecord()

    CallTracker.begin, TrainingRun.end_step = counted, end_step_and_toggle
    try:
        run = recipes.grpo.train(cfg)
    finally:
        CallTracker.begin, TrainingRun.end_step = begin, end_step
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    on = [r["timing_s/step"] for r in rows if r["step"] >= 2 and r["step"] % 2 == on_parity]
    off = [r["timing_s/step"] for r in rows if r["step"] >= 2 and r["step"] % 2 != on_parity]
    stages = len([k for k in rows[-1] if k.startswith("timing_s/")])
    return on, off, stages, len(calls) // steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=31, help="GRPO steps a run (two runs), alternating after the first")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and 5 steps (the suite's check)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    n, repeats = (2000, 3) if args.quick else (20000, 7)
    res = {**phase_cost(n, repeats), **call_cost(n // 4, repeats)}
    out = Path(tempfile.mkdtemp(prefix="rlcore_watchdog_bench_"))
    on, off = [], []
    try:
        model = str(build_tiny_model(out / "model", hidden_size=32, num_heads=2, num_kv_heads=1))  # the fastest step
        for parity in (0,) if args.quick else (0, 1):
            on_s, off_s, stages, calls = grpo_steps(model, out, 5 if args.quick else max(args.steps, 5), parity)
            on, off = on + on_s, off + off_s
    finally:
        shutil.rmtree(out, ignore_errors=True)
    res.update({"step_on_s": statistics.median(on), "step_off_s": statistics.median(off), "stages_per_step": stages,
                "calls_per_step": calls, "steps_each": min(len(on), len(off))})
    predicted = (res["stages_per_step"] * max(res["phase_overhead_us"], 0.0)
                 + res["calls_per_step"] * max(res["call_overhead_us"], 0.0))
    res.update({"predicted_overhead_us": predicted, "predicted_share": predicted * 1e-6 / res["step_off_s"],
                "measured_on_over_off": res["step_on_s"] / res["step_off_s"]})
    print(f"timed stage: {res['phase_bare_us']:.2f} us bare, {res['phase_watched_us']:.2f} us watched "
          f"(+{res['phase_overhead_us']:.2f} us); the watchdog's thread used {res['watchdog_thread_cpu_s']:.3f} s of CPU "
          f"over {res['phases_timed']:.0f} stages")
    print(f"group call (in-process no-op): {res['call_unrecorded_us']:.2f} us unrecorded, "
          f"{res['call_recorded_us']:.2f} us recorded (+{res['call_overhead_us']:.2f} us)")
    print(f"GRPO step (local, tiny model, {res['stages_per_step']} timed stages, {res['calls_per_step']} group calls), "
          f"{res['steps_each']} steps each way, alternating: median on {res['step_on_s']:.3f} s, off "
          f"{res['step_off_s']:.3f} s (on/off {res['measured_on_over_off']:.3f}); predicted overhead {predicted:.1f} us = "
          f"{100 * res['predicted_share']:.4f}% of a step")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
