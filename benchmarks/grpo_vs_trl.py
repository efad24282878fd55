"""One GRPO step, rlcore vs TRL's GRPOTrainer, on the same model, prompts and sizes (CPU).

    pip install "trl==1.16.0"        # not a dependency of rlcore; only this benchmark needs it
    python benchmarks/grpo_vs_trl.py --preset small --prompts 32 --n 8 --new-tokens 128 --steps 4
    python benchmarks/grpo_vs_trl.py --model <warm start>/hf --prompts 64 --n 8 --new-tokens 8 \
        --steps 40 --lr 2e-4 --micro-batch 512 --free-length      # reward curves of both
    python benchmarks/grpo_vs_trl.py --model smollm2 --task arithmetic_words --prompts 16 --n 8 \
        --new-tokens 32 --micro-batch 16 --steps 4                 # the real 135M model (49k vocabulary)

Both sides sample prompts x n completions of exactly ``--new-tokens`` tokens (eos ignored, so both
generate the same number of tokens), score them with the same arithmetic reward, compute GRPO
advantages (group mean and std) and take one optimizer step on all completions (one mini-batch,
token-mean loss, constant lr, no weight decay), then the next step uses the updated policy.
``--free-length`` lets both stop at eos instead, to compare reward curves from a warm start:

  rlcore  the hybrid engine in one process: ``RolloutWorker`` (``--backends``: vLLM and/or HF
          ``generate``) colocated with ``ActorWorker``, weights synced in memory after each
          update; every row is trained, as TRL does (``--skip-zero-advantage-rows``: rlcore's
          default); packed micro-batches hold each group's prompt once (``--no-shared-prompts``:
          once per row)
  TRL     ``GRPOTrainer`` with HF ``generate``, beta=0 (no reference model), as on CPU

**Same precision on both sides by default.** ``--dtype fp32`` (the default) trains and samples in
fp32 on both sides; ``--dtype bf16`` trains rlcore in bf16 (``model.mixed_precision``), samples in
bf16 (``rollout.dtype``) and gives TRL ``bf16=True``. ``--train-dtype``, ``--rollout-dtype`` and
``--trl-bf16`` override one side each; a run whose sides differ says so in its report, in capitals.

**Interleaved in time.** Each side runs in its own subprocess (vLLM changes process-wide torch
settings), all started at once, and the driver lets them take their steps in turn (rlcore's step 1,
TRL's step 1, rlcore's step 2, ...; ``--no-interleave``: one side after the other), so a machine
that slows down for a minute slows both sides alike. The first step is warm-up; the report is the
median of the others, the ratio TRL / rlcore (above 1: rlcore faster) per rlcore backend, each
side's dtypes, rlcore's time per stage (generate, reward, advantage, update, sync) with the FLOPs
each did and their share of this machine's matmul peak measured in the same run per dtype, at its
start and its end, the better reading counting (``benchmarks/machine_limit.py``: MFU), the same for TRL's whole step, and the mean reward per 5
steps of both (a random-init model scores ~0 on both sides; from a warm start with
``--free-length`` the two curves should rise alike).
``--json FILE`` writes all of it; ``--quick`` (tiny sizes, HF backend, TRL only where installed)
is what the test suite runs. Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

if not __package__:  # run as a file (python benchmarks/grpo_vs_trl.py, and each side's child): benchmarks.* importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.machine_limit import mfu  # noqa: E402
from benchmarks.results import write_json  # noqa: E402


def make_prompts(count: int, task: str) -> list[dict]:
    """``{"prompt", "answer"}`` rows: raw ``a+b=`` strings for ``arithmetic`` (the tiny models), or
    chat messages of a generated word-problem task (a real chat model; both sides render them with
    the tokenizer's chat template, so they see the same ids)."""
    if task == "arithmetic":
        from rlcore.data.arithmetic import make_arithmetic_examples

        return make_arithmetic_examples(count, seed=0, max_operand=20)
    from rlcore.data.word_problems import make_word_problems

    return make_word_problems(task, count, seed=0)


def prompt_ids(tok, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tok(prompt)["input_ids"]
    return tok(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


def reward_name(task: str) -> str:
    return "arithmetic" if task == "arithmetic" else "final_number"


def useful_flops(shape, batch, skip_zero_advantage_rows: bool) -> dict[str, float]:
    """The step's useful FLOPs (``benchmarks.machine_limit``): sampling every row, and training the
    rows the update took (all, or those with a non-zero advantage), each group's prompt once."""
    responses = batch.batch["response_mask"].sum(-1).float()
    prompts = batch.batch["attention_mask"].sum(-1).float() - responses
    uids = batch.non_tensor_batch["uid"]
    out = {"generate": shape.sampling_flops(float(prompts.mean()), len(set(uids)), len(batch), float(responses.mean()))}
    rows = (batch.batch["advantages"] != 0).any(-1) if skip_zero_advantage_rows else responses >= 0
    kept = rows.nonzero().flatten().tolist()
    out["update"] = (shape.training_flops(float(prompts[kept].mean()), len({uids[i] for i in kept}), len(kept),
                                          float(responses[kept].mean())) if kept else 0.0)
    return out


def wait_for_turn(args) -> None:
    """Interleaved runs: block until the driver gives this side its next step (a line on stdin)."""
    if args.interleave:
        sys.stdin.readline()


def end_turn(args, seconds: float) -> None:
    """Interleaved runs: hand the machine back to the driver."""
    if args.interleave:
        print(f"STEPDONE {seconds:.4f}", flush=True)


def run_rlcore(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.machine_limit import ModelShape, dtype_name
    from rlcore.algos.advantages import compute_grpo_outcome_advantage
    from rlcore.data.dataset import collate_prompts
    from rlcore.protocol import DataProto
    from rlcore.rewards.manager import RuleRewardManager
    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
    from rlcore.workers.actor import ActorWorker
    from rlcore.workers.rollout import RolloutWorker

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = args.prompts * args.n
    # Workers built directly, not by rlcore.trainer.builder, get ppo_mini_batch_size as global rows
    # (the builder turns a run config's prompts into rows): here the whole batch, one optimizer step.
    config = {
        "model": {"path": args.model, "mixed_precision": None if args.train_dtype == "fp32" else args.train_dtype,
                  "attn_implementation": args.attn, "pack_shared_prompts": args.shared_prompts},
        "rollout": {"backend": args.backend, "dtype": args.rollout_dtype, "n": args.n, "max_new_tokens": args.new_tokens,
                    "ignore_eos": not args.free_length, "kv_cache_memory_bytes": 1 << 30},
        "actor": {"lr": args.lr, "weight_decay": 0.0, "ppo_mini_batch_size": rows,
                  "ppo_micro_batch_size_per_gpu": args.micro_batch,
                  "use_dynamic_bsz": bool(args.token_budget), "ppo_max_token_len_per_gpu": args.token_budget or 16384,
                  "skip_zero_advantage_rows": args.skip_zero_advantage_rows},
    }
    if args.release_memory is not None:  # else the trainer's default (rlcore.trainer.config)
        config["trainer"] = {"release_memory": args.release_memory}
    group = LocalWorkerGroup(create_colocated_worker_cls({
        "actor": ClassWithInitArgs(ActorWorker, config), "rollout": ClassWithInitArgs(RolloutWorker, config)}))
    roles = group.spawn({"actor", "rollout"})
    actor, rollout = roles["actor"], roles["rollout"]
    actor.init_model()
    rollout.init_model()
    # The colocated actor trains with the threads this process has once vLLM is up (reported as
    # torch_threads; measured 2 on the 2-core CPU machine: vLLM's CPU worker leaves them as they are).
    threads = torch.get_num_threads()
    train_dtype = group.worker(0, "actor").compute_dtype or "float32"
    engine = group.worker(0, "rollout").engine  # the dtype it samples in, as the engine resolved it
    rollout_dtype = dtype_name(getattr(engine, "dtype", None) or next(engine.model.parameters()).dtype)
    reward = RuleRewardManager(tok, reward_name(args.task), num_workers=0)
    examples = make_prompts(args.prompts, args.task)
    items = [{"input_ids": torch.tensor(prompt_ids(tok, e["prompt"])), "ground_truth": e["answer"], "uid": str(i)}
             for i, e in enumerate(examples)]
    tensors, non_tensors = collate_prompts(items, tok.pad_token_id)
    step_times, rewards, stages, trained, shared, flops = [], [], {}, [], [], {"generate": [], "update": []}
    faults, major, system, user = {}, {}, {}, {}
    shape = ModelShape.from_config(AutoConfig.from_pretrained(args.model))

    def timed(stage, fn, *a):
        before = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        out = fn(*a)
        stages.setdefault(stage, []).append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)  # the kernel's share: page faults (fresh memory) and system time
        faults.setdefault(stage, []).append(after.ru_minflt - before.ru_minflt)
        # read back from disk: code or files the kernel evicted meanwhile (e.g. a DAMON pageout scheme while the other side ran)
        major.setdefault(stage, []).append(after.ru_majflt - before.ru_majflt)
        system.setdefault(stage, []).append(round(after.ru_stime - before.ru_stime, 3))
        user.setdefault(stage, []).append(round(after.ru_utime - before.ru_utime, 3))
        return out

    for _ in range(args.steps):
        wait_for_turn(args)
        start = time.perf_counter()
        batch = timed("generate", rollout.generate_sequences, DataProto.from_dict(tensors, non_tensors))
        batch.union(timed("reward", reward, batch))  # no compute_log_prob: one optimizer step per batch, as in recipes/grpo.py
        adv, _ = timed("advantage", compute_grpo_outcome_advantage, batch.batch["token_level_scores"],
                       batch.batch["response_mask"], batch.non_tensor_batch["uid"])
        batch.batch["advantages"] = adv
        metrics = timed("update", actor.update_policy, batch)[0]
        trained.append(metrics.get("actor/trained_rows_frac", 1.0))
        shared.append(metrics.get("actor/shared_prompt_frac", 0.0))
        timed("sync", rollout.sync_weights)
        step_times.append(time.perf_counter() - start)
        end_turn(args, step_times[-1])
        rewards.append(float(batch.batch["reward_scores"].mean()))
        for stage, value in useful_flops(shape, batch, args.skip_zero_advantage_rows).items():
            flops[stage].append(value)
    assert len(batch) == rows
    assert args.free_length or int(batch.batch["response_mask"].sum()) == rows * args.new_tokens
    return {"step_s": step_times, "reward": rewards, "torch_threads": threads, "stages_s": stages,
            "trained_rows_frac": trained, "shared_prompt_frac": shared, "train_dtype": train_dtype,
            "sample_dtype": rollout_dtype, "flops": flops, "minor_faults": faults, "major_faults": major, "system_s": system,
            "user_s": user}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlcore.rewards.registry import get_reward_fn

    score = get_reward_fn(reward_name(args.task))

    def reward_fn(completions, answer, **_):  # conversational prompts: each completion is [{"role", "content"}]
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [score(t, a) for t, a in zip(texts, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._start = [], 0.0

        def on_step_begin(self, *a, **k):  # TRL samples inside its step (training_step), so the step is all of it
            wait_for_turn(args)
            self._start = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._start)
            end_turn(args, self.times[-1])

    rows = args.prompts * args.n
    tok = AutoTokenizer.from_pretrained(args.model)
    data = Dataset.from_list([{"prompt": e["prompt"], "answer": e["answer"]} for e in make_prompts(args.prompts, args.task)])
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows, num_generations=args.n,
        max_completion_length=args.new_tokens,
        generation_kwargs={} if args.free_length else {"min_new_tokens": args.new_tokens},
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0, use_cpu=True, bf16=args.trl_bf16, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to="none", shuffle_dataset=False, seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward_fn, args=cfg, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    logs = trainer.state.log_history
    rewards = [h["reward"] for h in logs if "reward" in h]
    lengths = [h["completions/mean_length"] for h in logs if "completions/mean_length" in h]
    assert args.free_length or all(abs(n - args.new_tokens) < 1e-6 for n in lengths), f"TRL lengths {lengths}"
    return {"step_s": timer.times, "reward": rewards, "torch_threads": torch.get_num_threads(),
            "train_dtype": "bfloat16 (autocast, bf16=True)" if args.trl_bf16 else "float32",
            "sample_dtype": "bfloat16 (autocast, bf16=True)" if args.trl_bf16 else "float32"}


def cpu_flags() -> dict:
    """What decides the dtypes here: torch's view of the CPU, and the vLLM dtype chosen from it."""
    import torch

    from rlcore.engines.dtype_choice import default_vllm_dtype, native_bf16

    return {"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": native_bf16("cpu")[1],
            "vllm_dtype": default_vllm_dtype("cpu")}


class Side:
    """One side's run in a fresh interpreter (vLLM changes process-wide torch settings), its stdout
    read line by line (``STEPDONE`` after each step when interleaved, ``RESULT`` at the end), its
    stderr kept in a file (shown if it fails)."""

    def __init__(self, name: str, args, backend: str | None = None) -> None:
        skip = ("side", "free_length", "skip_zero_advantage_rows", "trl_bf16", "backends", "json", "quick", "backend",
                "shared_prompts", "interleave", "dtype", "release_memory")
        cmd = [sys.executable, os.path.abspath(__file__), "--side", name.split("-")[0]] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip and v is not None]
        cmd += ["--free-length"] if args.free_length else []
        cmd += ["--skip-zero-advantage-rows"] if args.skip_zero_advantage_rows else []
        cmd += ["--trl-bf16"] if args.trl_bf16 else []
        cmd += [] if args.shared_prompts else ["--no-shared-prompts"]
        cmd += ["--interleave"] if args.interleave else ["--no-interleave"]
        cmd += [] if args.release_memory is None else [f"--{'' if args.release_memory else 'no-'}release-memory"]
        cmd += [f"--backend={backend}"] if backend else []
        self.name, self.timeout_s = name, args.timeout_s
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.out: list[str] = []

    def read_until(self, prefix: str) -> str:
        """The next stdout line starting with ``prefix``; exits naming the side if it dies first. A
        step's own length bounds this (``--timeout-s`` limits the whole side, as before)."""
        for line in self.proc.stdout:
            self.out.append(line)
            if line.startswith(prefix):
                return line[len(prefix):]
        self.fail()

    def step(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.read_until("STEPDONE ")

    def result(self) -> dict:
        line = self.read_until("RESULT ")
        self.proc.wait(timeout=self.timeout_s)
        return json.loads(line)

    def fail(self) -> None:
        self.proc.kill()
        self.err.seek(0)
        sys.exit(f"{self.name} failed:\n{''.join(self.out)[-3000:]}\n{self.err.read()[-3000:]}")


def run_sides(args, names: list[str]) -> dict[str, dict]:
    """All sides started at once; interleaved, each takes its step in turn (which side goes first
    alternates from step to step); else one side after the other."""
    if not args.interleave:
        return {name: Side(name, args, name.split("-", 1)[1] if "-" in name else None).result() for name in names}
    sides = [Side(name, args, name.split("-", 1)[1] if "-" in name else None) for name in names]
    for step in range(args.steps):
        for side in (sides if step % 2 == 0 else sides[::-1]):
            side.step()
    return {side.name: side.result() for side in sides}


def plain(dtype: str | None) -> str:
    """A dtype's name without how it is applied: "bfloat16 (autocast, bf16=True)" -> "bfloat16"."""
    return (dtype or "float32").split(" ")[0]


def dtype_of(result: dict, stage: str) -> str:
    return plain(result.get("sample_dtype" if stage == "generate" else "train_dtype"))


def stage_limits(result: dict, stages: dict, step_s: float, peak: dict, results: dict) -> dict[str, tuple[float, float]]:
    """(useful FLOPs, share of the peak) per stage: rlcore's generate and update from its own counts;
    TRL's whole step against the same useful work (rlcore's counts of both stages, every row: TRL trains
    them all), at its training dtype's peak."""
    if "flops" in result:
        return {stage: (statistics.median(f[1:]), mfu(statistics.median(f[1:]), stages[stage], peak[dtype_of(result, stage)]))
                for stage, f in result["flops"].items() if stage in stages and len(f) > 1}
    ours = next((r for r in results.values() if "flops" in r), None)
    if ours is None or len(ours["flops"]["generate"]) < 2:
        return {}
    work = statistics.median(ours["flops"]["generate"][1:]) + 3 * statistics.median(ours["flops"]["generate"][1:])
    return {"step (sample + train every row)": (work, mfu(work, step_s, peak[dtype_of(result, "update")]))}


def resolve_dtypes(args) -> None:
    """``--dtype`` for both sides unless one side's own flag says otherwise."""
    both_bf16 = args.dtype == "bf16"
    args.train_dtype = args.train_dtype or ("bfloat16" if both_bf16 else "fp32")
    args.rollout_dtype = args.rollout_dtype or ("bfloat16" if both_bf16 else "float32")
    args.trl_bf16 = args.trl_bf16 or both_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=None,
                        help="rlcore's micro-batches by token count (actor.use_dynamic_bsz, ppo_max_token_len_per_gpu; "
                             "the smollm2 preset: 4096) instead of --micro-batch rows")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--backends", default="vllm", help="rlcore's rollout backends to run, comma-separated: vllm,hf")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="both sides' precision: rlcore trains and samples in it, TRL gets bf16=True for bf16")
    parser.add_argument("--rollout-dtype", default=None,
                        help="rlcore's sampling dtype only (rollout.dtype; default: --dtype)")
    parser.add_argument("--train-dtype", default=None, choices=["auto", "bfloat16", "fp32"],
                        help="rlcore's training precision only, model.mixed_precision (default: --dtype; auto: bf16 "
                             "where native and measured faster on this model, rlcore.workers.precision)")
    parser.add_argument("--attn", default=None, choices=["eager", "sdpa"],
                        help="rlcore's model.attn_implementation (default: transformers' choice, sdpa)")
    parser.add_argument("--shared-prompts", default=True, action=argparse.BooleanOptionalAction,
                        help="rlcore's model.pack_shared_prompts: packs hold each group's prompt once (the default)")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL trains with bf16=True (autocast) whatever --dtype says")
    parser.add_argument("--interleave", default=True, action=argparse.BooleanOptionalAction,
                        help="the sides take their steps in turn, so the machine's swings fall on both alike (default)")
    parser.add_argument("--model", help="an HF directory, a .gguf file or smollm2 (default: a fresh tiny model of --preset)")
    parser.add_argument("--task", default="arithmetic", choices=["arithmetic", "arithmetic_words", "multi_step"],
                        help="the prompts: arithmetic (raw a+b=, the tiny models) or a word-problem task through the "
                             "model's chat template (a real chat model: --model smollm2 --task arithmetic_words)")
    parser.add_argument("--skip-zero-advantage-rows", action="store_true",
                        help="rlcore leaves rows with all-zero advantages out of the update (its default in the recipes); "
                             "off here so that both sides train on every row: a random-init model scores 0 on every "
                             "sample, and skipping would leave rlcore nothing to train")
    parser.add_argument("--release-memory", default=None, action=argparse.BooleanOptionalAction,
                        help="rlcore's trainer.release_memory (default: the trainer's own, off): the heap trimmed and vLLM's "
                             "KV cache dropped between phases, less memory for the page faults that take it back")
    parser.add_argument("--free-length", action="store_true",
                        help="stop at eos instead of forcing --new-tokens tokens (for reward curves)")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="limit of one side's subprocess")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 4 prompts x 2 x 4 tokens, 3 steps, hf backend; TRL only if installed")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--side", choices=["rlcore", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.side:
        resolve_dtypes(args)
        result = run_rlcore(args) if args.side == "rlcore" else run_trl(args)
        print("RESULT " + json.dumps(result))
        return
    if args.quick:
        args.preset, args.prompts, args.n, args.new_tokens, args.steps = "tiny", 4, 2, 4, 3
        args.micro_batch, args.backends = 8, "hf"
    backends = args.backends.split(",")
    if not set(backends) <= {"vllm", "hf"}:
        parser.error(f"--backends: choose from vllm, hf (got {args.backends})")

    from rlcore.models.gguf import resolve_model_path
    from rlcore.models.tiny import build_tiny_model

    from benchmarks.machine_limit import MeasuredPeak

    resolve_dtypes(args)
    args.model = resolve_model_path(args.model) or build_tiny_model(tempfile.mkdtemp(), preset=args.preset)
    flags = cpu_flags()
    size, seconds = (256, 0.2) if args.quick else (2048, 1.5)
    peaks = MeasuredPeak(("float32", "bfloat16"), size, seconds)
    peaks.measure("start")  # before the sides start, and again after they end: the better reading counts
    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl and not args.quick:
        sys.exit('TRL is not installed: pip install -e ".[bench]"')
    results = run_sides(args, [f"rlcore-{b}" for b in backends] + (["trl"] if have_trl else []))
    peaks.measure("end")
    peak = peaks.best
    step = {side: statistics.median(r["step_s"][1:]) for side, r in results.items()}
    length = "up to" if args.free_length else "exactly"
    print(f"model {args.model}, task {args.task}, {args.prompts} prompts x {args.n} samples x {length} {args.new_tokens} tokens, "
          f"lr {args.lr}, median of steps 2..{args.steps}, {'interleaved step by step' if args.interleave else 'one side after the other'}")
    print(f"CPU: {flags['capability']}, {flags['native_bf16']}; matmul peak, the better of the run's start and "
          f"end: {peaks.describe()}")
    dtypes = {side: (r.get("sample_dtype"), r.get("train_dtype")) for side, r in results.items()}
    if len({(plain(a), plain(b)) for a, b in dtypes.values()}) > 1:
        print("DTYPES DIFFER BETWEEN THE SIDES: " + "; ".join(f"{side} samples in {a}, trains in {b}"
                                                            for side, (a, b) in dtypes.items()))
    ratios = {}
    for side in results:
        if side != "trl":
            ratio = step["trl"] / step[side] if have_trl else float("nan")
            ratios[side] = ratio
            print(f"{side} step {step[side]:.2f} s | TRL step {step.get('trl', float('nan')):.2f} s | "
                  f"TRL / {side} = {ratio:.2f}")
    limits = {}
    for side, r in results.items():
        blocks = [round(statistics.mean(r["reward"][i:i + 5]), 3) for i in range(0, len(r["reward"]), 5)]
        print(f"  {side:12s} samples in {dtypes[side][0]}, trains in {dtypes[side][1]}, torch threads {r['torch_threads']}, "
              f"step times {[round(t, 2) for t in r['step_s'][:10]]}{' ...' if len(r['step_s']) > 10 else ''}")
        print(f"  {side:12s} mean reward per 5 steps {blocks}")
        stages = {stage: statistics.median(times[1:]) for stage, times in r.get("stages_s", {}).items()}
        if stages:
            print(f"  {side:12s} stages: " + ", ".join(f"{k} {v:.3f} s ({v / step[side]:.0%})" for k, v in stages.items()))
        limits[side] = stage_limits(r, stages, step[side], peak, results)
        for stage, (flops, share) in limits[side].items():
            print(f"  {side:12s} {stage}: {flops / 1e9:.1f} GFLOP useful, {share:.0%} of the {dtype_of(r, stage)} peak")
        if "minor_faults" in r:
            print(f"  {side:12s} per stage and step: minor page faults {r['minor_faults']}, major "
                  f"{r.get('major_faults')}, CPU seconds user "
                  f"{r['user_s']}, system {r['system_s']}")
        if "trained_rows_frac" in r:
            print(f"  {side:12s} rows trained per step {[round(f, 2) for f in r['trained_rows_frac'][:10]]}, "
                  f"share of their tokens held once as shared prompts {[round(f, 2) for f in r['shared_prompt_frac'][:10]]}")
    write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "side"}, "cpu": flags, "step_s": step,
                           "trl_over_rlcore": ratios, "matmul_peak_flops": peak, "matmul_peak_windows": peaks.windows, "dtypes": dtypes,
                           "flops_and_mfu": limits, "results": results})


if __name__ == "__main__":
    main()
