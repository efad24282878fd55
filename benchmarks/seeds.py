"""A recipe's default run over several seeds: where it ends, where its best was, and how long it took.

    python -m benchmarks.seeds                                   # recipes.ppo, seeds 1-4, one run per 2 cores
    python -m benchmarks.seeds --recipe grpo --seeds 1 2 3 4 5 6 --parallel 3 --out /tmp/seeds
    python -m benchmarks.seeds -- actor.lr_scheduler=cosine ...  # overrides after --, for every run

Why: one run's last greedy validation says little (the default PPO run measured 0.5875, 0.575 and 0.74
on three occasions); what a fresh clone gets is a range over seeds (``trainer.seed``: the driver's RNG and
every batch's sampling seed). Each run is the recipe's command line as a user types it, in a process of
its own under a timeout, writing ``<out>/<recipe>/seed<N>``; the warm start is built once (the first run
builds it; the others wait on its lock). Runs at once share the machine: each takes ``trainer.cpus_per_proc``
cores (2 by default), so ``--parallel`` times that should not pass the core count, and the wall times
are only comparable between runs that shared it alike (the load average at each start and end is
printed beside them). The table: final and best ``val/reward_mean`` with their steps, wall seconds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlcore.trainer.jsonl_rows import read_jsonl_metrics
from benchmarks.results import write_json

REPO = Path(__file__).resolve().parent.parent


def run_seed(recipe: str, seed: int, out: Path, overrides: list[str], timeout_s: float) -> dict:
    name = f"seed{seed}"
    cmd = [sys.executable, "-m", f"recipes.{recipe}", f"trainer.seed={seed}", f"trainer.output_dir={out}",
           f"trainer.run_name={name}", f"warmstart.dir={out / 'warmstart'}", "trainer.overwrite=true", *overrides]
    load_before, start = os.getloadavg()[0], time.perf_counter()
    log = out / f"{recipe}-{name}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row = {"seed": seed, "rc": rc, "wall_s": round(time.perf_counter() - start), "load": (load_before, os.getloadavg()[0]),
           "log": str(log)}
    metrics = out / recipe / name / "metrics.jsonl"
    vals = [(r["step"], r["val/reward_mean"]) for r in read_jsonl_metrics(metrics) if "val/reward_mean" in r] \
        if metrics.exists() else []
    if vals:
        best = max(vals, key=lambda sv: (sv[1], -sv[0]))  # the earliest step of the best score
        row.update(final=vals[-1], best=best)
    return row


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="ppo")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--parallel", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="runs at once (each takes trainer.cpus_per_proc=2 cores); default: cores / 2")
    p.add_argument("--out", type=Path, default=Path("outputs/seeds"))
    p.add_argument("--timeout-s", type=float, default=3600, help="per run")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.recipe}, seeds {args.seeds}, {args.parallel} at a time, overrides {overrides or 'none'}; "
          f"{os.cpu_count()} cores; runs in {out}", flush=True)
    first, rest = args.seeds[0], args.seeds[1:]
    rows = [run_seed(args.recipe, first, out, overrides, args.timeout_s)]  # alone: builds the warm start
    with ThreadPoolExecutor(args.parallel) as pool:
        rows += list(pool.map(lambda s: run_seed(args.recipe, s, out, overrides, args.timeout_s), rest))
    print("| seed | final (step) | best (step) | wall s | load avg start/end | rc |\n|---|---|---|---|---|---|")
    for r in rows:
        final = f"{r['final'][1]:.4g} ({r['final'][0]})" if "final" in r else "-"
        best = f"{r['best'][1]:.4g} ({r['best'][0]})" if "best" in r else "-"
        print(f"| {r['seed']} | {final} | {best} | {r['wall_s']} | {r['load'][0]:.1f}/{r['load'][1]:.1f} | {r['rc']} |")
    write_json(args.json, rows)


if __name__ == "__main__":
    main()
