"""The parts of the device check, run in a process of their own: ``python -m scripts.device_parts CTX``.

``scripts/device_check.py`` starts one such process per group of parts (the CUDA workers, their
CPU reference, the recipes) with a JSON context, and reads back the results file this process
rewrites after every part: a part that fails, raises or overruns its budget is recorded as such and
the next part runs; a crash or hang of the whole process loses only the parts not yet reported.

The guard is installed before anything imports rlcore: no Ray, no vLLM, vendored packages from the
vendor folder (``scripts/device_guard.py``).
"""

from __future__ import annotations

from scripts import device_guard

device_guard.install()

# Everything below is imported under the guard.
import gc
import hashlib
import json
import math
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from hydra import compose, initialize_config_dir

import recipes.grpo
import recipes.ppo
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.validation import mean_over_ranks
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.rollout import RolloutWorker
from scripts.device_throughput import part_throughput

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "recipes" / "config"
# Model sizes by name: rlcore's presets, and a larger shape for a GPU that "small" leaves idle.
SIZES = {
    "tiny": {"preset": "tiny"},
    "tiny64": {"preset": "tiny", "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1},  # the recipe tests' model
    "small": {"preset": "small"},  # ~25M parameters
    "medium": {"preset": "small", "hidden_size": 1024, "num_layers": 16, "num_heads": 16, "num_kv_heads": 8,
               "intermediate_size": 2816},  # ~0.2B parameters
}
# Plain SGD, no clipping, no shuffle: an update is exactly -lr * gradient, so CUDA and CPU updates
# compare as gradients (Adam's first step, lr * sign(g), would flip on tiny gradients).
SGD = {"optimizer": "sgd", "lr": 1e-2, "weight_decay": 0.0, "grad_clip": None, "shuffle": False, "ppo_epochs": 1}
# What CUDA must match of the CPU reference run on the same batch and weights (max abs differences of
# log-probs and values; relative L2 error of the SGD update, i.e. of the gradient; relative difference of
# the loss and grad-norm metrics). fp32: the same math, other kernels and summation orders. bf16 (FSDP2
# mixed precision: bf16 compute, fp32 parameters and reduction) on both devices: a few bf16 ulps per
# logit, so the limits are several times bf16's own noise, measured here on CPU with the "small" model
# at the check's sizes: bf16 against fp32 differed by up to 0.016 in log-probs, 0.04 in values, 1.2%
# in the update and 0.3% in the loss and grad-norm metrics.
TOLERANCES = {
    "fp32": {"log_prob": 1e-3, "value": 1e-3, "update_rel": 1e-3, "metric_rel": 1e-3, "rollout_log_prob": 1e-3},
    "bf16": {"log_prob": 0.1, "value": 0.1, "update_rel": 0.1, "metric_rel": 0.05},
}


class PartTimeout(Exception):
    pass


_alarm_fired = False


def _alarm(signum, frame):
    """Soft per-part limit; a worker call wraps the exception, so the flag says what happened."""
    global _alarm_fired
    _alarm_fired = True
    raise PartTimeout("part overran its budget")


def gib(n_bytes: float) -> float:
    return round(n_bytes / 2**30, 3)


def peak_memory(device: str) -> dict:
    if device != "cuda":
        return {}
    return {"peak_allocated_gib": gib(torch.cuda.max_memory_allocated()),
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved())}


def model_dir(ctx: dict, role: str) -> str:
    """The model of ``role`` ("compare" or "recipe") for this process, built once into a folder of its
    own: processes run side by side, and seed 0 gives each the same weights bit for bit (which the
    comparison checks through ``weights_sha256``)."""
    path = Path(ctx["work"]) / "models" / ctx["tag"] / ctx["models"][role]
    if not (path / "config.json").exists():
        build_tiny_model(path, seed=0, **SIZES[ctx["models"][role]])
    return str(path)


