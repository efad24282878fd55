"""The actor update alone, on one GRPO step's rows at SmolLM2: its time, MFU and (``--profile``) where it goes.

    python -m benchmarks.update [--model smollm2] [--repeats 3] [--micro-batch 16] [--token-budget N]
    python -m benchmarks.update --profile [--profile-rows 30]      # torch.profiler's table of one update
    python -m benchmarks.update --keep-logits-mb 0,128 --repeats 4    # A/B of the head's recompute, alternating
    python -m benchmarks.update --release-memory 0,1 --repeats 4    # A/B of the heap trims (release_memory + trim_in_update)
    python -m benchmarks.update --fused-layers 0,1 --repeats 4        # A/B of model.fused_layers, alternating
    python -m benchmarks.update --head-mb 64:128,96:192 --repeats 8   # A/B of actor.logits_chunk_mb:keep_logits_mb
    python -m benchmarks.update --keep-large-blocks 0,1 --repeats 8   # A/B of trainer.keep_large_blocks
    python -m benchmarks.update --cpu-matmul onednn,torch --repeats 4   # A/B of model.cpu_matmul
    python -m benchmarks.update --fused-layers 0,1 --kept --train-dtype bfloat16 --token-budget 4096  # + what each keeps
    python -m benchmarks.update --trained-groups 6 --token-budget 4096   # as the recipes run it (below)

The rows are those of ``benchmarks/grpo_vs_trl.py --model smollm2 --task arithmetic_words --prompts 16
--n 8 --new-tokens 32 --micro-batch 16``: the task's 16 chat prompts, left-padded, each repeated n times
in group order, with n responses of exactly ``--new-tokens`` random tokens (the update's cost does not
depend on which tokens were sampled) and non-zero GRPO advantages, so every row is trained; with
``--trained-groups K`` only K groups have non-zero advantages and the update skips the other rows
(``actor.skip_zero_advantage_rows``: grpo_vs_trl's ``--skip-zero-advantage-rows``, whose SmolLM2 steps
trained 5-7 of 16 groups), with ``--token-budget 4096`` packed as the recipes pack. Built as the
benchmark builds rlcore's actor (``ActorWorker`` in this process, one optimizer step per update, fp32
unless ``--train-dtype bfloat16``), without the engine: a few minutes instead of a whole GRPO run.

Reports the micro-batches (rows, prompt groups, tokens as packed), each update's seconds (the first is
warm-up), CPU user and system seconds and minor page faults (fresh memory the kernel zeroes), the useful
FLOPs (``benchmarks.grpo_vs_trl.useful_flops``: the trained rows, each group's prompt once, each response
token once, training as 3 forwards) and their share of the fp32 (or bf16) matmul peak measured in the
same process (before and after the updates; the medians count the better reading), and the process's peak RSS. ``--profile`` runs one more update under
``torch.profiler`` (CPU, shapes recorded) and prints its operators by self time, grouped by name and
shapes, and the split into matmuls, attention, copies, index ops, the optimizer, elementwise work and
bookkeeping, both as run and counting each group's fastest call (``profile_split``: the estimate that
survives a machine others load). ``--kept`` runs one more update per side counting what autograd keeps
for the backward (``kept_bytes``: every saved tensor's storage once, gathered weights included), per
micro-batch. Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import statistics
import time

import numpy as np
import torch


def build_batch(tok, prompts: int, n: int, new_tokens: int, task: str, vocab: int, seed: int = 0,
                trained_groups: int | None = None):
    """The rollout-layout batch of one GRPO step: prompts x n rows, group after group. Every group's
    advantages are non-zero, or (``trained_groups``) only those of that many groups spread over the
    batch, the others' all zero: a binary reward (final_number) gives a group whose samples all score
    alike a zero advantage on every row, and a mixed group a non-zero one on every row."""
    from benchmarks.grpo_vs_trl import make_prompts, prompt_ids
    from rlcore.data.dataset import collate_prompts
    from rlcore.protocol import DataProto

    examples = make_prompts(prompts, task)
    items = [{"input_ids": torch.tensor(prompt_ids(tok, e["prompt"])), "uid": str(i)} for i, e in enumerate(examples)]
    tensors, _ = collate_prompts(items, tok.pad_token_id)
    gen = torch.Generator().manual_seed(seed)
    prompt_ids_, prompt_mask = (tensors[k].repeat_interleave(n, 0) for k in ("input_ids", "attention_mask"))
    rows = prompt_ids_.shape[0]
    responses = torch.randint(0, vocab, (rows, new_tokens), generator=gen)
    response_mask = torch.ones_like(responses)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    advantages = torch.randn(prompts, n, generator=gen)
    advantages = (advantages - advantages.mean(1, keepdim=True)) / advantages.std(1, keepdim=True)
    if trained_groups is not None:
        mixed = torch.zeros(prompts, dtype=torch.bool)
        mixed[torch.linspace(0, prompts - 1, trained_groups).round().long()] = True
        advantages[~mixed] = 0.0
    advantages = advantages.reshape(rows, 1)
    return DataProto.from_dict(
        {"input_ids": torch.cat([prompt_ids_, responses], 1), "attention_mask": attention_mask,
         "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": responses,
         "response_mask": response_mask, "advantages": advantages.expand(rows, new_tokens).contiguous()},
        {"uid": np.repeat(np.arange(prompts).astype(str), n).astype(object)})


def huge_page_counts() -> dict[str, int]:
    """The kernel's huge-page and compaction counters (/proc/vmstat; the whole machine's, not this process's)."""
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {k: int(v) for k, v in pairs if k in ("thp_fault_alloc", "thp_fault_fallback", "compact_stall")}
    except OSError:
        return {}


