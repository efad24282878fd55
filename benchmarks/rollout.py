"""Rollout speed: HF ``generate`` vs vLLM (fp32 and bf16) on the same prompts, and weight-sync cost.

    python benchmarks/rollout.py --preset small --prompts 256 --new-tokens 128

Every backend runs through ``RolloutWorker`` (the code path recipes use) in a fresh subprocess: vLLM
changes process-wide torch settings (on CPU it turns ``torch.set_num_threads`` into a no-op; its GPU
worker sets torch to 1 thread), which would bias whatever ran next.
Generation samples at temperature 1 with ``ignore_eos``, so every backend produces exactly
prompts x new-tokens tokens. Each engine is warmed up with one small batch before timing.

Weight sync: ``update_weights`` with the model's own full state dict (what the actor hands over),
against a plain ``param.copy_`` of the same tensors into an HF model of the engine's dtype; for
vLLM also the path it took (in place, or vLLM's loader), the part spent in vLLM's packing, and how
many matmul layers ended up on vLLM's packed kernels and how many on their plain weights
(``rollout.cpu_weight_layout``: the ``-packed`` / ``-plain`` backends fix it, the others are on
``auto``, which decides at the first sync). Generation is timed again after the syncs (what a
training run sees from its second step on): ``gen s`` and ``tokens/s`` are that second run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BACKENDS = {
    "hf": {"backend": "hf"},
    "vllm-fp32": {"backend": "vllm", "dtype": "float32"},
    "vllm-bf16": {"backend": "vllm", "dtype": "bfloat16"},
    "vllm-fp32-loader": {"backend": "vllm", "dtype": "float32"},  # weight sync through vLLM's loader, for comparison
    "vllm-bf16-loader": {"backend": "vllm", "dtype": "bfloat16"},
    "vllm-fp32-packed": {"backend": "vllm", "dtype": "float32", "cpu_weight_layout": "packed"},
    "vllm-bf16-packed": {"backend": "vllm", "dtype": "bfloat16", "cpu_weight_layout": "packed"},
    "vllm-fp32-plain": {"backend": "vllm", "dtype": "float32", "cpu_weight_layout": "plain"},
    "vllm-bf16-plain": {"backend": "vllm", "dtype": "bfloat16", "cpu_weight_layout": "plain"},
}


def make_prompts(tokenizer, count: int, max_len: int, seed: int):
    """``count`` random digit-arithmetic-looking prompts of 50-100% of ``max_len`` characters, left-padded."""
    import numpy as np
    import torch

    from rlcore.data.dataset import collate_prompts
    from rlcore.protocol import DataProto

    rng = np.random.default_rng(seed)
    alphabet = list("0123456789+-*= ")
    items = []
    for i in range(count):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(max_len // 2, max_len + 1))))
        items.append({"input_ids": torch.tensor(tokenizer(text)["input_ids"]), "uid": str(i)})
    tensors, non_tensors = collate_prompts(items, tokenizer.pad_token_id)
    return DataProto.from_dict(tensors, non_tensors)


def run_one(args: argparse.Namespace) -> dict:
    """Measure one backend in this process (the child side)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
    from rlcore.workers.rollout import RolloutWorker

    rollout_cfg = {**BACKENDS[args.child], "max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True,
                   "seed": 0}
    if rollout_cfg["backend"] == "vllm":
        rollout_cfg.update(kv_cache_memory_bytes=args.kv_cache_mb << 20,
                           max_model_len=args.prompt_len + args.new_tokens)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    start = time.perf_counter()
    wg = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": args.model_dir}, "rollout": rollout_cfg}))
    wg.init_model()
    init_s = time.perf_counter() - start

    warm_up = make_prompts(tok, 8, args.prompt_len, seed=1)
    warm_up.meta_info["max_new_tokens"] = 8
    wg.generate_sequences(warm_up)
    prompts = make_prompts(tok, args.prompts, args.prompt_len, seed=0)

    def timed_generation() -> tuple[float, int]:
        start = time.perf_counter()
        out = wg.generate_sequences(prompts)
        return time.perf_counter() - start, int(out.batch["response_mask"].sum())

    first_gen_s, _ = timed_generation()  # the engine as loaded (packed); auto decides at the first sync

    dtype = torch.float32 if rollout_cfg.get("dtype", "float32") == "float32" else torch.bfloat16
    state = AutoModelForCausalLM.from_pretrained(args.model_dir).state_dict()
    # One untimed round each first: the first touch of freshly loaded memory is not what a sync costs.
    engine = wg.worker().engine
    sync_s, pack_s = [], []
    for _ in range(1 + args.sync_repeats):
        sync_s.append(wg.update_weights(state)[0]["rollout/weight_sync_s"])
        pack_s.append(getattr(engine, "last_pack_s", None))  # vLLM in place: its own packing of the layers
    sync_s, pack_s = sync_s[1:], pack_s[1:]
    wg.generate_sequences(warm_up)
    gen_s, n_tokens = timed_generation()
    target = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).state_dict()
    copy_s = []
    for _ in range(1 + args.sync_repeats):
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in state.items():
                target[name].copy_(tensor)
        copy_s.append(time.perf_counter() - start)
    copy_s = copy_s[1:]
    return {
        "backend": args.child, "init_s": init_s, "gen_s": gen_s, "first_gen_s": first_gen_s, "tokens": n_tokens,
        "tokens_per_s": n_tokens / gen_s, "weight_layouts": getattr(engine, "weight_layouts", None),
        "sync_s": statistics.median(sync_s), "copy_s": statistics.median(copy_s),
        "sync_path": getattr(engine, "last_sync_path", "in_place"),
        "pack_s": statistics.median(pack_s) if None not in pack_s else None,
        "params": sum(t.numel() for t in state.values()), "torch_threads": torch.get_num_threads(),
    }


