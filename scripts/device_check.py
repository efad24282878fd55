"""The GPU device check: prove rlcore's CUDA path in a few minutes of a borrowed H200.

    bash scripts/device_check.sh            # on the device machine (see README, "GPU device check")
    bash scripts/device_check.sh --cpu      # here: the same code path on CPU, at smaller sizes

The device machine has torch and transformers but no Ray, no vLLM and no registry, and the device
time is short and shared by every try, so this script (standard library only: it must report even
when rlcore fails to import) runs the check as a few processes, each with a time limit, and records
whatever each part did before moving on:

1. target (CUDA): versions, the GPU; actor, reference and critic on FSDP2 in the in-process worker
   group (world size 1), fp32 and bf16 mixed precision: log-probs, values, one SGD update each; a
   greedy HF rollout scored by the reference;
   reference (CPU, at the same time, on the cores the CUDA runs leave): the same runs on the same
   batch and weights;
2. recipes (CUDA): the reference compared with the target against ``device_parts.TOLERANCES``, then a
   few steps of the default GRPO and PPO configs with ``trainer.backend=local``: seconds and tokens/s
   per stage, peak GPU memory; the consistency check in bf16 on both sides (silent on a clean run, a
   sync left out named "weights not synced" at step 1: ``part_check_bf16``);
3. unit tests: pytest over the algos tests (torch's default device set to CUDA) and the worker
   tests (their ``trainer.device`` is ``auto``, so CUDA).
4. throughput (only when named: ``--only throughput``, ~6 minutes of its own): GRPO steps at
   Qwen2.5-0.5B and -1.5B shapes, packed, bf16: seconds per stage, tokens/s, MFU, weight-sync time,
   peak memory (``scripts/device_throughput.py``).

Every process runs under ``scripts/device_guard.py`` (importing Ray or vLLM fails; vendored packages
come from the vendor folder). Everything goes to ``--out`` (``$OUT`` on the device) as
``device_check.json`` and ``device_check_log.txt``, rewritten after each process, and a one-screen
summary is printed. The exit status is 0 only when every part passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_DATA = ["data.train_batch_size=4", "data.arithmetic.n_train=16", "data.arithmetic.n_val=6"]
TINY_RL = ["actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=2", "rollout.max_new_tokens=4"]
TINY_PPO = ["critic.ppo_micro_batch_size_per_gpu=8", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2"]
# Sizes per mode. GPU: the "small" preset (~25M parameters) and the recipes' default batches
# (64 prompts x 8 samples); --recipe-model medium (~0.2B) makes the card work harder. CPU (the dry run in
# the test suite, 2 cores): the recipe tests' tiny sizes.
MODES = {
    "cuda": {"models": {"compare": "small", "recipe": "small"},
             "workers": {"rows": 16, "prompt": 16, "response": 16, "micro": 8},
             "recipes": {"steps": 5, "threads": 8, "overrides": {}},
             "unit_tests": ["tests/algos", "tests/workers"]},
    "cpu": {"models": {"compare": "tiny", "recipe": "tiny64"},
            "workers": {"rows": 8, "prompt": 6, "response": 6, "micro": 4},
            "recipes": {"steps": 2, "threads": 2, "overrides": {"all": TINY_DATA + TINY_RL, "ppo": TINY_PPO}},
            "unit_tests": ["tests/algos/test_kl.py",
                           "tests/workers/test_actor.py::test_compute_log_prob_matches_hand_computation"]},
}
# Stages, in order; the processes of a stage run at the same time (the CPU reference beside the CUDA
# runs it is compared with, on the cores those leave idle). A process is (name, device, [(part, budget
# in seconds)]) and gets the sum of its parts' budgets, cut so that each later stage keeps RESERVE_S
# of the overall --budget-s.
RESERVE_S = 30


def plan(device: str) -> list[list[tuple[str, str, list[tuple[str, int]]]]]:
    return [
        [("target", device, [("env", 60), ("workers_fp32", 60), ("workers_bf16", 60)]),
         ("reference", "cpu", [("workers_fp32", 120), ("workers_bf16", 120)])],
        [("recipes", device, [("compare", 20), ("grpo", 120), ("ppo", 150), ("check_bf16", 90)])],
        [("unit", device, [("pytest", 240)])],
        [("throughput", device, [("throughput_0.5b", 210), ("throughput_1.5b", 300)])],
    ]


OPT_IN = ("throughput",)  # processes that run only when --only names them (a device call lasts at most 10 minutes)


def start_process(cmd: list[str], log: Path) -> subprocess.Popen:
    """``cmd`` in a session of its own (so a timeout kills its children too), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish_process(proc: subprocess.Popen, start: float, limit: float) -> dict:
    try:
        code, timed_out = proc.wait(timeout=max(1.0, start + limit - time.perf_counter())), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code, timed_out = proc.wait(), True
    return {"returncode": code, "timed_out": timed_out, "wall_s": round(time.perf_counter() - start, 1),
            "limit_s": round(limit, 1)}