def packed_tokens(batch, ix) -> int:
    """The tokens a shared-prompt pack of rows ``ix`` holds: their valid tokens less the borrowed prompts."""
    from rlcore.workers.packing import borrowed_prompt_tokens

    rows = batch[ix].batch
    return int(rows["attention_mask"].sum()) - borrowed_prompt_tokens(rows)


def build_actor(args):
    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
    from rlcore.workers.actor import ActorWorker

    rows = args.prompts * args.n
    config = {
        "model": {"path": args.model, "mixed_precision": None if args.train_dtype == "fp32" else args.train_dtype,
                  "pack_shared_prompts": args.shared_prompts},
        "actor": {"lr": 1e-5, "weight_decay": 0.0, "ppo_mini_batch_size": rows,
                  "ppo_micro_batch_size_per_gpu": args.micro_batch, "use_dynamic_bsz": bool(args.token_budget),
                  "ppo_max_token_len_per_gpu": args.token_budget or 16384,
                  "skip_zero_advantage_rows": args.trained_groups is not None},
    }
    if getattr(args, "keep_logits_mb", None):
        config["actor"]["keep_logits_mb"] = args.keep_logits_mb[0]
    if getattr(args, "fused_layers", None):
        config["model"]["fused_layers"] = args.fused_layers[0]
    if getattr(args, "cpu_matmul", None):
        config["model"]["cpu_matmul"] = args.cpu_matmul[0]
    group = LocalWorkerGroup(create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorWorker, config)}))
    actor = group.spawn({"actor"})["actor"]
    actor.init_model()
    return actor, group.worker(0, "actor")


def set_release_memory(worker, on: bool) -> None:
    """``trainer.release_memory`` with ``trainer.trim_in_update`` on the actor worker between updates: its heap
    trims after the update, before each backward and between layers, or none (the worker's next update
    hooks its layers or unhooks them)."""
    worker.release_memory = worker.trim_in_update = on


def set_fused_layers(worker, on: bool) -> None:
    """``model.fused_layers`` on the actor's model between updates: its RMSNorms and MLPs fused or transformers'."""
    from rlcore.models.fused_layers import install_fused_layers

    install_fused_layers(worker.module, on)


def shown(side) -> str:
    """An A/B side as printed: 64, 1, or 96:192 for a pair."""
    if isinstance(side, str):
        return side
    return ":".join(f"{x:g}" for x in side) if isinstance(side, tuple) else f"{side:g}"


