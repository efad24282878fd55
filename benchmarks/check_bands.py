"""The trainer-vs-sampler difference a clean run shows, per dtype pair (docs/correctness.md, "Bands").

    python -m benchmarks.check_bands --recipe grpo --steps 4 --json out.json [override ...]

Runs a recipe in this process (``trainer.backend=local``) with the overrides given (the dtype pair:
``model.mixed_precision=null|bfloat16 rollout.dtype=float32|bfloat16``; the engine:
``rollout.backend=hf|vllm``; the model: ``+preset=smollm2``) and prints, per step, the ``check/*``
measures of the current-version tokens: mean |d|, signed mean of d, the share of tokens outside the
ratio band, max |d|, and the band the check used. Nothing is asserted: these numbers are what the
default bands of ``rlcore.trainer.check_bands`` were set from.

    python -m benchmarks.check_bands --hybrid smollm2 --trainer bfloat16 --engine float32 [--backend hf]

measures without a recipe (cheaper for a real model on a busy machine): the actor and the engine in
this process, a few prompts sampled, one update at lr 1e-5 per step (the first forward of the update
is what the check compares with the sampler's log-probs, as in a run), the engine synced after it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from rlcore.trainer.tracking import read_jsonl_metrics

MEASURES = ("check/logprob_abs_diff_mean", "check/logprob_diff_mean", "check/ratio_out_of_band",
            "check/logprob_abs_diff_max", "check/tokens", "check/band_abs_diff_mean", "check/band_out_of_band")


def run(recipe: str, overrides: list[str], steps: int) -> list[dict[str, float]]:
    module = importlib.import_module(f"recipes.{recipe}")
    with tempfile.TemporaryDirectory() as out:
        base = [f"trainer.output_dir={out}", "trainer.backend=local", "trainer.loggers=[jsonl]",
                f"trainer.total_steps={steps}", "trainer.val_freq=0", "trainer.save_freq=0", "trainer.export_hf=false"]
        with initialize_config_dir(config_dir=str(Path(module.__file__).parent / "config"), version_base=None):
            cfg = compose(recipe, overrides=base + overrides)
        rows = read_jsonl_metrics(module.train(cfg).dir / "metrics.jsonl")
    lag = lambda r, k: r.get(f"{k}/lag_0", r.get(k))  # noqa: E731 (current-version tokens where tokens carry versions)
    return [{"step": r["step"], **{k.removeprefix("check/"): lag(r, k) for k in MEASURES if lag(r, k) is not None}}
            for r in rows]


PROMPTS = ["What is seven plus five? Answer with a number.", "Tom has three apples and buys four more. How many?",
           "What is twelve minus nine?", "Write the number eighteen in digits.", "What is six times two?",
           "Anna read 14 pages and then 9 more. How many pages?", "What is twenty divided by four?",
           "Count: one, two, three, ..."]


def hybrid(model: str, backend: str, trainer: str | None, engine: str, steps: int, n: int = 4,
           max_new_tokens: int = 24) -> list[dict[str, float]]:
    import torch
    from transformers import AutoTokenizer

    from rlcore.models.gguf import resolve_model_path
    from rlcore.protocol import DataProto
    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
    from rlcore.workers.actor import ActorWorker
    from rlcore.workers.rollout import RolloutWorker

    path = resolve_model_path(model)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(map(len, ids))
    input_ids = torch.full((len(ids), width), tok.pad_token_id or 0)
    mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(ids):
        input_ids[row, width - len(seq):], mask[row, width - len(seq):] = torch.tensor(seq), 1
    actor = ClassWithInitArgs(ActorWorker, {"model": {"path": path, "mixed_precision": trainer},
                                            "actor": {"lr": 1e-5, "ppo_micro_batch_size_per_gpu": 8}})
    rollout = ClassWithInitArgs(RolloutWorker, {"model": {"path": path}, "rollout": {
        "backend": backend, "dtype": engine, "max_new_tokens": max_new_tokens, "temperature": 0.7,
        **({"max_model_len": 512, "kv_cache_memory_bytes": 1 << 30} if backend == "vllm" else {})}})
    wg = LocalWorkerGroup(create_colocated_worker_cls({"actor": actor, "rollout": rollout}))
    wg.actor_init_model()
    wg.rollout_init_model()
    rows = []
    for step in range(1, steps + 1):
        prompts = DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask,
                                       "position_ids": (mask.cumsum(1) - 1).clamp(min=0)},
                                      meta_info={"n": n, "seed": step, "temperature": 0.7})
        batch = wg.rollout_generate_sequences(prompts)
        sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
        batch.batch["advantages"] = sign * batch.batch["response_mask"]
        m = wg.actor_update_policy(batch)
        m = m[0] if isinstance(m, list) else m
        wg.rollout_sync_weights()
        rows.append({"step": step, **{k.removeprefix("check/"): m[k] for k in MEASURES if k in m}})
        print(json.dumps(rows[-1]), flush=True)  # as it goes: a real model's step is minutes on a busy machine
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="grpo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", help="append {overrides, steps} as one line here")
    parser.add_argument("--hybrid", help="a model path (or smollm2): measure without a recipe (see above)")
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--trainer", default=None, help="model.mixed_precision (none: fp32)")
    parser.add_argument("--engine", default="float32", help="rollout.dtype")
    parser.add_argument("--n", type=int, default=4, help="--hybrid: samples per prompt (8 prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of recipes/config/<recipe>.yaml")
    args = parser.parse_args()
    if args.hybrid:
        trainer = None if args.trainer in (None, "null", "float32") else args.trainer
        rows = hybrid(args.hybrid, args.backend, trainer, args.engine, args.steps, args.n, args.max_new_tokens)
        args.overrides = [f"hybrid={args.hybrid}", f"backend={args.backend}", f"trainer={trainer}", f"engine={args.engine}"]
    else:
        rows = run(args.recipe, args.overrides, args.steps)
    for row in rows if not args.hybrid else []:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"recipe": args.recipe, "overrides": args.overrides, "steps": rows}) + "\n")


if __name__ == "__main__":
    main()
