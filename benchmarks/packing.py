"""Padded vs packed forward + backward of a causal LM, per attention kernel: the measurement behind
``model.use_remove_padding`` and the packed attention kernel (rlcore.workers.packing).

    python -m benchmarks.packing [--layers 30] [--rows 16] [--max-response 256] [--repeats 3] [--dtype bfloat16]
                                [--threads N]

A SmolLM2-135M-shaped Llama (hidden 576, 9 heads, 3 KV heads; random weights, ``--layers`` of them)
runs one forward and backward on ``--rows`` rows with GRPO-like skewed lengths (prompts 20-60
tokens left-padded, responses 8 to ``--max-response`` right-padded; fixed seed) in each way:

- padded ``eager`` and ``sdpa``: the (B, T) batch with its attention mask (the unpacked path);
- packed ``rlcore_packed``: the valid tokens as one (1, N) sequence, the pack's rows side by side in
  one causal SDPA call (``rlcore.workers.packing``); ``rlcore_packed_eager``: the same layout through
  eager math (what ``model.attn_implementation=eager`` loads when packing);
- packed, one causal SDPA call per row (the alternative it was measured against);
- packed ``flex_attention`` (``--flex``): transformers' block mask over the pack (on CPU, torch 2.13
  refuses its backward: recorded as failed).

The ways run interleaved, ``--repeats`` times after a warm-up; reported are the medians of the wall
seconds and of this process's CPU seconds (steadier than wall time on a shared machine), the padding
share, and the largest difference of each way's hidden states from padded eager at the valid
positions. Timing is reported, never asserted (the test suite runs ``--quick`` for a smoke check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

from rlcore.workers.packing import PACKED_ATTENTION, PACKED_EAGER, pack
from benchmarks.results import write_json

PER_ROW = "bench_sdpa_per_row"


def make_batch(rows: int, seed: int, max_prompt: int = 60, max_response: int = 256, vocab: int = 49152):
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(max_prompt // 3, max_prompt + 1, (rows,), generator=g)
    r = torch.randint(max_response // 32, max_response + 1, (rows,), generator=g)
    t_p, t_r = int(p.max()), int(r.max())
    cols = torch.arange(t_p + t_r)
    mask = ((cols >= t_p - p[:, None]) & (cols < t_p + r[:, None])).long()
    ids = torch.randint(0, vocab, mask.shape, generator=g) * mask
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def build(layers: int, attn: str, dtype: torch.dtype, tiny: bool) -> LlamaForCausalLM:
    shape = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
             if tiny else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                               vocab_size=49152))
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=2048, tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)


def per_row_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The alternative measured against ``rlcore_packed``: one causal SDPA call per row of the pack."""
    bounds = kwargs["cu_seq_lens_q"].tolist()
    out = torch.cat([F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                                    scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
                     for s, e in zip(bounds[:-1], bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PER_ROW, per_row_attention)


def run(model, kwargs, valid_index=None):
    """One forward + backward; returns (wall seconds, this process's CPU seconds, hidden states at the
    valid positions, flat). CPU seconds: the work done, less disturbed than wall time when other
    processes share the cores."""
    model.zero_grad(set_to_none=True)
    start, cpu = time.perf_counter(), time.process_time()
    hidden = model.model(**kwargs, use_cache=False).last_hidden_state
    hidden.float().square().mean().backward()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    flat = hidden.detach().flatten(0, 1)
    return seconds, cpu, (flat if valid_index is None else flat[valid_index]).float()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--flex", action="store_true", help="also try flex_attention (compiles; minutes on 2 cores)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch: the suite's smoke run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: steadier CPU seconds on a shared machine)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows, layers = (4, 2) if args.quick else (args.rows, args.layers)
    ids, mask, pos = make_batch(rows, seed=0, max_prompt=12 if args.quick else 60,
                                max_response=16 if args.quick else args.max_response, vocab=256 if args.quick else 49152)
    packed = pack(ids, mask, pos)
    valid = packed.index
    report = {"rows": rows, "padded_tokens": mask.numel(), "valid_tokens": packed.num_tokens,
              "padding_share": 1 - packed.num_tokens / mask.numel(), "dtype": args.dtype, "layers": layers,
              "threads": torch.get_num_threads(), "seconds": {}, "cpu_seconds": {}}
    ways = [("padded_eager", "eager", False), ("padded_sdpa", "sdpa", False),
            ("packed_rlcore", PACKED_ATTENTION, True), ("packed_rlcore_eager", PACKED_EAGER, True),
            ("packed_sdpa_per_row", PER_ROW, True)]
    if args.flex:
        ways.append(("packed_flex_attention", "flex_attention", True))
    models = {name: build(layers, attn, dtype, args.quick) for name, attn, _ in ways}
    inputs = {name: packed.model_kwargs() if attn in (PACKED_ATTENTION, PACKED_EAGER, PER_ROW)
              else {"input_ids": packed.input_ids, "position_ids": packed.position_ids} if packs
              else {"input_ids": ids, "attention_mask": mask, "position_ids": pos} for name, attn, packs in ways}
    times: dict[str, list] = {name: [] for name, _, _ in ways}
    outputs = {}
    for repeat in range(1 + args.repeats):  # interleaved, so that a busy spell of the machine hits every way
        for name, _, packs in ways:
            if isinstance(report["seconds"].get(name), str):
                continue
            try:
                seconds, cpu, outputs[name] = run(models[name], inputs[name], None if packs else valid)
            except Exception as exc:  # report what does not run here (flex_attention: no backward on CPU)
                report["seconds"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            if repeat:  # the first: warm-up
                times[name].append((seconds, cpu))
    for name, runs in times.items():
        if runs:
            report["seconds"][name] = statistics.median(t[0] for t in runs)
            report["cpu_seconds"][name] = statistics.median(t[1] for t in runs)
            diff = float((outputs[name] - outputs["padded_eager"]).abs().max())
            report.setdefault("max_abs_diff_vs_padded_eager", {})[name] = diff
    print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