def set_keep_large_blocks(on: bool) -> None:
    """``trainer.keep_large_blocks`` for this process between updates: glibc's heap keeps large freed blocks, or
    maps and unmaps each (its defaults; the heap trimmed first, so the side starts from what it would keep)."""
    from rlcore.engines.host_memory import keep_large_blocks, trim_heap

    trim_heap()
    if not keep_large_blocks(on):
        raise SystemExit("--keep-large-blocks needs glibc's mallopt")


def set_head_mb(worker, chunk_mb: float, keep_mb: float) -> None:
    """``actor.logits_chunk_mb`` and ``actor.keep_logits_mb`` on the actor's head between updates: how many
    positions' fp32 logits it scores at once, and how many it keeps for the backward (rlcore.algos.token_scores)."""
    from rlcore.algos.token_scores import chunk_tokens_for

    worker.head.chunk_tokens = chunk_tokens_for(worker.head.out_features, chunk_mb)
    worker.head.keep_logits(keep_mb)


def set_cpu_matmul(worker, choice: str) -> None:
    """``model.cpu_matmul`` on the actor between updates: its fp32 linears and head on oneDNN, or torch's."""
    from rlcore.models.cpu_matmul import install_cpu_matmul

    install_cpu_matmul(worker.module, choice)  # the head's flag too


def ab_knobs(args) -> list[tuple[str, list | None]]:
    """The settings an A/B alternates between updates (the first one given on the command line)."""
    return [("keep_logits_mb", args.keep_logits_mb), ("release_memory", args.release_memory),
            ("fused_layers", args.fused_layers), ("head_mb", args.head_mb),
            ("keep_large_blocks", args.keep_large_blocks), ("cpu_matmul", args.cpu_matmul)]


SETTERS = {  # each knob set on the live worker between updates
    "keep_logits_mb": lambda worker, mb: worker.head.keep_logits(mb),  # rlcore.workers.response_head
    "release_memory": set_release_memory,
    "fused_layers": set_fused_layers,
    "head_mb": lambda worker, mbs: set_head_mb(worker, *mbs),
    "keep_large_blocks": lambda worker, on: set_keep_large_blocks(on),
    "cpu_matmul": lambda worker, choice: set_cpu_matmul(worker, choice),
}

KINDS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")),
         ("attention (SDPA)", ("scaled_dot_product",)),
         ("copies (copy_, cat, fill_)", ("aten::copy_", "aten::cat", "aten::fill_", "aten::zero_")),
         ("index ops", ("index", "scatter", "gather", "embedding")),
         ("optimizer (fused AdamW)", ("_fused_adamw",)),
         ("elementwise and reductions", ("aten::",)))


def kind_of(name: str) -> str:
    for kind, marks in KINDS:
        if any(m in name for m in marks):
            return kind
    return "Python, autograd and FSDP2 bookkeeping"


def profile_split(prof, rows: int) -> None:
    """Self CPU time per operator and shapes, and per kind of work, as run and as each group's fastest
    call times its count: on a machine others load, an operator's fastest call is the nearest to what it
    costs alone (calls with thread synchronisation inside are slowed most by load), and every layer
    repeats the same shapes 30 times. Groups of one call keep their loaded time in both columns."""
    groups: dict[tuple[str, str], list[float]] = {}
    for event in prof.events():
        groups.setdefault((event.name, str(event.input_shapes)), []).append(event.self_cpu_time_total)
    table = sorted(((min(t) * len(t), sum(t), len(t), name, shapes) for (name, shapes), t in groups.items()), reverse=True)
    fastest, as_run = sum(r[0] for r in table), sum(r[1] for r in table)
    print(f"self CPU time: {as_run / 1e6:.2f} s as run, {fastest / 1e6:.2f} s counting each group's fastest call")
    kinds: dict[str, list[float]] = {}
    for est, total, _, name, _ in table:
        kinds.setdefault(kind_of(name), [0.0, 0.0])
        kinds[kind_of(name)][0] += est
        kinds[kind_of(name)][1] += total
    for kind, (est, total) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:40s} {est / 1e6:7.2f} s {est / max(fastest, 1):6.1%}   (as run {total / 1e6:7.2f} s {total / max(as_run, 1):6.1%})")
    for est, total, count, name, shapes in table[:rows]:
        print(f"  {est / 1e3:9.1f} ms (as run {total / 1e3:9.1f}) x{count:4d} {name[:48]:48s} {shapes[:100]}")


