"""Optimizer memory and update time of a LoRA actor against full fine-tuning, same model, same batch.

    python -m benchmarks.lora_memory [--preset small] [--rank 16] [--steps 3] [--json out.json]

Builds an ``ActorWorker`` (FSDP2, one rank, in this process) twice on the same tiny model, once
training every weight and once with ``actor.lora.rank`` adapters on every linear layer, runs
``--steps`` AdamW updates on one synthetic rollout batch, and reports per mode: parameters in
total and trainable, the bytes of AdamW's state (its two moments and step counters, the memory LoRA
is there to save), the bytes of the gradients after a backward, and the median update time. The
savings ratio is printed and written; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from rlcore.algos.losses import LossScale
from rlcore.models import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers import ActorWorker
from benchmarks.results import write_json


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> DataProto:
    """Full-length prompts and responses of random tokens with random advantages (memory and time
    depend on the shapes, not on what the tokens say)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(4, vocab, (rows, response_len), generator=g)
    mask = torch.ones(rows, prompt_len + response_len, dtype=torch.long)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1),
        "response_mask": torch.ones(rows, response_len), "advantages": torch.randn(rows, response_len, generator=g),
    })


def tensor_bytes(value) -> int:
    if not torch.is_tensor(value):
        return 0
    local = value.to_local() if hasattr(value, "to_local") else value  # FSDP2 keeps DTensors: this rank's shard
    return local.numel() * local.element_size()


def measure(model_dir: str, batch: DataProto, rank: int, steps: int, lr: float) -> dict:
    actor = {"optimizer": "adamw", "lr": lr, "ppo_micro_batch_size_per_gpu": len(batch), "lora": {"rank": rank}}
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": model_dir}, "actor": actor}))
    wg.init_model()
    worker = wg.worker(0)
    params = list(worker.module.parameters())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        wg.update_policy(batch)
        times.append(time.perf_counter() - start)
    state = worker.optimizer.state_dict()["state"]
    adam = sum(tensor_bytes(v) for s in state.values() for v in s.values())
    # Gradient memory: one more backward without the step (the step's zero_grad frees them).
    worker.module.train()
    micro = batch.to(worker.device)
    loss, _ = worker._loss(micro, _scale(micro))
    loss.backward()
    grads = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    worker.optimizer.zero_grad(set_to_none=True)
    return {
        "params_total": sum(tensor_bytes(p) // p.element_size() for p in params),
        "params_trainable": sum(tensor_bytes(p) // p.element_size() for p in params if p.requires_grad),
        "param_bytes": sum(tensor_bytes(p) for p in params),
        "adam_state_bytes": adam,
        "grad_bytes": grads,
        "update_s": statistics.median(times[1:] or times),  # the first step also allocates the state
    }


def _scale(micro: DataProto) -> LossScale:
    """The loss normalisation of one rank holding the whole mini-batch (what ``run_updates`` builds)."""
    mask = micro.batch["response_mask"]
    return LossScale(global_tokens=mask.sum(), global_seqs=mask.any(-1).sum().float(), dp_size=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=("tiny", "small"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=64, help="prompt and response length each")
    p.add_argument("--quick", action="store_true", help="the tiny model, rank 4, 2 steps, short rows")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.preset, args.rank, args.steps, args.rows, args.seq = "tiny", 4, 2, 4, 8
    torch.manual_seed(0)
    model_dir = build_tiny_model(tempfile.mkdtemp(), preset=args.preset)
    batch = synthetic_batch(args.rows, args.seq, args.seq, vocab=66)
    full = measure(model_dir, batch, 0, args.steps, lr=1e-5)
    lora = measure(model_dir, batch, args.rank, args.steps, lr=1e-4)
    result = {
        "preset": args.preset, "lora_rank": args.rank, "full": full, "lora": lora,
        "full_adam_bytes": float(full["adam_state_bytes"]), "lora_adam_bytes": float(lora["adam_state_bytes"]),
        "full_over_lora_adam": full["adam_state_bytes"] / lora["adam_state_bytes"],
        "full_over_lora_grad": full["grad_bytes"] / max(lora["grad_bytes"], 1),
        "full_over_lora_update_s": full["update_s"] / lora["update_s"],
    }
    mib = 2**20
    for name, m in (("full", full), (f"lora r={args.rank}", lora)):
        print(f"{name:>10}: {m['params_trainable']:>11,} of {m['params_total']:,} params trainable; "
              f"Adam state {m['adam_state_bytes'] / mib:8.2f} MiB, grads {m['grad_bytes'] / mib:8.2f} MiB, "
              f"params {m['param_bytes'] / mib:8.2f} MiB; update {m['update_s']:.3f} s")
    print(f"Adam state: full / LoRA = {result['full_over_lora_adam']:.1f}x; "
          f"update time full / LoRA = {result['full_over_lora_update_s']:.2f}x")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