def parts_command(name: str, device: str, parts: list, ctx: dict) -> list[str]:
    sub = {**ctx, "device": device, "tag": name, "parts": parts, "results": str(Path(ctx["work"]) / f"{name}.json")}
    return [sys.executable, "-m", "scripts.device_parts", json.dumps(sub)]


def parts_results(name: str, parts: list, ctx: dict, info: dict) -> tuple[dict, dict]:
    """The parts' results as reported, each part the process never reported marked as such."""
    results_file = Path(ctx["work"]) / f"{name}.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    imports = results.pop("imports", None)
    for i, (part, _) in enumerate(p for p in parts if p[0] not in results):
        why = "killed: the process overran its limit" if info["timed_out"] else f"process exited {info['returncode']}"
        results[part] = {"status": "timeout" if info["timed_out"] and i == 0 else "not run",
                         "error": why + ("" if i == 0 else " before this part")}
    return {f"{name}.{k}": v for k, v in results.items()}, {**info, "imports": imports}


def pytest_command(name: str, device: str, ctx: dict) -> list[str]:
    timeout = ["--timeout", "120"] if importlib.util.find_spec("pytest_timeout") else []  # on the image: yes
    return [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "scripts.device_pytest_plugin",
            "-p", "no:cacheprovider", *timeout, "--results-json", str(Path(ctx["work"]) / f"{name}.json"),
            "--device-default", f"tests/algos={device}", *ctx["unit_tests"]]


def pytest_results(name: str, device: str, ctx: dict, info: dict) -> tuple[dict, dict]:
    results_file = Path(ctx["work"]) / f"{name}.json"
    if not results_file.exists():
        return {f"{name}.pytest": {"status": "timeout" if info["timed_out"] else "error",
                                   "error": f"pytest wrote no results (exit {info['returncode']})"}}, info
    res = json.loads(results_file.read_text())
    counts = res["counts"]
    status = "ok" if res["exitstatus"] == 0 and not res["failures"] else "fail"
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
               f"{counts['skipped']} skipped (algos with default device {device})")
    part = {"status": status, "wall_s": info["wall_s"], "summary": summary, "counts": counts,
            "failures": res["failures"], "skipped": res["skipped"]}
    return {f"{name}.pytest": part}, {**info, "imports": res["imports"]}


def imports_verdict(procs: dict) -> tuple[bool, str]:
    audits = [p["imports"] for p in procs.values() if p.get("imports")]
    loaded = sorted({m for a in audits for m in a["blocked_loaded"]})
    missing = sorted({m for a in audits for m in a["not_on_image"]})
    tried = sorted({m for a in audits for m in a["blocked_attempts"]})
    ok = bool(audits) and not loaded and not missing
    line = (f"imports: ray/vllm loaded {loaded or 'never'}; not on the device image {missing or 'none'}; "
            f"optional attempts refused: {len(tried)}")
    return ok, line


