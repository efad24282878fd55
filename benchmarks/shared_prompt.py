"""Sampling that shares each group's prompt: generate's tokens/s off and on.

    python -m benchmarks.shared_prompt --backend vllm --model smollm2 --repeats 5
    python -m benchmarks.shared_prompt --backend hf --model smollm2 --repeats 3
    python -m benchmarks.shared_prompt --quick            # tiny model, both engines, seconds

The SmolLM2 preset's rollout: 16 ``arithmetic_words`` prompts in SmolLM2's chat template (~47 tokens)
x n=8 samples, 32 new tokens, temperature 0.7, every row sampled to its full length (``ignore_eos``),
so both sides generate exactly the same number of tokens. Two engines of one backend live in this
process, one without sharing and one with: HF ``rollout.share_prompt`` false / true (every row
prefills its own copy of the prompt / each distinct prompt once), vLLM ``rollout.block_size`` 128
(vLLM's CPU default) / ``--block-size`` (32, rlcore's CPU default: its prefix cache then serves a group's other
rows their prompt's full 32-token blocks); timed calls alternate between them (off, on, on, off, ...), so the machine's load swings fall
on both alike, and the ratio of their medians is the number to read. Each call's CPU time (the
process's, every thread: both engines compute in this process) is printed too: on a machine shared
with other work it moves far less than wall time. Before each timed call a vLLM
engine's prefix cache is emptied: a training step's weight sync empties it too.

Also printed: greedy equality of the two engines (token for token), and the prompt columns each one
computed for the call: HF counted at the model's embedding (padding columns included), vLLM as the
prompt tokens less those its prefix cache served (``RequestOutput.num_cached_tokens``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlcore.engines.shared_prompt import SHARED_BLOCK_SIZE  # noqa: E402

VLLM_CPU_BLOCK_SIZE = 128  # vLLM's own CPU default: the side that shares no prompt block


def prompt_batch(tok, count: int, chat: bool, n: int):
    """(input_ids, attention_mask, position_ids) of ``count`` prompts, each row ``n`` times (adjacent), left-padded."""
    import torch

    if chat:
        from rlcore.data.word_problems import make_word_problems

        rows = make_word_problems("arithmetic_words", count, seed=0)
        ids = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in rows]
    else:
        from rlcore.data.arithmetic import make_arithmetic_examples

        ids = [tok(r["prompt"])["input_ids"] for r in make_arithmetic_examples(count, seed=0)]
    width = max(len(i) for i in ids)
    input_ids = torch.full((count * n, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(s for s in ids for _ in range(n)):
        input_ids[row, width - len(seq):] = torch.tensor(seq)
        mask[row, width - len(seq):] = 1
    return input_ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


class PrefillCounter:
    """Prompt columns an engine computed in its last ``generate`` call."""

    def __init__(self, engine, rows: int, new_tokens: int) -> None:
        self.engine, self.decode = engine, rows * (new_tokens - 1)
        self.fed, self.outputs = 0, None
        if hasattr(engine, "llm"):  # vLLM: keep the call's RequestOutputs
            generate = engine.llm.generate

            def keep(*args, **kwargs):
                self.outputs = generate(*args, **kwargs)
                return self.outputs

            engine.llm.generate = keep
        else:  # HF: count the tokens through the embedding
            def count(module, args, out):
                self.fed += args[0].numel()

            engine.model.get_input_embeddings().register_forward_hook(count)

    def start(self) -> None:
        self.fed, self.outputs = 0, None

    def prompt_columns(self) -> int:
        if self.outputs is None:
            return self.fed - self.decode  # every column but the decoding steps' (each fed one per row)
        return sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in self.outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["hf", "vllm"], default="vllm")
    parser.add_argument("--model", default="smollm2", help="smollm2 (the preset's model) or a HF model directory")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per side")
    parser.add_argument("--dtype", default=None, help="rollout.dtype (null: each engine's default)")
    parser.add_argument("--block-size", type=int, default=SHARED_BLOCK_SIZE, help="vLLM: rollout.block_size when shared")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 4 prompts x 4 samples x 8 tokens, both backends")
    args = parser.parse_args()
    if args.quick:
        with tempfile.TemporaryDirectory() as tmp:
            from rlcore.models.tiny import build_tiny_model

            args.model = build_tiny_model(tmp, seed=0)
            args.prompts, args.n, args.new_tokens, args.repeats = 4, 4, 8, 2
            for backend in ("hf", "vllm"):
                args.backend = backend
                run(args)
        return
    run(args)


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rlcore.engines import RolloutConfig, SamplingSettings, build_engine
    from rlcore.models.config import ModelConfig
    from rlcore.models.gguf import resolve_model_path

    path = resolve_model_path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    chat = tok.chat_template is not None
    input_ids, mask, positions = prompt_batch(tok, args.prompts, chat, args.n)
    rows = len(input_ids)
    engines, counters = {}, {}
    for share in (False, True):
        vllm = args.backend == "vllm"
        cfg = RolloutConfig(backend=args.backend, n=args.n, temperature=args.temperature, max_new_tokens=args.new_tokens,
                            dtype=args.dtype, share_prompt=share, max_model_len=input_ids.shape[1] + args.new_tokens,
                            kv_cache_memory_bytes=1 << 30 if vllm else None,
                            block_size=(args.block_size if share else VLLM_CPU_BLOCK_SIZE) if vllm else None)
        engines[share] = build_engine(ModelConfig(path=path), cfg)
        counters[share] = PrefillCounter(engines[share], rows, args.new_tokens)
    sample = SamplingSettings(temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens, n=1,
                              do_sample=True, ignore_eos=True)
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=args.new_tokens, n=1, do_sample=False)

    def call(share: bool, settings):
        engine = engines[share]
        if hasattr(engine, "llm"):
            engine.llm.reset_prefix_cache()  # as after a training step's weight sync
        counters[share].start()
        start, cpu = time.perf_counter(), time.process_time()
        out = engine.generate(input_ids, mask, positions, settings)
        return out, time.perf_counter() - start, time.process_time() - cpu

    greedy_out = {share: call(share, greedy)[0] for share in (False, True)}  # also the warm-up
    equal = torch.equal(greedy_out[False].responses, greedy_out[True].responses) and torch.equal(
        greedy_out[False].lengths, greedy_out[True].lengths)
    columns = {}
    times: dict[bool, list[float]] = {False: [], True: []}
    cpu_times: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.repeats):
        for share in ((False, True) if rep % 2 == 0 else (True, False)):
            _, seconds, cpu = call(share, sample)
            times[share].append(seconds)
            cpu_times[share].append(cpu)
            columns[share] = counters[share].prompt_columns()
            print(f"  {args.backend} shared={str(share).lower():<5} {seconds:7.2f} s  "
                  f"{rows * args.new_tokens / seconds:7.0f} tokens/s  {cpu:7.2f} CPU s  load {os.getloadavg()[0]:.1f}",
                  flush=True)
    load = os.getloadavg()[0]
    median = {share: statistics.median(t) for share, t in times.items()}
    cpu_median = {share: statistics.median(t) for share, t in cpu_times.items()}
    print(f"\n{args.backend}, {os.path.basename(path)}: {args.prompts} prompts x n={args.n}, {input_ids.shape[1]} "
          f"prompt columns, {args.new_tokens} new tokens, T={args.temperature}; load average {load:.1f}")
    for share in (False, True):
        print(f"shared={str(share).lower():<5}: median {median[share]:.2f} s, "
              f"{rows * args.new_tokens / median[share]:.0f} tokens/s, {cpu_median[share]:.2f} CPU s, "
              f"{columns[share]} prompt columns computed (of {int(mask.sum())} prompt tokens in {rows} rows)")
    print(f"speed-up (off / on, medians): wall {median[False] / median[True]:.2f}x, CPU time "
          f"{cpu_median[False] / cpu_median[True]:.2f}x; greedy token-for-token equal: {equal}")
    return {"median_s": median, "cpu_s": cpu_median, "columns": columns, "greedy_equal": equal, "load": load}


if __name__ == "__main__":
    main()
