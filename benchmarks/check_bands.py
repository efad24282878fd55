"""The trainer-vs-sampler difference a clean run shows, per dtype pair (docs/correctness.md, "Bands").

    python -m benchmarks.check_bands --recipe grpo --steps 4 --json out.json [override ...]

Runs a recipe in this process (``trainer.backend=local``) with the overrides given (the dtype pair:
``model.mixed_precision=null|bfloat16 rollout.dtype=float32|bfloat16``; the engine:
``rollout.backend=hf|vllm``; the model: ``+preset=smollm2``) and prints, per step, the ``check/*``
measures of the current-version tokens: mean |d|, signed mean of d, the share of tokens outside the
ratio band, max |d|, and the band the check used. Nothing is asserted: these numbers are what the
default bands of ``rlcore.trainer.check_bands`` were set from.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from rlcore.trainer.tracking import read_jsonl_metrics

MEASURES = ("check/logprob_abs_diff_mean", "check/logprob_diff_mean", "check/ratio_out_of_band",
            "check/logprob_abs_diff_max", "check/tokens", "check/band_abs_diff_mean", "check/band_out_of_band")


def run(recipe: str, overrides: list[str], steps: int) -> list[dict[str, float]]:
    module = importlib.import_module(f"recipes.{recipe}")
    with tempfile.TemporaryDirectory() as out:
        base = [f"trainer.output_dir={out}", "trainer.backend=local", "trainer.loggers=[jsonl]",
                f"trainer.total_steps={steps}", "trainer.val_freq=0", "trainer.save_freq=0", "trainer.export_hf=false"]
        with initialize_config_dir(config_dir=str(Path(module.__file__).parent / "config"), version_base=None):
            cfg = compose(recipe, overrides=base + overrides)
        rows = read_jsonl_metrics(module.train(cfg).dir / "metrics.jsonl")
    lag = lambda r, k: r.get(f"{k}/lag_0", r.get(k))  # noqa: E731 (current-version tokens where tokens carry versions)
    return [{"step": r["step"], **{k.removeprefix("check/"): lag(r, k) for k in MEASURES if lag(r, k) is not None}}
            for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="grpo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", help="append {overrides, steps} as one line here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of recipes/config/<recipe>.yaml")
    args = parser.parse_args()
    rows = run(args.recipe, args.overrides, args.steps)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"recipe": args.recipe, "overrides": args.overrides, "steps": rows}) + "\n")


if __name__ == "__main__":
    main()