def summarize(report: dict) -> str:
    verdict = "PASSED" if report["ok"] else "FAILED"
    lines = [f"rlcore device check: {verdict} ({report['mode']}, {report['wall_s']:.0f}s of {report['budget_s']}s)"]
    for key, part in report["parts"].items():
        text = part.get("summary") or part.get("error", "")
        lines.append(f"  {key:<24} {part['status']:<8} {part.get('wall_s', 0):>6.1f}s  {text}"[:200])
    lines.append("  " + report["imports"])
    lines.append(f"  details: {report['out']}/device_check.json, logs: {report['out']}/device_check_log.txt")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry run: device forced to CPU, small sizes")
    parser.add_argument("--out", default=os.environ.get("OUT", "device_check_out"))
    parser.add_argument("--budget-s", type=int, default=450, help="the whole check's time limit")
    parser.add_argument("--recipe-model", choices=("tiny", "small", "medium"),
                        help="the recipes' model (the compared one stays small: the CPU reference runs it too)")
    parser.add_argument("--steps", type=int, help="recipe steps")
    parser.add_argument("--only", nargs="*", choices=("target", "reference", "recipes", "unit", *OPT_IN),
                        help="these processes only (throughput: only when named here)")
    parser.add_argument("--keep-work", action="store_true", help="keep the work folder (models, runs, logs)")
    args = parser.parse_args(argv)

    device = "cpu" if args.cpu else "cuda"
    mode = json.loads(json.dumps(MODES[device]))
    if args.recipe_model:
        mode["models"]["recipe"] = args.recipe_model
    if args.steps:
        mode["recipes"]["steps"] = args.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rlcore_device_check_"))
    # The CPU reference runs beside the CUDA runs: it leaves them 4 cores for their own host work.
    ctx = {**mode, "work": str(work), "precisions": ["fp32", "bf16"],
           "cpu_threads": None if args.cpu else max(1, (os.cpu_count() or 8) - 4)}
    start = time.perf_counter()
    deadline = start + args.budget_s
    stages = [[p for p in stage if (p[0] in args.only if args.only else p[0] not in OPT_IN)] for stage in plan(device)]
    stages = [stage for stage in stages if stage]
    report = {"mode": "cpu dry run" if args.cpu else "cuda", "budget_s": args.budget_s, "sizes": mode,
              "out": str(out), "parts": {}, "procs": {}}
    for i, stage in enumerate(stages):
        left = deadline - time.perf_counter() - RESERVE_S * (len(stages) - i - 1)
        if left < 5:
            for name, _, parts in stage:
                report["parts"].update({f"{name}.{p}": {"status": "not run", "error": "out of time"} for p, _ in parts})
            continue
        stage_start, running = time.perf_counter(), []
        for name, proc_device, parts in stage:
            limit = min(sum(b for _, b in parts), left)
            print(f"--- {name} on {proc_device} (limit {limit:.0f}s)", flush=True)
            cmd = pytest_command(name, proc_device, ctx) if name == "unit" else parts_command(name, proc_device, parts, ctx)
            running.append((name, proc_device, parts, limit, start_process(cmd, work / f"{name}.log")))
        for name, proc_device, parts, limit, proc in running:
            info = finish_process(proc, stage_start, limit)
            if name == "unit":
                results, info = pytest_results(name, proc_device, ctx, info)
            else:
                results, info = parts_results(name, parts, ctx, info)
            report["parts"].update(results)
            report["procs"][name] = info
            for key, part in results.items():
                print(f"    {key}: {part['status']} {part.get('summary') or part.get('error', '')}"[:300], flush=True)
        write_report(report, start, out, work)
    write_report(report, start, out, work)
    print(summarize(report), flush=True)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report["ok"] else 1


def write_report(report: dict, start: float, out: Path, work: Path) -> None:
    """device_check.json and device_check_log.txt (the processes' logs, each cut to its last 200 kB)."""
    imports_ok, report["imports"] = imports_verdict(report["procs"])
    report["ok"] = imports_ok and bool(report["parts"]) and all(p["status"] == "ok" for p in report["parts"].values())
    report["wall_s"] = round(time.perf_counter() - start, 1)
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    with open(out / "device_check_log.txt", "w") as log:
        for name in report["procs"]:
            text = (work / f"{name}.log").read_text(errors="replace") if (work / f"{name}.log").exists() else ""
            log.write(f"##### {name}\n{text[-200_000:]}\n")


if __name__ == "__main__":
    sys.exit(main())