def weights_sha256(path: str) -> str:
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- env
def part_env(ctx: dict) -> dict:
    """Versions, the GPU, a bf16 matmul rate (is the card what it should be?), and the models built."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
           "nccl_available": torch.distributed.is_nccl_available()}
    for name in ("tensordict", "hydra", "omegaconf"):
        out[name] = sys.modules[name].__version__
    summary = f"torch {out['torch']}, transformers {out['transformers']}"
    if ctx["device"] == "cuda":
        props = torch.cuda.get_device_properties(0)
        try:
            nccl = torch.cuda.nccl.version()
            out["nccl_version"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:  # noqa: BLE001 - a version is not worth the part
            out["nccl_version"] = f"unknown ({exc})"
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_memory_gib=gib(props.total_memory),
                   bf16_supported=torch.cuda.is_bf16_supported())
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        out["bf16_matmul_tflops"] = round(10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12, 1)
        summary += f", {props.name}, cuda {out['cuda']}, bf16 matmul {out['bf16_matmul_tflops']} TFLOP/s"
    out["summary"] = summary
    return out


# ----------------------------------------------------------------------------- workers
def make_batch(rows: int, prompt_width: int, response_width: int, vocab: int, seed: int = 0) -> DataProto:
    """A rollout-shaped batch from a CPU generator (so every process builds the same one): left-padded
    prompts, right-padded responses, position ids that skip the padding, advantages, and values and
    returns for the critic's update."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.arange(prompt_width).flip(0) < torch.randint(1, prompt_width + 1, (rows, 1), generator=g)
    response_mask = torch.arange(response_width) < torch.randint(1, response_width + 1, (rows, 1), generator=g)
    prompts = torch.randint(4, vocab, (rows, prompt_width), generator=g) * prompt_mask
    responses = torch.randint(4, vocab, (rows, response_width), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    mask = response_mask.float()
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": mask, "advantages": torch.randn(rows, response_width, generator=g) * mask,
        "values": 0.1 * torch.randn(rows, response_width, generator=g) * mask,
        "returns": torch.randn(rows, response_width, generator=g) * mask,
    })


def delta_sample(before: dict, after: dict, points: int = 4096) -> dict:
    """Per parameter, an evenly strided sample of the update's entries (the whole update of a
    25M-parameter model would be 100 MB per file, for a comparison that a sample does as well)."""
    out = {}
    for name, w0 in before.items():
        d = (after[name].float() - w0.float()).flatten()
        out[name] = d[:: max(1, d.numel() // points)][:points].clone()
    return out


def part_workers(ctx: dict, precision: str) -> dict:
    """Actor, reference and critic (FSDP2, world size 1, in-process) on ``ctx["device"]``: log-probs,
    values, one SGD update of each trained role, and (fp32) a greedy HF rollout scored by the reference.
    Saves what the comparison needs to ``workers_<tag>_<precision>.pt``."""
    device, sizes = ctx["device"], ctx["workers"]
    path = model_dir(ctx, "compare")
    if device == "cpu" and ctx.get("cpu_threads"):
        torch.set_num_threads(ctx["cpu_threads"])
    cfg = {"model": {"path": path, "mixed_precision": "bfloat16" if precision == "bf16" else None},
           "actor": {**SGD, "ppo_micro_batch_size_per_gpu": sizes["micro"]},
           "critic": {**SGD, "ppo_micro_batch_size_per_gpu": sizes["micro"]},
           "rollout": {"n": 1, "max_new_tokens": sizes["response"], "do_sample": False},
           "trainer": {"device": device}}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timings: dict[str, float] = {}

    def timed(stage, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        timings[stage] = time.perf_counter() - start
        return result

    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, cfg))
    ref = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, cfg, role="ref"))
    critic = LocalWorkerGroup(ClassWithInitArgs(CriticWorker, cfg))
    for name, group in (("actor", actor), ("ref", ref), ("critic", critic)):
        timed(f"init_{name}", group.init_model)
    vocab = actor.worker().module.config.vocab_size
    batch = make_batch(sizes["rows"], sizes["prompt"], sizes["response"], vocab)
    saved: dict = {"response_mask": batch.batch["response_mask"], "weights_sha256": weights_sha256(path)}
    saved.update(timed("compute_log_prob", actor.compute_log_prob, batch).batch.to_dict())
    saved.update(timed("compute_ref_log_prob", ref.compute_ref_log_prob, batch).batch.to_dict())
    saved["values_before"] = timed("compute_values", critic.compute_values, batch).batch["values"]
    for name, group, update in (("actor", actor, actor.update_policy), ("critic", critic, critic.update_critic)):
        before = group.get_full_state_dict()
        saved[f"{name}_metrics"] = mean_over_ranks(timed(f"update_{name}", update, batch))
        saved[f"{name}_delta"] = delta_sample(before, group.get_full_state_dict())
    saved["log_prob_after"] = actor.compute_log_prob(batch).batch["old_log_probs"]
    saved["values_after"] = critic.compute_values(batch).batch["values"]
    out = {}
    if precision == "fp32":
        rollout = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, cfg))
        timed("init_rollout", rollout.init_model)
        prompt_mask = batch.batch["attention_mask"][:, : sizes["prompt"]]
        prompts = DataProto.from_dict({"input_ids": batch.batch["prompts"], "attention_mask": prompt_mask,
                                       "position_ids": (prompt_mask.cumsum(-1) - 1).clamp(min=0)})
        gen = timed("generate", rollout.generate_sequences, prompts)
        scored = ref.compute_ref_log_prob(gen).batch["ref_log_prob"]
        mask = gen.batch["response_mask"].bool()
        saved["responses_generated"] = gen.batch["responses"]
        gap = float(((gen.batch["rollout_log_probs"] - scored).abs() * mask).max())
        tol = TOLERANCES["fp32"]["rollout_log_prob"]
        out["rollout"] = {"tokens_per_s": round(gen.meta_info["rollout/tokens_per_s"], 1),
                          "rollout_vs_ref_log_prob_max_abs": gap, "tolerance": tol, "ok": gap <= tol}
        rollout.shutdown()
    torch.save(saved, Path(ctx["work"]) / f"workers_{ctx['tag']}_{precision}.pt")
    tokens = int(batch.batch["attention_mask"].sum())
    out["seconds"] = {k: round(v, 3) for k, v in timings.items()}  # single calls, the first ones warm-up included
    out["tokens_per_s"] = {k: round(tokens / v, 1) for k, v in timings.items() if not k.startswith("init") and k != "generate"}
    out["actor_metrics"], out["critic_metrics"] = saved["actor_metrics"], saved["critic_metrics"]
    out.update(peak_memory(device))
    for group in (actor, ref, critic):
        group.shutdown()
    out["ok"] = out.get("rollout", {}).get("ok", True)
    out["summary"] = (f"{device} {precision}: log-prob {out['tokens_per_s']['compute_log_prob']:.0f} tok/s, "
                      f"actor update {out['tokens_per_s']['update_actor']:.0f} tok/s"
                      + (f", peak {out['peak_allocated_gib']} GiB" if device == "cuda" else "")
                      + (f", rollout-vs-ref |dlogp| {out['rollout']['rollout_vs_ref_log_prob_max_abs']:.1e}"
                         if "rollout" in out else ""))
    return out


