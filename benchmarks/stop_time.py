"""How long a run takes to exit after SIGTERM (or SIGINT), and where it was: a scheduler gives ~30 s.

Starts a recipe (default: GRPO with the SmolLM2 preset: vLLM engine, Ray workers) in a subprocess, waits
for step ``--after`` to be logged, then sends the signal at a point of the next step:

  gen      ``--delay`` seconds after the row was logged: the next step is generating (it is abandoned and
           step ``--after`` is saved)
  update   ``--delay`` seconds into the next step's update: the run's stall watchdog is given a 1 s
           deadline for update_actor, so its report file (<run>/stalls/step_N_update_actor.txt) says the
           update is under way: before its first optimizer step (GRPO's default: the whole update) the
           step is abandoned at the next micro-batch and step ``--after`` is saved; after it, the step
           finishes and is saved

and reports the exit code, the seconds from the signal to the process's exit, the run's own account
(``abandoned calls ended ... saved ...``) and the load average (shared machines: say it with the numbers).

Usage: python -m benchmarks.stop_time [--at gen|update] [--after 1] [--delay 3] [--signal TERM] [-- overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="grpo")
    parser.add_argument("--at", choices=("gen", "update"), default="gen")
    parser.add_argument("--after", type=int, default=1, help="signal during the step after this one")
    parser.add_argument("--delay", type=float, default=3.0, help="--at gen: seconds after the row was logged")
    parser.add_argument("--signal", default="TERM", choices=("TERM", "INT"))
    parser.add_argument("--timeout", type=float, default=3600, help="a bound on the whole run (a hang guard)")
    parser.add_argument("overrides", nargs="*", default=["+preset=smollm2", "trainer.val_freq=0"])
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="stop_time_"))
    cmd = [sys.executable, "-m", f"recipes.{args.recipe}", *args.overrides, f"trainer.output_dir={out}",
           "trainer.total_steps=1000", "trainer.loggers=[jsonl]"]
    if args.at == "update":
        cmd.append("trainer.watchdog.deadlines.update_actor=1")  # its stall report marks the update under way
    log = open(out / "run.log", "w")  # noqa: SIM115 - the run's own output, for the report
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    metrics = out / args.recipe / "default" / "metrics.jsonl"
    while True:
        done = [r for r in rows(metrics) if r["step"] == args.after]
        if done:
            break
        if proc.poll() is not None or time.monotonic() - start > args.timeout:
            sys.exit(f"the run ended or hung before step {args.after} was logged: see {out / 'run.log'}")
        time.sleep(0.1)
    row = done[0]
    wait = args.delay
    if args.at == "update":
        stall = out / args.recipe / "default" / "stalls" / f"step_{args.after + 1}_update_actor.txt"
        while not stall.exists():
            if proc.poll() is not None or time.monotonic() - start > args.timeout:
                sys.exit(f"the run ended or hung before step {args.after + 1}'s update: see {out / 'run.log'}")
            time.sleep(0.1)
    time.sleep(wait)
    sig = getattr(signal, f"SIG{args.signal}")
    load = os.getloadavg()[0]
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 600 s"
    took = time.monotonic() - sent
    log.close()
    text = (out / "run.log").read_text()
    said = ("abandoned calls", "saved ", "stopped by", f"SIG{args.signal}")
    account = [line for line in text.splitlines() if line.startswith(said)]
    step_t = {k: round(v, 1) for k, v in row.items() if k.startswith("timing_s/") and v >= 0.5}
    print(json.dumps({"signal": f"SIG{args.signal}", "at": args.at, "seconds_into_step": round(wait, 1),
                      "exit_code": code, "signal_to_exit_s": round(took, 1), "load_avg_1min": round(load, 1),
                      "cpus": os.cpu_count(), f"step_{args.after}_timings_s": step_t, "run_said": account,
                      "run_dir": str(out)}, indent=1))


if __name__ == "__main__":
    main()