def spawn(backend: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, "--model-dir", args.model_dir,
           "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len),
           "--sync-repeats", str(args.sync_repeats), "--kv-cache-mb", str(args.kv_cache_mb)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error"}
    if backend.endswith("-loader"):  # the same engine, its weight sync forced through vLLM's loader
        env["RLCORE_VLLM_SYNC"] = "loader"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout_s)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not results:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"benchmark of {backend} failed (exit code {proc.returncode})")
    return json.loads(results[-1].removeprefix("RESULT "))


def report(rows: list[dict], args: argparse.Namespace) -> None:
    base = next((r for r in rows if r["backend"] == "hf"), rows[0])
    print(f"\npreset={args.preset} ({rows[0]['params'] / 1e6:.1f}M params), {args.prompts} prompts of <= "
          f"{args.prompt_len} tokens, {args.new_tokens} new tokens each, sampling T=1, 2-core CPU\n")
    print(f"{'backend':<16} {'start s':>8} {'gen s':>8} {'tokens/s':>9} {'vs hf':>6} {'sync ms':>8} {'copy_ ms':>9} "
          f"{'sync/copy_':>10} {'pack ms':>8}  sync path  matmul layers")
    for r in rows:
        pack = f"{1e3 * r['pack_s']:8.1f}" if r.get("pack_s") is not None else f"{'-':>8}"
        print(f"{r['backend']:<16} {r['init_s']:8.1f} {r['gen_s']:8.2f} {r['tokens_per_s']:9.0f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:6.2f} {1e3 * r['sync_s']:8.1f} {1e3 * r['copy_s']:9.1f} "
              f"{r['sync_s'] / r['copy_s']:10.1f} {pack}  {r.get('sync_path'):<9}  {layouts(r)}")
    print("gen s: after the syncs (the first generation, on the engine as loaded, is in the JSON as first_gen_s); "
          "pack ms: the part of an in-place vLLM sync spent in vLLM's own packing of the layers' matmul weights "
          "(oneDNN on CPU), the floor of any update into those kernels; matmul layers: packed / plain after the syncs")


def layouts(row: dict) -> str:
    counts = row.get("weight_layouts")
    return f"{counts['packed']} / {counts['plain']}" if counts else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["tiny", "small"], default="small")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt, in tokens")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated, from {list(BACKENDS)}")
    parser.add_argument("--sync-repeats", type=int, default=5, help="timed syncs (median reported)")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="vLLM KV cache size")
    parser.add_argument("--model-dir", help="reuse this model directory instead of building one")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="limit of one backend's subprocess")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 4 prompts x 8 tokens, hf and vllm-fp32 "
                        "(the suite's smoke run; the loader's sync is tested in tests/engines/test_vllm_in_place_sync.py)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", choices=list(BACKENDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.preset, args.prompts, args.new_tokens, args.sync_repeats = "tiny", 4, 8, 2
        args.backends, args.kv_cache_mb = "hf,vllm-fp32", 64

    if args.child:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model_dir:
            from rlcore.models.tiny import build_tiny_model

            args.model_dir = build_tiny_model(os.path.join(tmp, args.preset), preset=args.preset, seed=0)
        rows = []
        for backend in backends:
            rows.append(spawn(backend, args))
            print(f"{backend}: {rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
        report(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary(rows, args), f, indent=2)


def summary(rows: list[dict], args: argparse.Namespace) -> dict:
    """The rows, and per backend its tokens/s and its sync time over a plain copy_ (the issue's ratio)."""
    out: dict = {"preset": args.preset, "prompts": args.prompts, "new_tokens": args.new_tokens, "rows": rows}
    for r in rows:
        out[f"{r['backend']}_tokens_per_s"] = float(r["tokens_per_s"])
        out[f"{r['backend']}_sync_over_copy"] = float(r["sync_s"] / r["copy_s"])
    return out


if __name__ == "__main__":
    main()
