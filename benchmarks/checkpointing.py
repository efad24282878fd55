"""What gradient checkpointing costs in speed: the SmolLM2 preset's actor update with it off and on,
sides alternating in one process, on one GRPO-shaped batch.

    python -m benchmarks.checkpointing [--model smollm2] [--repeats 3] [--groups 10] [--threads N]

One ``ActorWorker`` (the preset's actor settings: bf16 compute, fp32 weights, fused AdamW, packed
micro-batches of up to 4096 tokens holding each group's prompt once) updates on the same batch again
and again, ``model.gradient_checkpointing`` switched between updates (``gradient_checkpointing_enable``
/ ``_disable`` on the model: the same weights and optimizer, only the backward differs); the sides
alternate, off first and on first in turn, after one warm-up update of each. The batch: ``--groups``
prompt groups of 8 rows (47-token prompt, responses of 8-32 tokens, advantages of both signs: the
rows a step trains; the preset's step 2 trained 10 of 16 groups). Reported: the medians of each
side's wall seconds and of this process's CPU seconds (steadier than wall time on a shared machine)
and their ratio, on vs off. The memory side of the trade is measured on the whole run
(``benchmarks/memory.py``; docs/real_models.md, "Memory"). Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers import AutoConfig

from rlcore.models import build_tiny_model
from rlcore.models.gguf import resolve_model_path
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker


def grpo_batch(groups: int, vocab: int, prompt_len: int = 47, max_response: int = 32, seed: int = 0) -> DataProto:
    """``groups`` x 8 rows in the rollout layout: each group one prompt, its rows' responses of 8 to
    ``max_response`` tokens (right-padded), advantages +-1 per row (never all one sign in a group)."""
    g = torch.Generator().manual_seed(seed)
    n = groups * 8
    low = min(100, vocab // 2)  # ordinary tokens, no special ones
    prompts = torch.randint(low, vocab, (groups, prompt_len), generator=g).repeat_interleave(8, 0)
    lengths = torch.randint(8, max_response + 1, (n,), generator=g)
    response_mask = torch.arange(max_response).expand(n, -1) < lengths[:, None]
    responses = torch.randint(low, vocab, (n, max_response), generator=g) * response_mask
    attention_mask = torch.cat([torch.ones(n, prompt_len, dtype=torch.bool), response_mask], 1).long()
    signs = torch.tensor([1.0, -1.0]).repeat(n // 2)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask.float(), "advantages": signs[:, None] * response_mask,
    }, meta_info={"temperature": 0.7})


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a HF directory, a .gguf, or smollm2")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates per side")
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 groups, 1 update a side (the suite's check)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.groups, args.repeats = build_tiny_model(tempfile.mkdtemp()), 2, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    config = {"model": {"path": resolve_model_path(args.model)},
              "actor": {"lr": 1.0e-5, "weight_decay": 0.0, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 4096},
              "trainer": {"device": "cpu"}}
    group = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), world_size=1)
    group.init_model()
    model = group.worker().module
    vocab = AutoConfig.from_pretrained(config["model"]["path"]).vocab_size
    batch = grpo_batch(args.groups, vocab, prompt_len=12 if args.quick else 47, max_response=8 if args.quick else 32)

    def update(checkpointing: bool) -> tuple[float, float, float]:
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = group.update_policy(batch)
        return time.perf_counter() - wall, time.process_time() - cpu, metrics[0]["actor/loss"]

    update(False), update(True)  # warm-up
    times = {False: [], True: []}
    for r in range(args.repeats):
        for side in ((False, True) if r % 2 == 0 else (True, False)):
            times[side].append(update(side))
    result = {}
    for side, name in ((False, "off"), (True, "on")):
        result[name] = {"wall_s": statistics.median(t[0] for t in times[side]),
                        "cpu_s": statistics.median(t[1] for t in times[side])}
    result["on_over_off"] = {k: result["on"][k] / result["off"][k] for k in ("wall_s", "cpu_s")}
    tokens, prompt_len = int(batch.batch["attention_mask"].sum()), batch.batch["input_ids"].shape[1] - batch.batch["responses"].shape[1]
    print(f"{args.groups * 8} rows, {tokens} tokens ({args.groups} prompts counted once: "
          f"{tokens - (args.groups * 7 * prompt_len)}), {args.repeats} updates a side, {torch.get_num_threads()} threads")
    for name in ("off", "on"):
        print(f"checkpointing {name:>3}: {result[name]['wall_s']:.2f} s wall, {result[name]['cpu_s']:.2f} s CPU (medians)")
    print(f"on / off: {result['on_over_off']['wall_s']:.3f} wall, {result['on_over_off']['cpu_s']:.3f} CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
