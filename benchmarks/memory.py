"""Peak memory of a whole run, every process counted once: PSS summed over a command and all it starts.

    python -m benchmarks.memory [--interval 0.5] [--json out.json] -- python -m recipes.grpo +preset=smollm2 \\
        trainer.total_steps=2 trainer.run_name=mem trainer.overwrite=true

Runs the command as a child and samples the proportional set size (``/proc/<pid>/smaps_rollup``) of
it and every descendant (the driver, Ray's GCS, raylet and agents, the ranks' workers, a vLLM engine
core in its own process) every ``--interval`` seconds (``rlcore.trainer.process_memory``). Prints the
peak of the sum, each process's own peak, and what each held when the sum peaked, split into
anonymous memory (heaps, tensors), file pages (libraries, mapped weights) and shared memory (Ray's
object store in /dev/shm), plus the sum's timeline (one point per ``--every`` seconds) to see which
phase peaks. A SIGTERM or ctrl-C (``timeout``) is passed on to the command, and the results
are still printed once it has stopped. A run also reports the same by itself at its end (``<run>/memory.json``); this script
measures any command, an older checkout's included.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

from rlcore.trainer.process_memory import GIB, MemoryWatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between the timeline's points")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to measure")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    start = time.perf_counter()
    child = subprocess.Popen(command, start_new_session=True)  # a signal to this script reaches it once, below
    for signum in (signal.SIGTERM, signal.SIGINT):  # pass it on, and go on sampling until the run has stopped
        signal.signal(signum, lambda sig, frame: child.send_signal(sig))
    watch = MemoryWatch(child.pid, args.interval)
    timeline, next_point = [], 0.0
    while child.poll() is None:
        reading = watch.sample()
        now = time.perf_counter() - start
        if now >= next_point:
            timeline.append((round(now, 1), sum(r["total"] for r in reading.values())))
            next_point = now + args.every
        time.sleep(args.interval)
    peaks = watch.peaks
    print(f"\n{' '.join(command)}\nexit {child.returncode} after {time.perf_counter() - start:.0f} s, "
          f"{peaks.samples} samples every {args.interval:g} s")
    print(f"peak of the sum of PSS: {peaks.peak_total / GIB:.2f} GiB")
    print(f"{'process':<44}{'own peak':>10}{'at sum peak':>12}{'anon':>8}{'file':>8}{'shmem':>8}  (GiB)")
    summary = peaks.summary()
    at = summary["at_total_peak_bytes"]
    for who, own in summary["peak_pss_bytes"].items():
        held = at.get(who, {})
        parts = "".join(f"{held.get(k, 0) / GIB:>8.2f}" for k in ("anon", "file", "shmem"))
        print(f"{who[:43]:<44}{own / GIB:>10.2f}{held.get('total', 0) / GIB:>12.2f}{parts}")
    print("timeline (s: GiB): " + ", ".join(f"{t:g}: {b / GIB:.2f}" for t, b in timeline))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "interval_s": args.interval, "exit": child.returncode,
                       "timeline": timeline, **summary}, f, indent=1)
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
