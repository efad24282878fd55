"""Agentic rollout speed under env latency: turn-lockstep vs episodes as coroutines vs the bare engine.

    python -m benchmarks.agentic [--episodes 4096] [--concurrency 512] [--engine-batch 256]
                                 [--latency auto|SECONDS] [--backend hf|vllm] [--engine-process]
                                 [--repeats 3] [--json out.json]

N episodes of ``arithmetic_retry`` (up to 3 tries, 8 tokens a turn), C of them in flight at a time,
whose every env step first sleeps a heavy-tailed (log-normal, sigma 1) time with mean about one
turn's generation time (``--latency auto``: measured first, the time one batched turn of B
requests takes), all on the same engine and weights. B is the engine's batch bound: the HF engine
runs at most B requests at once: ``rollout.max_num_seqs`` = B for either engine (the HF engine's running batch,
vLLM's ``max_num_seqs``). C = 2B episodes in flight is the
rollout pool's over-provisioning: with half of them in their env at any time, the engine's batch
still stays full. ``--engine-batch 0`` runs B = C (no over-provisioning: the engine's batch holds
only the episodes not in their env):

  (a) lockstep: ``MultiTurnRollout`` on batches of B episodes (all the engine batches at once), one
      batch after another (one batched generate per turn over the live episodes, then every env
      steps, concurrently; the next turn waits for the slowest);
  (b) async:    ``EpisodeRunner`` playing the episodes as coroutines on the asynchronous engine
      (``AsyncHFEngine`` / ``AsyncVLLMEngine``), streaming: a new episode starts as soon as one of
      the C ends, so env latency overlaps other episodes' generation and the engine never drains;
  (c) bare:     the very requests (b) made, each session's in its order, B sessions at a time
      (so B requests in flight: the engine's batch full), to the same engine with no env in
      between: the engine's own throughput on this work, the limit for (b).

The HF engine's per-session prefix cache is off for (b) and (c): (c) samples its own replies, so
the recorded next turns do not extend them and it could reuse nothing, while (b) would reuse each
turn's earlier part, less work than (c) does. (b) runs once more with the cache on, as the engine
runs by default (``async_prefix_cache``). vLLM's content-hashed prefix cache is on throughout.

The engine runs in this process (its decode loop a thread beside the episodes' event loop) unless
``--engine-process`` serves it in a Ray actor, as the agentic recipe does: at this tiny model every
request's Ray round trip then costs about as much as its decode, and both (b) and (c) slow down
(bare 3.2k vs 8.0k tokens/s measured once), their ratio about the same (0.59).

(b) and (c) run ``--repeats`` times (3), alternately, each (c) on the requests of the (b) before it:
on a 2-core machine the bare engine alone varies by 1.5x between runs of the same command, and a
pair measured back to back shares the machine's mood. The pair of the median ratio (of an even count,
the lower middle one) is reported, with every ratio.

Prints episodes/s and generated tokens/s of each and the ratios b/a and b/c, and (b)'s tokens/s
while all C episodes were in flight (until the last one started; after it the last episodes'
heavy-tailed env steps drain with the engine mostly idle); ``--json`` writes them.
Timing is reported, never asserted (the test suite runs ``--quick`` to prove it works).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time

import torch
from transformers import AutoTokenizer

from rlcore.agentic import EpisodeRunner, EpisodeSpec, MultiTurnRollout, make_env
from rlcore.data.arithmetic import make_arithmetic_examples
from rlcore.engines import RolloutConfig, SamplingSettings, build_engine
from rlcore.engines.server import build_async_engine, start_engine_servers
from rlcore.models import ModelConfig, build_tiny_model
from rlcore.models.tiny import TINY_PRESETS
from rlcore.trainer.builder import worker_priority  # the workers at the driver's priority, as a run's
from benchmarks.results import write_json


class Recorder:
    """An async engine wrapper that records every request (context ids, budget) it passes on."""

    def __init__(self, engine) -> None:
        self.engine, self.requests, self.completions, self.finished = engine, [], [], []
        self.pad_token_id = engine.pad_token_id

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.requests.append((list(prompt_ids), sampling, session_id))
        completion = await self.engine.generate(prompt_ids, sampling, session_id)
        self.completions.append(completion)
        self.finished.append((time.perf_counter(), len(completion.token_ids)))
        return completion

    def num_running(self) -> int:
        return self.engine.num_running()


def tasks(n: int, seed: int) -> list[dict]:
    return [{"prompt": e["prompt"], "answer": e["answer"], "seed": i}
            for i, e in enumerate(make_arithmetic_examples(n, seed=seed, max_operand=99))]


def run_lockstep(engine, tok, task_list, sampling, latency, args) -> dict:
    rollout = MultiTurnRollout(engine, tok, lambda: make_env("arithmetic_retry", tok, step_latency_s=latency),
                               args.max_turns, args.max_total_tokens, sampling, step_timeout_s=600.0)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(task_list), args.engine_batch):  # the engine batches at most B: so does lockstep
        batch = task_list[i:i + args.engine_batch]
        out = rollout.run(batch, seeds=[t["seed"] for t in batch])
        tokens += int(out.batch["response_mask"].sum())
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


async def bounded(coros, limit: int, started: list | None = None) -> list:
    """Run the coroutines ``limit`` at a time (a new one starts as soon as one ends), in order;
    ``started`` gets each one's start time."""
    gate = asyncio.Semaphore(limit)

    async def one(coro):
        async with gate:
            if started is not None:
                started.append(time.perf_counter())
            return await coro

    return await asyncio.gather(*[one(c) for c in coros])


