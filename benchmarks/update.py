"""The actor update alone, on one GRPO step's rows at SmolLM2: its time, MFU and (``--profile``) where it goes.

    python -m benchmarks.update [--model smollm2] [--repeats 3] [--micro-batch 16] [--token-budget N]
    python -m benchmarks.update --profile [--profile-rows 30]      # torch.profiler's table of one update
    python -m benchmarks.update --keep-logits-mb 0,128 --repeats 4    # A/B of the head's recompute, alternating
    python -m benchmarks.update --fused-layers 0,1 --repeats 4        # A/B of model.fused_layers, alternating
    python -m benchmarks.update --fused-layers 0,1 --kept --train-dtype bfloat16 --token-budget 4096  # + what each keeps

The rows are those of ``benchmarks/grpo_vs_trl.py --model smollm2 --task arithmetic_words --prompts 16
--n 8 --new-tokens 32 --micro-batch 16``: the task's 16 chat prompts, left-padded, each repeated n times
in group order, with n responses of exactly ``--new-tokens`` random tokens (the update's cost does not
depend on which tokens were sampled) and non-zero GRPO advantages, so every row is trained. Built as the
benchmark builds rlcore's actor (``ActorWorker`` in this process, one optimizer step per update, fp32
unless ``--train-dtype bfloat16``), without the engine: a few minutes instead of a whole GRPO run.

Reports each update's seconds (the first is warm-up), the useful FLOPs (``benchmarks/machine_limit.py``:
each group's prompt once, each response token once, training as 3 forwards) and their share of the
fp32 (or bf16) matmul peak measured in the same process. ``--profile`` runs one more update under
``torch.profiler`` (CPU, shapes recorded) and prints its operators by self time, grouped by name and
shapes, and the split into matmuls, attention, copies, index ops, the optimizer, elementwise work and
bookkeeping, both as run and counting each group's fastest call (``profile_split``: the estimate that
survives a machine others load). ``--kept`` runs one more update per side counting what autograd keeps
for the backward (``kept_bytes``: every saved tensor's storage once, gathered weights included), per
micro-batch. Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def build_batch(tok, prompts: int, n: int, new_tokens: int, task: str, vocab: int, seed: int = 0):
    """The rollout-layout batch of one every-row GRPO step: prompts x n rows, group after group."""
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
    advantages = ((advantages - advantages.mean(1, keepdim=True)) / advantages.std(1, keepdim=True)).reshape(rows, 1)
    return DataProto.from_dict(
        {"input_ids": torch.cat([prompt_ids_, responses], 1), "attention_mask": attention_mask,
         "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0), "responses": responses,
         "response_mask": response_mask, "advantages": advantages.expand(rows, new_tokens).contiguous()},
        {"uid": np.repeat(np.arange(prompts).astype(str), n).astype(object)})


def build_actor(args):
    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
    from rlcore.workers.actor import ActorWorker

    rows = args.prompts * args.n
    config = {
        "model": {"path": args.model, "mixed_precision": None if args.train_dtype == "fp32" else args.train_dtype,
                  "pack_shared_prompts": args.shared_prompts},
        "actor": {"lr": 1e-5, "weight_decay": 0.0, "ppo_mini_batch_size": rows,
                  "ppo_micro_batch_size_per_gpu": args.micro_batch, "use_dynamic_bsz": bool(args.token_budget),
                  "ppo_max_token_len_per_gpu": args.token_budget or 16384},
    }
    if getattr(args, "keep_logits_mb", None):
        config["actor"]["keep_logits_mb"] = args.keep_logits_mb[0]
    if getattr(args, "fused_layers", None):
        config["model"]["fused_layers"] = args.fused_layers[0]
    group = LocalWorkerGroup(create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorWorker, config)}))
    actor = group.spawn({"actor"})["actor"]
    actor.init_model()
    return actor, group.worker(0, "actor")


KINDS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
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
    parser.add_argument("--train-dtype", default="fp32", choices=["fp32", "bfloat16"])
    parser.add_argument("--shared-prompts", default=True, action=argparse.BooleanOptionalAction)
    parser.add_argument("--keep-logits-mb", type=lambda v: [float(x) for x in v.split(",")], default=None,
                        help="actor.keep_logits_mb; several (comma-separated): the timed updates alternate between them")
    parser.add_argument("--fused-layers", type=lambda v: [bool(int(x)) for x in v.split(",")], default=None,
                        help="model.fused_layers (1 on, 0 off); both (0,1): the timed updates alternate between them")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates after one warm-up")
    parser.add_argument("--kept", action="store_true", help="one more update per side, counting what autograd keeps")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=30)
    args = parser.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.machine_limit import ModelShape, matmul_peak, mfu
    from rlcore.models.fused_layers import install_fused_layers
    from rlcore.models.gguf import resolve_model_path

    args.model = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(args.model)
    model_config = AutoConfig.from_pretrained(args.model)
    batch = build_batch(tok, args.prompts, args.n, args.new_tokens, args.task, model_config.vocab_size)
    actor, worker = build_actor(args)
    prompt_len = float(batch.batch["attention_mask"][:, :-args.new_tokens].sum(1).float().mean())
    flops = ModelShape.from_config(model_config).training_flops(prompt_len, args.prompts, len(batch), args.new_tokens)
    peak = matmul_peak("fp32" if args.train_dtype == "fp32" else "bf16")
    print(f"torch threads {torch.get_num_threads()}, {torch.backends.cpu.get_cpu_capability()}; "
          f"{args.train_dtype} matmul peak {peak / 1e9:.0f} GFLOP/s; update {flops / 1e12:.2f} TFLOP useful "
          f"({len(batch)} rows, prompt {prompt_len:.1f} tokens, {args.new_tokens} new)")
    if args.keep_logits_mb and args.fused_layers:
        parser.error("alternate one setting at a time: --keep-logits-mb or --fused-layers")
    sides = [("keep_logits_mb", v) for v in args.keep_logits_mb or []] or \
        [("fused_layers", int(v)) for v in args.fused_layers or []] or [None]
    times: dict = {side: [] for side in sides}
    cpu_times: dict = {}  # this process's CPU seconds: steadier than wall time where others load the machine
    for i in range(args.repeats + 1):
        side = sides[(i - 1) % len(sides)] if i else sides[0]
        if side is not None and side[0] == "keep_logits_mb":  # the head's own setting (rlcore.workers.response_head)
            worker.head.keep_logits(side[1])
        elif side is not None:  # the model's RMSNorms and MLPs fused or transformers' (rlcore.models.fused_layers)
            install_fused_layers(worker.module, bool(side[1]))
        start, cpu = time.perf_counter(), time.process_time()
        metrics = actor.update_policy(batch)[0]
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if i:
            times[side].append(seconds)
            cpu_times.setdefault(side, []).append(cpu)
        label = " (warm-up)" if i == 0 else ("" if side is None else f" {side[0]}={side[1]:g}")
        print(f"update {i}{label}: {seconds:.2f} s ({cpu:.2f} CPU s), MFU {mfu(flops, seconds, peak):.1%}, "
              f"loss {metrics['actor/loss']:.6f}, grad_norm {metrics['actor/grad_norm']:.4f}", flush=True)
    for side, ts in times.items():
        if ts:
            best, med = min(ts), statistics.median(ts)
            label = "" if side is None else f"{side[0]}={side[1]:g}: "
            print(f"{label}median {med:.2f} s (best {best:.2f}): MFU {mfu(flops, med, peak):.1%} "
                  f"(best {mfu(flops, best, peak):.1%}); CPU seconds median {statistics.median(cpu_times[side]):.2f} "
                  f"(best {min(cpu_times[side]):.2f})")
    for side in sides if args.kept else []:
        if side is not None and side[0] == "keep_logits_mb":
            worker.head.keep_logits(side[1])
        elif side is not None:
            install_fused_layers(worker.module, bool(side[1]))
        sizes = kept_bytes(worker.module, lambda: actor.update_policy(batch))
        most = max(sizes)
        label = "" if side is None else f"{side[0]}={side[1]:g}: "
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