def kept_bytes(module, update) -> list[tuple[int, int]]:
    """(bytes, tokens) autograd keeps for the backward of each forward of ``module`` while ``update()``
    runs: every tensor saved (``saved_tensors_hooks``) between the forward's start and end, each storage once."""
    sizes, current, tokens = [], {}, [0]

    def pack(t):
        storage = t.untyped_storage()
        current[storage.data_ptr()] = storage.nbytes()
        return t

    def start(_, args, kwargs):
        current.clear()
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens[0] = int(ids.numel()) if ids is not None else 0

    def end(*_):
        sizes.append((sum(current.values()), tokens[0]))

    hooks = [module.register_forward_pre_hook(start, with_kwargs=True), module.register_forward_hook(end)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            update()
    finally:
        for h in hooks:
            h.remove()
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="arithmetic_words")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=None)
    parser.add_argument("--trained-groups", type=int, default=None,
                        help="as the recipes run it: only this many groups have non-zero advantages, and the update "
                             "skips the others' rows (actor.skip_zero_advantage_rows); grpo_vs_trl's as-run steps "
                             "trained 5-7 of 16")
    parser.add_argument("--train-dtype", default="fp32", choices=["fp32", "bfloat16"])
    parser.add_argument("--shared-prompts", default=True, action=argparse.BooleanOptionalAction)
    parser.add_argument("--keep-logits-mb", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="actor.keep_logits_mb; several (comma-separated): the timed updates alternate between them")
    parser.add_argument("--release-memory", type=lambda v: [bool(int(x)) for x in v.split(",")], default=None,
                        help="A/B of trainer.release_memory (the heap trimmed between the backward's layers and after "
                             "the update), alternating: e.g. 0,1")
    parser.add_argument("--fused-layers", type=lambda v: [bool(int(x)) for x in v.split(",")], default=None,
                        help="model.fused_layers (1 on, 0 off); both (0,1): the timed updates alternate between them")
    parser.add_argument("--head-mb", type=lambda v: [tuple(float(y) for y in x.split(":")) for x in v.split(",")],
                        default=None, help="A/B of actor.logits_chunk_mb:actor.keep_logits_mb pairs, e.g. 64:128,96:192")
    parser.add_argument("--keep-large-blocks", type=lambda v: [bool(int(x)) for x in v.split(",")], default=None,
                        help="A/B of trainer.keep_large_blocks (0,1): glibc's heap keeps large freed blocks")
    parser.add_argument("--cpu-matmul", type=lambda v: v.split(","), default=None,
                        help="A/B of model.cpu_matmul (onednn,torch): the fp32 linears on oneDNN or on torch's MKL")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates after one warm-up per A/B side")
    parser.add_argument("--kept", action="store_true", help="one more update per side, counting what autograd keeps")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=30)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.grpo_vs_trl import useful_flops
    from benchmarks.machine_limit import MeasuredPeak, ModelShape, mfu
    from rlcore.models.gguf import resolve_model_path

    args.model = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    model_config = AutoConfig.from_pretrained(args.model)
    batch = build_batch(tok, args.prompts, args.n, args.new_tokens, args.task, model_config.vocab_size,
                        trained_groups=args.trained_groups)
    actor, worker = build_actor(args)
    # counted as grpo_vs_trl counts its update: the rows trained, each group's prompt once
    flops = useful_flops(ModelShape.from_config(model_config), batch, args.trained_groups is not None)["update"]
    kept = (batch.batch["advantages"] != 0).any(-1)  # every row unless --trained-groups
    kept = kept if args.trained_groups is not None else torch.ones_like(kept)
    prompt_len = float(batch.batch["attention_mask"][kept, :-args.new_tokens].sum(1).float().mean())
    peaks = MeasuredPeak(["fp32" if args.train_dtype == "fp32" else "bf16"])
    peak = peaks.measure("start")[peaks.dtypes[0]]  # again after the updates: the MFU below is against the better
    print(f"torch threads {torch.get_num_threads()}, {torch.backends.cpu.get_cpu_capability()}; "
          f"{args.train_dtype} matmul peak at the start {peaks.describe()}; update {flops / 1e12:.2f} TFLOP useful "
          f"({int(kept.sum())} of {len(batch)} rows trained, prompt {prompt_len:.1f} tokens, {args.new_tokens} new)")
    rows_with_grad = worker._rows_with_grad() if args.trained_groups is not None else None
    micro = [ix for ix, counts in worker.trained_micro_batches(batch, rows_with_grad) if counts]
    uids = batch.non_tensor_batch["uid"]
    print("micro-batches (rows, groups, tokens as packed): " + ", ".join(
        f"({len(ix)}, {len(set(uids[ix]))}, {packed_tokens(batch, ix)})" for ix in micro))
    if sum(bool(values) for _, values in ab_knobs(args)) > 1:
        parser.error("alternate one setting at a time (--keep-logits-mb, --release-memory, --fused-layers, ...)")
    knob, sides = next(((name, values) for name, values in ab_knobs(args) if values), (None, [None]))
    times: dict = {side: [] for side in sides}
    cpu: dict = {side: [] for side in sides}
    for i in range(len(sides) + args.repeats):  # each side warmed up once, then the timed updates alternate
        side = sides[i % len(sides)]
        if knob:
            SETTERS[knob](worker, side)
        before, vm_before = resource.getrusage(resource.RUSAGE_SELF), huge_page_counts()
        start = time.perf_counter()
        metrics = actor.update_policy(batch)[0]
        seconds = time.perf_counter() - start
        after, vm = resource.getrusage(resource.RUSAGE_SELF), huge_page_counts()
        user_s, system_s = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        faults = after.ru_minflt - before.ru_minflt
        warm = i < len(sides)
        if not warm:
            times[side].append(seconds)
            cpu[side].append(user_s + system_s)
        label = " (warm-up)" if warm else ""
        label += "" if side is None else f" {knob}={shown(side)}"
        print(f"update {i}{label}: {seconds:.2f} s, MFU {mfu(flops, seconds, peak):.1%}, "
              f"loss {metrics['actor/loss']:.6f}, grad_norm {metrics['actor/grad_norm']:.4f}, "
              f"shared_prompt_frac {metrics.get('actor/shared_prompt_frac', 0):.3f}; "
              f"CPU user {user_s:.1f} s, system {system_s:.1f} s, minor page faults {faults} "
              f"({faults * mmap.PAGESIZE / 2**30:.2f} GiB), major {after.ru_majflt - before.ru_majflt}, "
              f"machine's {', '.join(f'{k} +{vm[k] - vm_before[k]}' for k in vm)}",
              flush=True)
    peaks.measure("end")
    if peaks.best[peaks.dtypes[0]] > peak:
        peak = peaks.best[peaks.dtypes[0]]
        print(f"matmul peak, the better of the start and the end: {peaks.describe()}; the MFU per update above "
              f"was against the start's, the medians below are against the better")
    for side, ts in times.items():
        if ts:
            best, med = min(ts), statistics.median(ts)
            label = "" if side is None else f"{knob}={shown(side)}: "
            label += f"CPU median {statistics.median(cpu[side]):.2f} s, "
            print(f"{label}median {med:.2f} s (best {best:.2f}): MFU {mfu(flops, med, peak):.1%} "
                  f"(best {mfu(flops, best, peak):.1%})")
    print(f"peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB; "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    for side in sides if args.kept else []:
        if knob:
            SETTERS[knob](worker, side)
        sizes = kept_bytes(worker.module, lambda: actor.update_policy(batch))
        most = max(sizes)
        label = "" if side is None else f"{knob}={shown(side)}: "
        total, tokens = sum(b for b, _ in sizes), sum(t for _, t in sizes)
        print(f"{label}kept for the backward: largest micro-batch {most[0] / 2**30:.3f} GiB ({most[1]} tokens); "
              f"{len(sizes)} micro-batches {total / 2**30:.3f} GiB for {tokens} tokens, "
              f"{total / max(tokens, 1) / 1024:.1f} KiB a token", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            actor.update_policy(batch)
        profile_split(prof, args.profile_rows)


if __name__ == "__main__":
    main()