async def run_async(engine, spec, task_list, concurrency: int) -> tuple[dict, Recorder]:
    recorder = Recorder(engine)
    runner = EpisodeRunner(spec, [recorder])
    start, started = time.perf_counter(), []
    trajs = await bounded([runner.play(t, i) for i, t in enumerate(task_list)], concurrency, started)
    seconds = time.perf_counter() - start
    cached = sum(c.metrics.get("engine/cached_prompt_tokens", 0.0) for c in recorder.completions)
    # until the last episode started, C were in flight; after it, the last ones drain (their env tails)
    last_start = max(started)
    full = last_start - start
    full_tokens = sum(n for t, n in recorder.finished if t <= last_start)
    return {"seconds": seconds, "tokens": sum(sum(t.policy_mask) for t in trajs),
            "env_s_max": max(t.metrics["episode/env_s"] for t in trajs),
            "gen_s_max": max(t.metrics["episode/gen_s"] for t in trajs),
            "prompt_tokens": sum(len(ids) for ids, _, _ in recorder.requests), "cached_prompt_tokens": cached,
            "all_in_flight_s": full, "all_in_flight_tokens_per_s": full_tokens / full if full > 0 else float("nan")}, \
        recorder


async def run_bare(engine, requests, concurrency: int) -> dict:
    """Each session's requests in their order, one after another (a turn extends the last one), C
    sessions at a time: C requests in flight, as in (b), without the env in between."""
    chains: dict = {}
    for i, (ids, s, session) in enumerate(requests):
        chains.setdefault(i if session is None else ("s", session), []).append((ids, s, session))

    async def chain(turns):
        return [await engine.generate(ids, s, session) for ids, s, session in turns]

    start = time.perf_counter()
    outs = [o for turns in await bounded([chain(t) for t in chains.values()], concurrency) for o in turns]
    return {"seconds": time.perf_counter() - start, "tokens": sum(len(o.token_ids) for o in outs),
            "cached_prompt_tokens": sum(o.metrics.get("engine/cached_prompt_tokens", 0.0) for o in outs)}


