"""Padded vs packed forward + backward of a causal LM, per attention kernel: the measurement behind
``model.use_remove_padding`` and the packed attention kernel (rlcore.workers.packing).

    python -m benchmarks.packing [--layers 30] [--rows 16] [--repeats 3] [--dtype bfloat16]

A SmolLM2-135M-shaped Llama (hidden 576, 9 heads, 3 KV heads; random weights, ``--layers`` of them)
runs one forward and backward on ``--rows`` rows with GRPO-like skewed lengths (prompts 20-60
tokens left-padded, responses 8-256 right-padded; fixed seed) in each way:

- padded ``eager`` and ``sdpa``: the (B, T) batch with its attention mask (what the workers did);
- packed ``rlcore_packed``: the valid tokens as one (1, N) sequence, causal SDPA per row;
- packed ``flex_attention``: transformers' block mask over the pack (compiled by torch on first use;
  reported only when it runs here).

Reports the median seconds of ``--repeats`` runs after a warm-up, the padding share, and the largest
difference of the packed outputs from the padded eager ones at the valid positions. Timing is
reported, never asserted (the test suite runs ``--quick`` for a smoke check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.workers.packing import PACKED_ATTENTION, pack


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


def run(model, kwargs, valid_index=None):
    """One forward + backward; returns (seconds, hidden states at the valid positions, flat)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    hidden = model.model(**kwargs, use_cache=False).last_hidden_state
    hidden.float().square().mean().backward()
    seconds = time.perf_counter() - start
    flat = hidden.detach().flatten(0, 1)
    return seconds, (flat if valid_index is None else flat[valid_index]).float()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--flex", action="store_true", help="also try flex_attention (compiles; minutes on 2 cores)")
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch: the suite's smoke run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows, layers = (4, 2) if args.quick else (args.rows, args.layers)
    ids, mask, pos = make_batch(rows, seed=0, max_prompt=12 if args.quick else 60,
                                max_response=16 if args.quick else 256, vocab=256 if args.quick else 49152)
    packed = pack(ids, mask, pos)
    valid = packed.index
    report = {"rows": rows, "padded_tokens": mask.numel(), "valid_tokens": packed.num_tokens,
              "padding_share": 1 - packed.num_tokens / mask.numel(), "dtype": args.dtype, "layers": layers, "seconds": {}}
    ways = [("padded_eager", "eager", False), ("padded_sdpa", "sdpa", False), ("packed_sdpa_per_row", PACKED_ATTENTION, True)]
    if args.flex:
        ways.append(("packed_flex_attention", "flex_attention", True))
    reference = None
    for name, attn, packs in ways:
        model = build(layers, attn, dtype, args.quick)
        kwargs = ({k: v for k, v in packed.model_kwargs().items() if attn == PACKED_ATTENTION or k.startswith(("input", "pos"))}
                  if packs else {"input_ids": ids, "attention_mask": mask, "position_ids": pos})
        try:
            times = []
            for _ in range(1 + args.repeats):  # the first: warm-up (and compilation)
                seconds, out = run(model, kwargs, None if packs else valid)
                times.append(seconds)
        except Exception as exc:  # report what did not run here (flex_attention needs a compiler)
            report["seconds"][name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        report["seconds"][name] = statistics.median(times[1:])
        print(f"{name}: {report['seconds'][name]:.3f} s (runs {[round(t, 3) for t in times]})", flush=True)
        if reference is None:
            reference = out
        else:
            report.setdefault("max_abs_diff_vs_padded_eager", {})[name] = float((out - reference).abs().max())
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
