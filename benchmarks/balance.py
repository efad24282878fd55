"""One update_policy on 2 DP ranks with skewed response lengths: balanced split vs the plain one.

    python -m benchmarks.balance [--preset small] [--rows 64] [--repeats 3] [--json out.json]

Two FSDP2 actor ranks (Ray actors, gloo, one CPU each) update on a batch whose first half has long
responses and second half short ones, in that order (lengths follow the prompts, and a batch
arrives in prompt order): the plain contiguous split gives rank 0 every long row. With
``use_dynamic_bsz`` (micro-batches packed to a token budget, the same count on every rank) each
rank's work follows its tokens; the step waits for the heaviest rank. Each variant is timed from
the same starting weights (a checkpoint reloaded before each call), median of ``--repeats``.
Prints the per-rank tokens of both splits, both times and plain / balanced (above 1: balancing
pays). Timing is reported, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ray
import torch

from rlcore.models import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rlcore.workers import ActorWorker
from rlcore.trainer.builder import worker_priority  # the workers at the driver's priority, as a run's
from benchmarks.results import write_json


def skewed_batch(rows: int, prompt_len: int, long_len: int, short_len: int, vocab: int) -> DataProto:
    """Full prompts; rows of the first half answer with ``long_len`` tokens, the rest ``short_len``."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([long_len] * (rows // 2) + [short_len] * (rows - rows // 2))
    response_mask = (torch.arange(long_len) < lengths[:, None])
    prompts = torch.randint(4, vocab, (rows, prompt_len), generator=g)
    responses = torch.randint(4, vocab, (rows, long_len), generator=g) * response_mask
    attention_mask = torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), response_mask.long()], 1)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask.float(), "advantages": torch.randn(rows, long_len, generator=g) * response_mask,
    })


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=("tiny", "small"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--long-len", type=int, default=192)
    p.add_argument("--short-len", type=int, default=8)
    p.add_argument("--max-token-len", type=int, default=2048, help="token budget of a dynamic micro-batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the tiny model, 16 rows, 1 repeat")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.preset, args.rows, args.long_len, args.max_token_len, args.repeats = "tiny", 16, 48, 256, 1
    model_dir = build_tiny_model(tempfile.mkdtemp(), preset=args.preset)
    ckpt = tempfile.mkdtemp()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
             _system_config=worker_priority())
    cfg = {"model": {"path": model_dir}, "trainer": {"device": "cpu"},
           "actor": {"optimizer": "sgd", "lr": 1e-3, "use_dynamic_bsz": True,
                     "ppo_max_token_len_per_gpu": args.max_token_len}}
    pool = RayResourcePool([2], num_cpus_per_process=1, name_prefix="bench_balance")
    actor = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, cfg), default_timeout=1800)
    actor.init_model()
    actor.save_checkpoint(ckpt)
    data = skewed_batch(args.rows, args.prompt_len, args.long_len, args.short_len, vocab=66)

    def timed(balance: bool) -> tuple[float, dict]:
        times = []
        update = actor.update_policy.options(balance=balance)
        for _ in range(args.repeats + 1):  # the first call warms up
            actor.load_checkpoint(ckpt)
            start = time.perf_counter()
            update(data)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]), dict(actor.last_balance)

    plain_s, tokens = timed(False)
    balanced_s, balanced_tokens = timed(True)
    res = {"preset": args.preset, "rows": args.rows, "response_lens": [args.long_len, args.short_len],
           "max_token_len": args.max_token_len, "repeats": args.repeats,
           "tokens_per_rank_plain": [tokens["tokens_max_before"], tokens["tokens_min_before"]],
           "tokens_per_rank_balanced": [balanced_tokens["tokens_max_after"], balanced_tokens["tokens_min_after"]],
           "plain_s": plain_s, "balanced_s": balanced_s, "plain_over_balanced": plain_s / balanced_s}
    print(f"{args.preset} model, 2 ranks, {args.rows} rows: responses of {args.long_len} | {args.short_len} tokens, "
          f"dynamic micro-batches of <= {args.max_token_len} tokens, median of {args.repeats}")
    print(f"  plain split    tokens per rank (max, min) {res['tokens_per_rank_plain']}  update {plain_s:7.3f} s")
    print(f"  balanced split tokens per rank (max, min) {res['tokens_per_rank_balanced']}  update {balanced_s:7.3f} s")
    print(f"  plain / balanced: {res['plain_over_balanced']:.2f}x")
    write_json(args.json, res)
    actor.shutdown()
    pool.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
