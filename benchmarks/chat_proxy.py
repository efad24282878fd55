"""The chat proxy's cost: a black-box agent's episodes through the OpenAI endpoint vs the same
requests straight to the engine.

    python -m benchmarks.chat_proxy [--episodes 256] [--concurrency 128] [--backend hf|vllm] [--in-process]
                                    [--no-client-cost] [--json out.json]

N episodes of ``examples/agents/arithmetic_chat.py:RetryAgent`` (up to 3 tries, 8 tokens a reply),
C in flight at a time, on the tiny model and one engine: an engine server (a Ray actor of its own,
1 CPU, as in the recipe) by default, or in this process (``--in-process``, where the agents, the
proxy and the engine share one interpreter):

  (a) proxy: ``ChatAgentRunner`` playing them: the agent's ``openai.AsyncOpenAI`` client, HTTP to the
      proxy on this event loop, session rendering, then the engine;
  (b) bare:  the very token requests (a) sent (the contexts recorded in (a)), C at a time, straight to
      the same engine: the engine's own throughput on this work, the limit for (a).

Prints requests/s and generated tokens/s of each and the ratio a/b; ``--json`` writes them. The
ratio is what the agent's client, HTTP and rendering cost per request against the generation it
carries (on 2 cores they also take CPU from the engine). It also prints this process's CPU time per
request in (a) and (b): with an engine server that is the agents, their clients, the proxy and the
Ray calls, a measure of the proxy's cost that other jobs on the cores do not blur as they blur the
rates.

Then the agents' side alone (``--no-client-cost`` skips it): the same conversations sent to a canned
reply by the stock ``openai`` client and by raw ``httpx`` (``client_cost``), CPU per request: the part
of (a)'s cost that is the agent's client, not the proxy.

Then time to first token (``--ttft-requests``, 0 to skip): the stock ``openai`` client asks the
same engine for ``--ttft-tokens``-token replies with ``stream=True`` through a proxy of its own
(the run's sampling, eos ignored, so every reply has that length), one request at a time and
``--ttft-concurrency`` at once; per request the time until the first content delta and until the
reply's end. Timing is reported, never asserted (the test suite runs ``--quick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import openai
import ray
import torch
import uvicorn
from transformers import AutoTokenizer

from rlcore.agentic.async_router import AsyncSessionRouter
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec
from rlcore.agentic.chat_proxy import ChatProxy
from rlcore.data.arithmetic import make_arithmetic_examples
from rlcore.engines import RolloutConfig, SamplingSettings
from rlcore.engines.server import build_async_engine, start_engine_servers, stop_engine_servers
from rlcore.models import ModelConfig, build_tiny_model
from rlcore.trainer.builder import worker_priority  # the workers at the driver's priority, as a run's
from benchmarks.results import write_json

AGENT = str(Path(__file__).resolve().parent.parent / "examples/agents/arithmetic_chat.py") + ":RetryAgent"


class Recorder:
    """The engine, with every request it is sent (context and budget) written down."""

    def __init__(self, engine) -> None:
        self.engine, self.requests, self.tokens = engine, [], 0
        self.pad_token_id = engine.pad_token_id

    async def generate(self, prompt_ids, sampling, session_id=None):
        completion = await self.engine.generate(prompt_ids, sampling, session_id)
        self.requests.append((list(prompt_ids), sampling))
        self.tokens += len(completion.token_ids)
        return completion

    async def generate_stream(self, prompt_ids, sampling, session_id=None):
        async for item in self.engine.generate_stream(prompt_ids, sampling, session_id):
            yield item

    def num_running(self) -> int:
        return self.engine.num_running()


async def _limited(coros, concurrency: int):
    gate = asyncio.Semaphore(concurrency)

    async def one(coro):
        async with gate:
            return await coro
    return await asyncio.gather(*[one(c) for c in coros])


async def time_to_first_token(engine, model_dir: Path, sampling: SamplingSettings, args) -> dict:
    """Streamed replies through the stock client: first content delta vs the whole reply, per request."""
    long = dataclasses.replace(sampling, max_new_tokens=args.ttft_tokens, ignore_eos=True)
    proxy = ChatProxy(AsyncSessionRouter([engine]), AutoTokenizer.from_pretrained(model_dir), long)
    await proxy.start()
    messages = [{"role": "user", "content": r["prompt"]}
                for r in make_arithmetic_examples(args.ttft_requests, seed=1, max_operand=19)]

    async def one(i: int, http: httpx.AsyncClient) -> tuple[float, float, int]:
        access = proxy.open_session(f"ttft-{i}-{time.perf_counter_ns()}", 4 * args.ttft_tokens)
        client = openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, http_client=http, max_retries=0)
        start, first, deltas = time.perf_counter(), None, 0
        async for ch in await client.chat.completions.create(model="policy", messages=[messages[i]], stream=True):
            if ch.choices and ch.choices[0].delta.content:
                first = time.perf_counter() - start if first is None else first
                deltas += 1
        total = time.perf_counter() - start
        proxy.close_session(access.session_id)
        return first, total, deltas

    out = {"tokens": args.ttft_tokens}
    async with httpx.AsyncClient(timeout=600) as http:
        await one(0, http)  # warm-up
        sequential = [await one(i, http) for i in range(args.ttft_requests)]
        concurrent = await asyncio.gather(*[one(i, http) for i in range(min(args.ttft_concurrency, args.ttft_requests))])
    for name, rows in (("one_at_a_time", sequential), (f"{len(concurrent)}_at_once", concurrent)):
        firsts, totals = [r[0] for r in rows], [r[1] for r in rows]
        out[name] = {"requests": len(rows), "ttft_s_median": statistics.median(firsts),
                     "reply_s_median": statistics.median(totals), "ttft_s_max": max(firsts),
                     "ttft_over_reply": statistics.median(f / t for f, t in zip(firsts, totals)),
                     "deltas_per_reply": statistics.mean(r[2] for r in rows)}
    await proxy.stop()
    return out


async def client_cost(tasks: list[dict], concurrency: int) -> dict:
    """CPU per request of the agents' side alone: RetryAgent's three requests per task (1, 3 and 5
    messages) sent C at a time to an ASGI app that answers every one with the same canned reply, on
    uvicorn as the proxy is, by (c1) the stock ``openai`` client and (c2) ``httpx`` posting the JSON
    itself. c1 - c2 is the openai client's own cost per request (its request transforms, its response
    models), which no proxy can take off; c2 is the loopback HTTP floor (both ends in this process)."""
    reply = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "policy", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22}}).encode()

    async def canned(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})

    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(canned, interface="asgi3", log_level="warning", access_log=False,
                                           lifespan="off", proxy_headers=False, server_header=False, date_header=False))
    server.capture_signals = contextlib.nullcontext  # the benchmark keeps its signals
    serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"

    def conversations(task):
        messages = list(task["messages"])
        for _ in range(3):
            yield messages
            messages = messages + [{"role": "assistant", "content": "7"}, {"role": "user", "content": "no. again"}]

    async def stock(task, http):
        client = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0, timeout=60, http_client=http)
        for messages in conversations(task):
            answer = await client.chat.completions.create(model="policy", messages=messages)
            assert answer.choices[0].message.content == "7"

    async def raw(task, http):
        for messages in conversations(task):
            body = json.dumps({"model": "policy", "messages": messages})
            r = await http.post(f"{url}/chat/completions", content=body,
                                headers={"authorization": "Bearer k", "content-type": "application/json"})
            assert r.json()["choices"][0]["message"]["content"] == "7"

    out = {}
    async with openai.DefaultAsyncHttpxClient(timeout=60) as http:
        for name, episode in (("openai_client", stock), ("raw_httpx", raw)):
            await _limited([episode(t, http) for t in tasks[:8]], 8)  # warm up
            cpu = time.process_time()
            await _limited([episode(t, http) for t in tasks], concurrency)
            out[f"{name}_cpu_ms_per_request"] = (time.process_time() - cpu) / (3 * len(tasks)) * 1e3
    server.should_exit = True
    await serving
    return out


async def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-chat-"))
    model_dir = build_tiny_model(work / "model", seed=0)
    rollout_cfg = RolloutConfig(backend=args.backend, max_new_tokens=8, dtype="float32",
                                kv_cache_memory_bytes=256 << 20, max_model_len=256)
    if args.in_process:
        engine = build_async_engine(ModelConfig(path=model_dir), rollout_cfg)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 _system_config=worker_priority())
        [engine] = start_engine_servers(1, ModelConfig(path=model_dir), rollout_cfg, num_cpus=1)
    sampling = SamplingSettings.resolve(rollout_cfg, {"n": 1})
    recorder = Recorder(engine)
    spec = ChatAgentSpec(AGENT, model_dir, sampling, {"max_tries": 3}, max_total_tokens=128)
    runner = ChatAgentRunner(spec, [engine])
    runner.router.engines = [recorder]  # same engine, requests written down
    tasks = [{"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
             for r in make_arithmetic_examples(args.episodes, seed=0, max_operand=19)]
    await runner.url()
    await _limited([runner.play(t, f"warm-{i}") for i, t in enumerate(tasks[:8])], 8)  # warm up both paths
    recorder.requests, recorder.tokens = [], 0

    start, cpu = time.perf_counter(), time.process_time()
    await _limited([runner.play(t, f"s{i}") for i, t in enumerate(tasks)], args.concurrency)
    proxy_s, proxy_tokens, requests = time.perf_counter() - start, recorder.tokens, list(recorder.requests)
    proxy_cpu = time.process_time() - cpu

    start, cpu = time.perf_counter(), time.process_time()
    completions = await _limited([engine.generate(ids, s) for ids, s in requests], args.concurrency)
    bare_s, bare_tokens = time.perf_counter() - start, sum(len(c.token_ids) for c in completions)
    bare_cpu = time.process_time() - cpu
    await runner.close()
    ttft = await time_to_first_token(engine, model_dir, sampling, args) if args.ttft_requests else None
    clients = await client_cost(tasks, args.concurrency) if args.client_cost else None
    if args.in_process:
        await engine.close()
    else:
        stop_engine_servers([engine])
    out = {"backend": args.backend, "engine": "in-process" if args.in_process else "server", "episodes": args.episodes, "concurrency": args.concurrency,
           "requests": len(requests), "proxy_s": proxy_s, "bare_s": bare_s,
           "proxy_requests_per_s": len(requests) / proxy_s, "bare_requests_per_s": len(requests) / bare_s,
           "proxy_tokens_per_s": proxy_tokens / proxy_s, "bare_tokens_per_s": bare_tokens / bare_s,
           "proxy_over_bare_requests": (len(requests) / proxy_s) / (len(requests) / bare_s),
           # this process's CPU per request (with an engine server: the agents, their clients, the proxy
           # and the Ray calls; in-process: the engine too): what the proxy costs, whatever else shares the cores
           "proxy_cpu_ms_per_request": proxy_cpu / len(requests) * 1e3,
           "bare_cpu_ms_per_request": bare_cpu / len(requests) * 1e3,
           "client_cost": clients, "ttft": ttft}
    return out


def _loop_factory(name: str):
    """uvloop's loop where asked and installed (Ray runs async actors on it, RAY_USE_UVLOOP), else asyncio's."""
    if name == "uvloop":
        try:
            import uvloop
            return uvloop.new_event_loop
        except ImportError:
            print("uvloop is not installed: asyncio's event loop")
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--in-process", action="store_true", help="the engine in this process, not a server")
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--ttft-requests", type=int, default=16, help="streamed requests timed (0: none)")
    parser.add_argument("--ttft-tokens", type=int, default=128, help="tokens of each streamed reply")
    parser.add_argument("--ttft-concurrency", type=int, default=16, help="streamed requests at once, second round")
    parser.add_argument("--no-client-cost", dest="client_cost", action="store_false",
                        help="skip timing the clients against a canned reply")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in this process (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a few episodes: proves it runs")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop",
                        help="the event loop of (a) and (b): uvloop, as Ray gives its async actors (the recipe's "
                             "runners) where it is installed, or asyncio's own")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.quick:
        args.episodes, args.concurrency = 16, 8
        args.ttft_requests, args.ttft_tokens, args.ttft_concurrency = min(args.ttft_requests, 2), 16, 2
    torch.manual_seed(0)
    if args.threads:
        torch._C.set_num_threads(args.threads)
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        out = runner.run(run(args))
    out["loop"] = args.loop
    print(f"{out['requests']} requests of {out['episodes']} episodes, {out['concurrency']} in flight, "
          f"{args.backend} engine {out['engine']}:")
    print(f"  proxy  {out['proxy_requests_per_s']:8.1f} requests/s  {out['proxy_tokens_per_s']:8.1f} tokens/s")
    print(f"  bare   {out['bare_requests_per_s']:8.1f} requests/s  {out['bare_tokens_per_s']:8.1f} tokens/s")
    print(f"  proxy / bare: {out['proxy_over_bare_requests']:.2f}")
    print(f"  this process's CPU per request: proxy {out['proxy_cpu_ms_per_request']:.2f} ms, "
          f"bare {out['bare_cpu_ms_per_request']:.2f} ms")
    if out["client_cost"]:
        c = out["client_cost"]
        print(f"  the agents' side alone, against a canned reply: stock openai client "
              f"{c['openai_client_cpu_ms_per_request']:.2f} ms, raw httpx {c['raw_httpx_cpu_ms_per_request']:.2f} ms "
              "of CPU per request")
    for name, t in (out["ttft"] or {}).items():
        if isinstance(t, dict):
            print(f"  streamed {out['ttft']['tokens']}-token replies, {name.replace('_', ' ')}: first delta "
                  f"{t['ttft_s_median'] * 1e3:.0f} ms (max {t['ttft_s_max'] * 1e3:.0f}), whole reply "
                  f"{t['reply_s_median'] * 1e3:.0f} ms (medians; {t['deltas_per_reply']:.0f} deltas a reply)")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