# ----------------------------------------------------------------------------- compare
def _max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.float() - b.float()).abs() * mask).max())


def _update_rel(a: dict, b: dict) -> float:
    """Relative L2 error of update ``a`` against ``b``, over every parameter's sample."""
    da, db = torch.cat([a[k] for k in sorted(b)]), torch.cat([b[k] for k in sorted(b)])
    return float((da - db).norm() / db.norm().clamp(min=1e-30))


def compare(target: dict, reference: dict, precision: str) -> dict:
    """Every difference of a target run from its reference run, against ``TOLERANCES[precision]``."""
    if target["weights_sha256"] != reference["weights_sha256"]:
        return {"ok": False, "error": "the two runs started from different weights"}
    tol, mask = TOLERANCES[precision], reference["response_mask"]
    diffs = {
        "log_prob": _max_abs(target["old_log_probs"], reference["old_log_probs"], mask),
        "ref_log_prob": _max_abs(target["ref_log_prob"], reference["ref_log_prob"], mask),
        "entropy": _max_abs(target["entropys"], reference["entropys"], mask),
        "log_prob_after_update": _max_abs(target["log_prob_after"], reference["log_prob_after"], mask),
        "value": _max_abs(target["values_before"], reference["values_before"], mask),
        "value_after_update": _max_abs(target["values_after"], reference["values_after"], mask),
        "actor_update_rel": _update_rel(target["actor_delta"], reference["actor_delta"]),
        "critic_update_rel": _update_rel(target["critic_delta"], reference["critic_delta"]),
    }
    for role in ("actor", "critic"):
        for key, ref_value in reference[f"{role}_metrics"].items():
            if key.endswith(("loss", "grad_norm")):
                # relative; absolute for values under 1e-3 (a loss near 0 would make any difference huge)
                diffs[f"{key}_rel"] = abs(target[f"{role}_metrics"][key] - ref_value) / max(abs(ref_value), 1e-3)
    limits = {k: tol["update_rel"] if k.endswith("update_rel") else tol["metric_rel"] if k.endswith("_rel")
              else tol["value"] if k.startswith("value") else tol["log_prob"] for k in diffs}
    failed = sorted(k for k in diffs if not diffs[k] <= limits[k])  # NaN fails too
    out = {"diffs": diffs, "tolerances": limits, "failed": failed, "ok": not failed}
    if "responses_generated" in target and "responses_generated" in reference:
        same = (target["responses_generated"] == reference["responses_generated"]).all(-1).float().mean()
        out["greedy_rows_identical"] = float(same)  # informative: near-ties of a random model may flip
    return out


