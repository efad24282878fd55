"""What the consistency check costs in a GRPO step (docs/correctness.md, "Consistency check").

    python -m benchmarks.consistency [--steps 11] [--json out.json] [override ...]
    python -m benchmarks.consistency --quick                     (the test suite's smoke run)

Runs ``recipes.grpo`` with its defaults (the warm-started tiny model on the arithmetic task, 64
prompts x 8 samples; built once and cached) in this process (``trainer.backend=local``), so that
the actor's share of the check can be timed by wrapping ``MismatchCollector``'s methods, the only
code the check adds to the update (it reuses the update's log-probs: no forward pass of its own).
Over the steps after the first (warm-up) it reports:

- ``step_s``: the median step;
- ``mismatch_s``: seconds per step inside ``MismatchCollector`` (the check/* statistics);
- ``driver_check_s``: ``timing_s/check``, the driver's judgement plus, on the steps where they run
  (step 1 and every ``trainer.check.weight_checksum_freq``), the weight checksums of the engine and
  of the trainer: its mean over the steps, i.e. amortised at the configured rate, and its max;
- ``overhead_pct``: (mismatch_s + mean driver_check_s) / step_s.

Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.workers.mismatch import MismatchCollector
from benchmarks.results import write_json

QUICK = ["data.train_batch_size=8", "rollout.max_new_tokens=8"]
TIMED = ("start", "add", "finish")


def run(overrides: list[str], steps: int) -> dict[str, float]:
    spent: list[float] = [0.0]
    originals = {name: getattr(MismatchCollector, name) for name in TIMED}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    per_step: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        base = [f"trainer.output_dir={out}", "trainer.backend=local", "trainer.loggers=[jsonl]",
                f"trainer.total_steps={steps}", "trainer.val_freq=0", "trainer.save_freq=0", "trainer.export_hf=false"]
        with initialize_config_dir(config_dir=str(Path(recipes.grpo.__file__).parent / "config"), version_base=None):
            cfg = compose("grpo", overrides=base + overrides)
        original_end_step = recipes.grpo.TrainingRun.end_step

        def end_step(self, *args, **kwargs):  # the mismatch seconds of the step just finished
            per_step.append(spent[0])
            spent[0] = 0.0
            return original_end_step(self, *args, **kwargs)

        try:
            for name in TIMED:
                setattr(MismatchCollector, name, timed(originals[name]))
            recipes.grpo.TrainingRun.end_step = end_step
            rows = read_jsonl_metrics(recipes.grpo.train(cfg).dir / "metrics.jsonl")
        finally:
            for name, fn in originals.items():
                setattr(MismatchCollector, name, fn)
            recipes.grpo.TrainingRun.end_step = original_end_step
    rows, per_step = rows[1:], per_step[1:]  # the first step warms up
    step_s = statistics.median(r["timing_s/step"] for r in rows)
    mismatch_s = statistics.median(per_step)
    checks = [r.get("timing_s/check", 0.0) for r in rows]
    driver_mean = statistics.fmean(checks)
    return {"steps_timed": len(rows), "step_s": step_s, "mismatch_s": mismatch_s,
            "driver_check_s_mean": driver_mean, "driver_check_s_max": max(checks),
            "overhead_pct": 100.0 * (mismatch_s + driver_mean) / step_s,
            "tokens_checked": statistics.median(r["check/tokens"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--quick", action="store_true", help="3 steps of 8 prompts x 8 tokens (the suite's check)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of recipes/config/grpo.yaml")
    args = parser.parse_args()
    steps, overrides = (3, QUICK + args.overrides) if args.quick else (args.steps, args.overrides)
    if steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    result = run(overrides, steps)
    for key, value in result.items():
        print(f"{key:>22}: {value:.6g}")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
