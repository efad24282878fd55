"""The one-GPU throughput benchmark of the device check: GRPO steps at Qwen2.5-0.5B and -1.5B shapes.

    bash scripts/device_check.sh --only throughput --budget-s 540      # on the device machine
    bash scripts/device_check.sh --cpu --only throughput --out /tmp/t    # here: the dry run, tiny shapes

Each part builds a Qwen2 model from its published shape (config only, random weights: nothing is
downloaded) with rlcore's character tokenizer (the model's vocabulary stays 151,936; ids past the
tokenizer's decode to nothing, and transformers loads a qwen2 directory's tokenizer without the
spaces: irrelevant to speed), and runs ``recipes.grpo`` on it in this process (``trainer.backend=local``:
the in-process worker group, the HF engine; the device image has no Ray, no vLLM): bf16 mixed
precision, packed micro-batches (``model.use_remove_padding``) of at most ``token_budget`` tokens
(``actor.use_dynamic_bsz``), fixed-length responses (``rollout.ignore_eos``), the KL loss's reference
forward, one optimizer step per batch (so no old-log-prob pass), every row trained.

Reported, as the mean over the steps after the first (warm-up): seconds per step and per stage
(``gen``, ``reward``, ``ref``, ``adv``, ``update_actor``, ``sync_weights``: the weight sync to the
engine; the in-process reference forward falls outside them, in ``untimed_s``), generated tokens/s, trained tokens/s (prompt + response tokens of the update), MFU of the
update and of the step, peak GPU memory. MFU counts model FLOPs on the tokens actually computed
(``pass_flops``: a prompt that a pack holds once for its group, ``actor/shared_prompt_frac``, counts
once): 6 per matmul parameter per computed token (2 forward, 4 backward) plus causal attention (6 x 2
x layers x q-width x the keys each query attends), a third of that for the reference forward, and
``flops_per_token`` for each generated token; divided by the GPU's dense bf16 peak from its name
(``PEAK_BF16``), and by the bf16 matmul rate measured in the part (how fast this card really
multiplies). ``mfu_update_counting_every_rows_prompt`` is the old count, each row's prompt included.

Also reported: the attention kernels that actually ran (``attention_kernel_calls``: calls per kernel,
``rlcore.workers.shared_varlen.KERNEL_CALLS``; ``varlen_shared`` is the one varlen call per layer
over a shared-prompt pack, ``rows_split`` its two flash calls on CPU, ``rows_sdpa`` the fallback),
what the dispatch picks here and why, and
``shared_varlen_probe`` (scripts/device_varlen.py): the varlen call against the rows path and an
fp32 reference on this device, outputs and gradients, at the shape's heads.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

import recipes.grpo
from rlcore.models.tiny import build_char_tokenizer
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.workers import packing, shared_varlen
from scripts.device_varlen import probe_shared_varlen

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
# Qwen2.5's published configs (hidden, MLP width, layers, heads, KV heads; vocabulary 151,936, tied
# embeddings, RoPE theta 1e6); "tiny": the CPU dry run's stand-in.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=1024),
}
# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets, matched against the device name.
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}
# What a step runs, per mode: prompts x n responses of max_new_tokens each, packed micro-batches of
# at most token_budget tokens (the 1.5B model's activations at 8k tokens: ~25 GB in bf16).
RUNS = {
    "cuda": {"prompts": 32, "n": 8, "max_new_tokens": 256, "max_prompt_length": 256, "steps": 3,
             "token_budget": {"qwen2.5-0.5b": 16384, "qwen2.5-1.5b": 8192}},
    "cpu": {"prompts": 2, "n": 2, "max_new_tokens": 8, "max_prompt_length": 256, "steps": 2,
            "token_budget": {"qwen2.5-0.5b": 2048, "qwen2.5-1.5b": 2048}},
}


def build_model(path: Path, shape: str, device: str) -> tuple[str, dict]:
    """A Qwen2 model directory of ``shape`` with random weights (seed 0), and its parameter counts."""
    tokenizer = build_char_tokenizer()
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=4096, use_sliding_window=False, **special)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.5B parameters on the GPU takes a second, on the CPU minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**special)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    counts = {"parameters": total, "matmul_parameters": total if config.tie_word_embeddings else total - embedding,
              "layers": config.num_hidden_layers, "q_width": config.num_attention_heads * (config.hidden_size //
                                                                                           config.num_attention_heads)}
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return str(path), counts


def flops_per_token(counts: dict, mean_context: float, training: bool) -> float:
    """Model FLOPs of one token: matmuls (2 per parameter forward, 6 with backward) plus causal attention
    over ``mean_context`` keys (QK^T and AV: 4 x layers x q-width per key forward, x3 with backward)."""
    forward = 2 * counts["matmul_parameters"] + 4 * counts["layers"] * counts["q_width"] * mean_context
    return 3 * forward if training else forward


def pass_flops(counts: dict, rows: int, prompt_len: float, response_len: float, shared_frac: float,
               training: bool) -> tuple[float, float]:
    """(tokens computed, model FLOPs) of one pass over ``rows`` rows of mean prompt and response lengths,
    where ``shared_frac`` of the rows' tokens are prompt tokens a pack holds once and never computes
    again (``actor/shared_prompt_frac``): matmuls on the computed tokens only; attention at each
    query's own context: a computed prompt token over the prompt up to itself, a response token over
    its prompt and its response up to itself (what the varlen call computes; rows of SDPA compute more,
    which MFU does not count). With ``shared_frac`` 0 this is ``flops_per_token`` at the mean context."""
    tokens = rows * (prompt_len + response_len)
    computed = tokens * (1 - shared_frac)
    prompt_computed = rows * prompt_len - tokens * shared_frac
    keys = prompt_computed * (prompt_len + 1) / 2 + rows * response_len * (prompt_len + (response_len + 1) / 2)
    forward = 2 * counts["matmul_parameters"] * computed + 4 * counts["layers"] * counts["q_width"] * keys
    return computed, 3 * forward if training else forward


def matmul_rate(device: str) -> float:
    """Measured bf16 matmul FLOP/s on ``device`` (8192^2 on CUDA; small on CPU, for the dry run only)."""
    n = 8192 if device == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        a @ a
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    if device == "cuda":
        torch.cuda.synchronize()
    return 5 * 2 * n**3 / (time.perf_counter() - start)


def peak_bf16(device: str) -> tuple[str, float | None]:
    if device != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(0)
    return name, next((v for k, v in PEAK_BF16.items() if k in name), None)


def part_throughput(ctx: dict, shape: str) -> dict:
    """GRPO steps at ``shape`` (the CPU dry run: the "tiny" shape) on ``ctx["device"]``."""
    device = ctx["device"]
    run = RUNS[device]
    actual = shape if device == "cuda" else "tiny"
    work = Path(ctx["work"]) / "throughput" / shape
    start = time.perf_counter()
    path, counts = build_model(work / "model", actual, device)
    build_s = time.perf_counter() - start
    overrides = [
        f"model.path={path}", "model.mixed_precision=bfloat16", "model.use_remove_padding=true",
        "data.task=arithmetic_words", f"data.max_prompt_length={run['max_prompt_length']}",
        f"data.train_batch_size={run['prompts']}",
        "rollout.backend=hf", "rollout.dtype=bfloat16", f"rollout.n={run['n']}",
        f"rollout.max_new_tokens={run['max_new_tokens']}", "rollout.ignore_eos=true",
        "actor.use_kl_loss=true", "actor.use_dynamic_bsz=true", "actor.lr=1e-6",
        f"actor.ppo_max_token_len_per_gpu={run['token_budget'][shape]}", "actor.ppo_mini_batch_size=null",
        "trainer.backend=local", f"trainer.device={device}", f"trainer.output_dir={work / 'runs'}",
        "trainer.run_name=grpo", "trainer.loggers=[jsonl]", f"trainer.total_steps={run['steps']}",
        "trainer.val_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.export_hf=false",
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=overrides)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    calls_before = Counter(shared_varlen.KERNEL_CALLS)
    start = time.perf_counter()
    out_run = recipes.grpo.train(cfg)
    wall = time.perf_counter() - start
    kernel_calls = dict(shared_varlen.KERNEL_CALLS - calls_before)
    rows = read_jsonl_metrics(out_run.dir / "metrics.jsonl")
    steady = rows[1:] if len(rows) > 1 else rows

    def mean(key: str) -> float:
        values = [r[key] for r in steady if key in r]
        return sum(values) / len(values) if values else float("nan")

    stages = {k.split("/", 1)[1]: round(mean(k), 4) for k in sorted({k for r in steady for k in r})
              if k.startswith("timing_s/")}
    rows_per_step = run["prompts"] * run["n"]
    prompt_len, response_len = mean("prompt_length/mean"), mean("response_length/mean")
    generated = rows_per_step * response_len
    trained = rows_per_step * (prompt_len + response_len)
    context = (prompt_len + response_len + 1) / 2  # the mean number of keys a token of a row attends
    head_dim = SHAPES[actual]["hidden_size"] // SHAPES[actual]["num_attention_heads"]
    probe = probe_shared_varlen(device, SHAPES[actual]["num_attention_heads"], SHAPES[actual]["num_key_value_heads"],
                                head_dim, torch.bfloat16 if device == "cuda" else torch.float32)
    shared_frac = mean("actor/shared_prompt_frac")
    shared_frac = 0.0 if shared_frac != shared_frac else shared_frac  # nan: no pack shared a prompt
    # the update and the reference's forward (the same packing) on the tokens actually computed
    computed, train_flops = pass_flops(counts, rows_per_step, prompt_len, response_len, shared_frac, training=True)
    _, forward_flops = pass_flops(counts, rows_per_step, prompt_len, response_len, shared_frac, training=False)
    every_row_flops = trained * flops_per_token(counts, context, training=True)  # each row's prompt counted
    gen_flops = generated * flops_per_token(counts, prompt_len + response_len / 2, training=False)
    gpu, peak = peak_bf16(device)
    measured = matmul_rate(device)
    step_flops = train_flops + forward_flops + gen_flops

    def mfu(flops: float, seconds: float, rate: float | None) -> float | None:
        return round(flops / seconds / rate, 4) if rate and seconds > 0 else None

    out = {
        "shape": actual if actual == shape else f"{actual} (CPU dry run of {shape})", "gpu": gpu, **counts,
        "prompts_x_n": f"{run['prompts']} x {run['n']}", "steps": len(rows), "build_model_s": round(build_s, 1),
        "wall_s": round(wall, 1), "first_step_s": round(rows[0]["timing_s/step"], 3),
        "step_s": stages.get("step"), "stage_s": stages,
        # in-process, the non-blocking reference forward runs when it is started, between the recipe's
        # gen and reward timers: most of this is the reference's pass
        "untimed_s": round(stages["step"] - sum(v for k, v in stages.items() if k != "step"), 4),
        "prompt_tokens_mean": round(prompt_len, 1), "response_tokens_mean": round(response_len, 1),
        "token_budget": run["token_budget"][shape],
        "generated_tokens_per_s": round(generated / stages["gen"], 1),
        "trained_tokens_per_s": round(trained / stages["update_actor"], 1),
        "shared_prompt_frac": round(shared_frac, 4),
        "computed_tokens_per_s": round(computed / stages["update_actor"], 1),
        "weight_sync_s": stages.get("sync_weights"),
        # what ran: attention calls per kernel during the run (rlcore.workers.shared_varlen.KERNEL_CALLS),
        # and what the dispatch picks for a bf16 shared-prompt pack here, with its reason
        "attention_kernel_calls": kernel_calls,
        "attention_kernel_planned": dict(zip(("kernel", "why"), shared_varlen.planned_kernel(
            torch.bfloat16, packing.VARLEN_REFUSED))),
        "varlen_refused": list(packing.VARLEN_REFUSED),
        "shared_varlen_probe": probe,
        "peak_bf16_flops": peak, "measured_bf16_matmul_flops": round(measured),
        "mfu_update": mfu(train_flops, stages["update_actor"], peak),
        "mfu_step": mfu(step_flops, stages["step"], peak),
        "mfu_update_vs_measured_matmul": mfu(train_flops, stages["update_actor"], measured),
        # the same seconds over FLOPs that count each row's prompt (as if no prompt were shared): not work done
        "mfu_update_counting_every_rows_prompt": mfu(every_row_flops, stages["update_actor"], peak),
    }
    if device == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    out["ok"] = len(rows) == run["steps"] and all(v == v for v in stages.values()) and probe["ok"]
    out["summary"] = (f"{out['shape']}: {out['step_s']} s/step, gen {out['generated_tokens_per_s']:.0f} tok/s, "
                      f"train {out['trained_tokens_per_s']:.0f} tok/s, sync {out['weight_sync_s']} s"
                      + (f", MFU update {out['mfu_update']}, peak {out['peak_allocated_gib']} GiB"
                         if device == "cuda" else "") + f", attention {kernel_calls}")
    return out