def part_compare(ctx: dict) -> dict:
    """Target (CUDA) against reference (CPU) per precision, and bf16 against fp32 on the reference
    device (the size of bf16's own noise, for reading the bf16 tolerances)."""
    def load(tag: str, precision: str) -> dict:
        return torch.load(Path(ctx["work"]) / f"workers_{tag}_{precision}.pt", weights_only=False)

    out = {}
    for precision in ctx["precisions"]:
        try:
            out[precision] = compare(load("target", precision), load("reference", precision), precision)
        except FileNotFoundError as exc:
            out[precision] = {"ok": False, "error": f"missing run: {exc.filename}"}
    if {"fp32", "bf16"} <= set(ctx["precisions"]):
        try:
            gap = compare(load("reference", "bf16"), load("reference", "fp32"), "bf16")["diffs"]
            out["bf16_vs_fp32_on_reference"] = {k: gap[k] for k in ("log_prob", "value", "actor_update_rel")}
        except FileNotFoundError:
            pass
    out["ok"] = all(v.get("ok", False) for k, v in out.items() if k in ctx["precisions"])
    out["summary"] = "; ".join(
        f"{p}: " + ("ok" if out[p].get("ok") else f"FAILED {out[p].get('failed') or out[p].get('error')}")
        + (f" (|dlogp| {out[p]['diffs']['log_prob']:.1e}, update rel {out[p]['diffs']['actor_update_rel']:.1e})"
           if "diffs" in out[p] else "") for p in ctx["precisions"])
    return out


# ----------------------------------------------------------------------------- recipes
def part_recipe(ctx: dict, name: str) -> dict:
    """A few steps of a recipe's default config (composed by Hydra, as ``python -m recipes.<name>``
    would) on ``trainer.device``, in this process: stage times, tokens/s per stage, peak GPU memory."""
    spec = ctx["recipes"]
    device = ctx["device"]
    overrides = [f"model.path={model_dir(ctx, 'recipe')}", "trainer.backend=local", f"trainer.device={device}",
                 f"trainer.output_dir={Path(ctx['work']) / 'runs'}", f"trainer.run_name={name}",
                 "trainer.loggers=[jsonl]", f"trainer.total_steps={spec['steps']}", "trainer.val_freq=0",
                 "trainer.val_before_train=false", "trainer.save_freq=0", f"trainer.cpus_per_proc={spec['threads']}",
                 *spec["overrides"].get("all", []), *spec["overrides"].get(name, [])]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(name, overrides=overrides)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run = {"grpo": recipes.grpo, "ppo": recipes.ppo}[name].train(cfg)
    wall = time.perf_counter() - start
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    steady = rows[1:] if len(rows) > 1 else rows  # the first step pays for warm-up (kernels, allocator)

    def mean(key: str) -> float:
        values = [r[key] for r in steady if key in r]
        return sum(values) / len(values) if values else float("nan")

    keys = sorted({k for r in steady for k in r})
    out = {"steps": len(rows), "wall_s": round(wall, 2), "first_step_s": round(rows[0]["timing_s/step"], 3),
           "step_s": round(mean("timing_s/step"), 3),
           "stage_s": {k.split("/", 1)[1]: round(mean(k), 4) for k in keys if k.startswith("timing_s/")},
           "tokens_per_s": {k.split("/", 1)[1]: round(mean(k), 1) for k in keys if k.startswith("throughput/")},
           "rollout_generated_tokens_per_s": round(mean("rollout/tokens_per_s"), 1),
           "model": ctx["models"]["recipe"], **peak_memory(device)}
    bad = sorted({k for r in rows for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)})
    out["non_finite"] = bad
    out["ok"] = len(rows) == spec["steps"] and not bad
    out["summary"] = (f"{out['steps']} steps, {out['step_s']} s/step, gen {out['rollout_generated_tokens_per_s']:.0f} "
                      f"new tok/s, update {out['tokens_per_s'].get('update_actor', float('nan')):.0f} tok/s"
                      + (f", peak {out['peak_allocated_gib']} GiB" if device == "cuda" else ""))
    return out


