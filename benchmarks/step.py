"""One GRPO step on the default setup: time per stage and tokens/s.

    python -m benchmarks.step [--steps 6] [override ...]     e.g. rollout.backend=vllm

Runs ``recipes.grpo`` with its defaults (the warm-started tiny model on the arithmetic task, Ray
hybrid engine; the warm start is built once and cached) for a few steps without validation or
checkpoints, then reports, over the steps after the first (warm-up), the median seconds of each
stage (``timing_s/*`` as the recipe logs them), its share of the step, and tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.trainer.tracking import read_jsonl_metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of recipes/config/grpo.yaml")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="rlcore_step_")
    overrides = [f"trainer.total_steps={args.steps}", "trainer.val_freq=0", "trainer.save_freq=0",
                 f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.run_name=bench",
                 "warmstart.dir=outputs/warmstart", *args.overrides]
    config_dir = str((recipes.grpo.__file__.rsplit("/", 1)[0]) + "/config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("grpo", overrides=overrides)
    run = recipes.grpo.train(cfg)
    rows = [r for r in read_jsonl_metrics(run.dir / "metrics.jsonl") if r["step"] >= 2]
    if not rows:
        raise SystemExit("need --steps >= 2 (the first step is warm-up)")

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows if key in r)

    step_s = median("timing_s/step")
    print(f"GRPO step, defaults + {args.overrides or 'no overrides'}: median over steps 2..{args.steps}")
    print(f"{'stage':<16}{'seconds':>9}{'share':>8}{'tokens/s':>11}")
    stages = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("timing_s/")} - {"step"})
    for stage in stages:
        seconds = median(f"timing_s/{stage}")
        tps = median(f"throughput/{stage}") if any(f"throughput/{stage}" in r for r in rows) else float("nan")
        print(f"{stage:<16}{seconds:>9.3f}{seconds / step_s:>8.0%}{tps:>11.0f}")
    print(f"{'step':<16}{step_s:>9.3f}{1:>8.0%}{median('throughput/step'):>11.0f}")
    print(f"rollout tokens/s (generated): {median('rollout/tokens_per_s'):.0f}")


if __name__ == "__main__":
    main()