async def measure_turn_latency(engine, task_list, tok, sampling) -> float:
    """Mean time one request waits in a batched turn: the 'one turn's generation time' env steps mimic."""
    prompts = [tok.encode(t["prompt"], add_special_tokens=False) for t in task_list]
    start = time.perf_counter()
    await asyncio.gather(*[engine.generate(p, sampling) for p in prompts])
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=512, help="episodes in flight at a time")
    p.add_argument("--engine-batch", type=int, default=256,
                   help="the engine's batch bound (HF: max running requests) and (c)'s requests in flight; "
                        "0: --concurrency. More episodes in flight than this covers their env time")
    p.add_argument("--latency", default="auto", help="mean env step latency in seconds, or 'auto'")
    p.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-total-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default="tiny", choices=sorted(TINY_PRESETS),
                   help="the model's size (rlcore.models.tiny): tiny 0.3M parameters, small 25M")
    p.add_argument("--engine-process", action="store_true",
                   help="serve the engine in a Ray actor (as the agentic recipe does), not in this process")
    p.add_argument("--repeats", type=int, default=3,
                   help="(b) and (c) this many times, alternately: the pair of the median ratio is reported")
    p.add_argument("--quick", action="store_true", help="a few episodes: proves the benchmark runs")
    p.add_argument("--no-lockstep", action="store_true", help="only (b) and (c): their ratio, sooner")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.episodes, args.concurrency, args.engine_batch, args.repeats = 16, 8, 4, 2
    args.engine_batch = args.engine_batch or args.concurrency
    torch._C.set_num_threads(args.threads)
    if args.engine_process:
        import ray

        ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _system_config=worker_priority())
    model_dir = build_tiny_model(tempfile.mkdtemp(), preset=args.preset)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model_cfg = ModelConfig(path=model_dir)
    rollout_cfg = RolloutConfig(backend=args.backend, dtype="float32", max_new_tokens=args.new_tokens,
                                max_num_seqs=args.engine_batch)
    sampling = SamplingSettings.resolve(rollout_cfg, {"n": 1})
    task_list = tasks(args.episodes, seed=0)
    spec = EpisodeSpec("arithmetic_retry", model_dir, sampling, {}, args.max_turns, args.max_total_tokens)

    def start_engine(cfg: RolloutConfig):
        if args.engine_process:
            return start_engine_servers(1, model_cfg, cfg, num_cpus=args.threads)[0]
        return build_async_engine(model_cfg, cfg)

    async def async_part(latency: float | None) -> dict:
        # HF's per-session KV cache off for (b) and (c): the same work (see the module docstring)
        engine = start_engine(dataclasses.replace(rollout_cfg, prefix_cache_bytes=0))
        await measure_turn_latency(engine, task_list[:8], tok, sampling)  # warm-up
        turn_s = await measure_turn_latency(engine, task_list[:args.engine_batch], tok, sampling)
        latency = turn_s if latency is None else latency
        async_spec = EpisodeSpec(spec.env, spec.tokenizer_path, spec.sampling,
                                 {"step_latency_s": latency, "latency_sigma": 1.0}, spec.max_turns,
                                 spec.max_total_tokens, step_timeout_s=600.0)
        pairs = []  # (b) then (c) on its requests, again and again: a slower minute on a shared machine hits both
        for _ in range(args.repeats):
            b, recorder = await run_async(engine, async_spec, task_list, args.concurrency)
            c = await run_bare(engine, recorder.requests, args.engine_batch)
            ratio = b["tokens"] / b["seconds"] / (c["tokens"] / c["seconds"])
            pairs.append((ratio, b, c))
            print(f"  async {b['tokens'] / b['seconds']:.0f} tokens/s, bare {c['tokens'] / c['seconds']:.0f} tokens/s: "
                  f"async / bare = {ratio:.2f}; while all {args.concurrency} were in flight (the first "
                  f"{b['all_in_flight_s']:.1f} of {b['seconds']:.1f} s) async ran "
                  f"{b['all_in_flight_tokens_per_s']:.0f} tokens/s", flush=True)
        await engine.close()
        _, b, c = sorted(pairs, key=lambda pair: pair[0])[(len(pairs) - 1) // 2]  # the median ratio (even: the lower)
        out = {"latency_s": latency, "turn_s": turn_s, "async": b, "bare": c,
               "async_over_bare_runs": [ratio for ratio, _, _ in pairs]}
        if args.backend == "hf":  # (b) again as the engine runs by default, each turn reusing its session's KV
            engine = start_engine(rollout_cfg)
            await measure_turn_latency(engine, task_list[:8], tok, sampling)  # warm-up
            out["async_prefix_cache"], _ = await run_async(engine, async_spec, task_list, args.concurrency)
            await engine.close()
            bc = out["async_prefix_cache"]
            print(f"  async with the prefix cache {bc['tokens'] / bc['seconds']:.0f} tokens/s "
                  f"({bc['cached_prompt_tokens'] / bc['prompt_tokens']:.0%} of the prompt tokens reused)", flush=True)
        return out

    res = asyncio.run(async_part(None if args.latency == "auto" else float(args.latency)))
    if args.no_lockstep:
        res["lockstep"] = {"seconds": float("nan"), "tokens": 0}
    else:
        sync_engine = build_engine(model_cfg, rollout_cfg)
        res["lockstep"] = run_lockstep(sync_engine, tok, task_list, sampling, res["latency_s"], args)
    modes = [key for key in ("lockstep", "async", "bare", "async_prefix_cache") if key in res]
    for key in modes:
        r = res[key]
        r["episodes_per_s"] = args.episodes / r["seconds"] if key != "bare" else float("nan")
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
    res["async_over_lockstep"] = res["async"]["tokens_per_s"] / res["lockstep"]["tokens_per_s"]
    res["async_over_bare"] = res["async"]["tokens_per_s"] / res["bare"]["tokens_per_s"]
    if "async_prefix_cache" in res:
        res["async_prefix_cache_over_bare"] = res["async_prefix_cache"]["tokens_per_s"] / res["bare"]["tokens_per_s"]
    res.update(episodes=args.episodes, concurrency=args.concurrency, engine_batch=args.engine_batch,
               backend=args.backend, threads=args.threads, preset=args.preset)
    print(f"{args.episodes} episodes of arithmetic_retry ({args.preset} model), {args.concurrency} in flight over an engine "
          f"batching {args.engine_batch}, env step latency lognormal mean {res['latency_s'] * 1e3:.0f} ms "
          f"(sigma 1), engine {args.backend}, {args.threads} threads")
    for key in modes:
        r = res[key]
        print(f"  {key:18s} {r['seconds']:7.2f} s  {r['episodes_per_s']:7.1f} episodes/s  "
              f"{r['tokens_per_s']:8.0f} tokens/s  ({r['tokens']} tokens)")
    runs = ", ".join(f"{r:.2f}" for r in res["async_over_bare_runs"])
    print(f"  async / lockstep = {res['async_over_lockstep']:.2f}   async / bare engine = {res['async_over_bare']:.2f}"
          f" (median of {runs})"
          + (f"   with the prefix cache: {res['async_prefix_cache_over_bare']:.2f}" if "async_prefix_cache" in res else ""))
    write_json(args.json, res)


if __name__ == "__main__":
    main()