def part_check_bf16(ctx: dict) -> dict:
    """The consistency check where GPU runs train: GRPO with bf16 on both sides (trainer and engine) on
    ``trainer.device``, 2 steps at lr 1e-6, must warn nothing (its band knows the pair, calibrated from
    step 1); then the same run with the engine's weight load made a no-op (the sync left out) must name
    "weights not synced" at step 1. Reads both runs' verdict files (``<run>/check.jsonl``)."""
    from rlcore.workers.rollout import RolloutWorker

    device = ctx["device"]
    spec = ctx["recipes"]
    base = [f"model.path={model_dir(ctx, 'recipe')}", "trainer.backend=local", f"trainer.device={device}",
            f"trainer.output_dir={Path(ctx['work']) / 'runs'}", "trainer.loggers=[jsonl]", "trainer.total_steps=2",
            "trainer.val_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
            f"trainer.cpus_per_proc={spec['threads']}", "model.mixed_precision=bfloat16", "rollout.dtype=bfloat16",
            "actor.lr=1e-6", "actor.entropy_coeff=0.01", *spec["overrides"].get("all", [])]

    def verdicts(name: str) -> list[dict]:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose("grpo", overrides=[*base, f"trainer.run_name=check_{name}"])
        run = recipes.grpo.train(cfg)
        return [json.loads(line) for line in (run.dir / "check.jsonl").read_text().splitlines() if line.strip()]

    clean = verdicts("clean")
    original = RolloutWorker._load
    RolloutWorker._load = lambda self, state_dict, start: {}  # the sync left out
    try:
        unsynced = verdicts("unsynced")
    finally:
        RolloutWorker._load = original
    warned = [(r["step"], r["cause"]) for r in clean if r["kind"] == "warning"]
    first = next(((r["step"], r["cause"]) for r in unsynced if r["kind"] == "verdict"), None)
    out = {"clean_warnings": warned, "clean_numbers": [r["numbers"] for r in clean if r["kind"] == "verdict"],
           "unsynced_first_verdict": first}
    out["ok"] = not warned and first == (1, "weights_not_synced")
    out["summary"] = (f"bf16 clean: {'silent' if not warned else warned}; sync left out: step-1 verdict {first}")
    return out


PARTS = {
    "env": part_env,
    "workers_fp32": lambda ctx: part_workers(ctx, "fp32"),
    "workers_bf16": lambda ctx: part_workers(ctx, "bf16"),
    "compare": part_compare,
    "grpo": lambda ctx: part_recipe(ctx, "grpo"),
    "ppo": lambda ctx: part_recipe(ctx, "ppo"),
    "check_bf16": part_check_bf16,
    "throughput_0.5b": lambda ctx: part_throughput(ctx, "qwen2.5-0.5b"),  # scripts/device_throughput.py
    "throughput_1.5b": lambda ctx: part_throughput(ctx, "qwen2.5-1.5b"),
}


def main(ctx: dict) -> None:
    """Run ``ctx["parts"]`` ([name, budget_s] pairs) in order; after each, rewrite ``ctx["results"]``."""
    results_file = Path(ctx["results"])
    results: dict = {}
    global _alarm_fired
    signal.signal(signal.SIGALRM, _alarm)
    for name, budget in ctx["parts"]:
        print(f"=== part {name} ({ctx['device']}, budget {budget}s)", flush=True)
        start, _alarm_fired = time.perf_counter(), False
        signal.alarm(max(1, int(budget)))
        try:
            result = PARTS[name](ctx)
            result["status"] = "ok" if result.pop("ok", True) else "fail"
        except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
            traceback.print_exc()
            result = {"status": "timeout" if _alarm_fired else "error",
                      "error": f"over its budget of {budget}s" if _alarm_fired else f"{type(exc).__name__}: {exc}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        finally:
            signal.alarm(0)
            gc.collect()  # the part's models, so that the next part's peak memory is its own
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        result["wall_s"] = round(time.perf_counter() - start, 2)
        results[name] = result
        results["imports"] = device_guard.audit()
        results_file.write_text(json.dumps(results, indent=1, default=str))
        print(f"=== part {name}: {result['status']} in {result['wall_s']}s {result.get('summary', result.get('error', ''))}",
              flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
