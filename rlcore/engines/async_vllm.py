"""``AsyncVLLMEngine``: vLLM's ``AsyncLLM`` behind the asynchronous interface (continuous batching).

Every ``generate`` is one vLLM request (token ids in, token ids and processed log-probs out);
concurrent requests are batched by vLLM's scheduler step by step, so a request that arrives
while others decode joins the next step. vLLM runs its engine core in a subprocess of its own.

Streaming (``generate_stream``): the same request with ``RequestOutputKind.DELTA``, each step's
new tokens yielded as vLLM hands them over; closing the stream aborts the request in vLLM. vLLM
reports version spans only with the final output, so a chunk is stamped with the version loaded
when it arrived and the final ``Completion`` carries the exact ones.

Per-token versions come from vLLM itself: its engine core stamps every step's output with its
current weight version, and the final output lists them as spans over the output tokens. A
weight update sets that version (``update_weight_version``) while generation is paused, so the
spans are exact, whether the swap happened between requests or in the middle of one.

Weight updates: ``begin_update`` pauses the scheduler, with ``mode="wait"`` (requests in flight
finish first; new ones wait) or, ``in_flight``, ``mode="keep"`` (requests stay where they are and
their KV cache is recomputed with the new weights after the swap, ``clear_cache=True``).
``load_bucket`` writes the bucket into a shared-memory file and asks vLLM's worker (through
``collective_rpc`` on ``rlcore.engines.vllm_worker.BucketLoader``) to map it and reload those
weights in place; a bucket is whole layers (``rlcore.engines.weights``), which vLLM's layerwise
reload needs. ``finish_update`` sets the version, resets the prefix cache, and resumes.

Seeds: ``sampling.seed`` is ignored; requests sample from vLLM's own stream (seeded with
``rollout.seed + rank``). One request is one row, and which rows a seed would reach depends on
arrival order and on weight swaps mid-request, so an asynchronous run is not repeatable anyway.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
import uuid
from typing import Any
from collections.abc import AsyncIterator, Hashable, Sequence

import torch
from transformers import AutoConfig

from rlcore.engines.async_base import AsyncEngine, Completion, TokenChunk
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.dtype_choice import default_vllm_dtype
from rlcore.engines.kv_cache_size import vllm_overrides
from rlcore.engines.probe import vllm_probe_params, vllm_probe_reply
from rlcore.engines.vllm_cpu_norm import cpu_kernel_config
from rlcore.engines.vllm_logs import quiet_vllm_logs
from rlcore.engines.weights import WeightBucket
from rlcore.models.config import ModelConfig, torch_dtype

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class AsyncVLLMEngine(AsyncEngine):
    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0,
                 engine_id: int | str | None = None) -> None:
        quiet_vllm_logs()  # its known-harmless start-up warnings, here and in the engine core process
        from vllm import AsyncEngineArgs  # optional dependency: imported when a vLLM engine is built
        from vllm.v1.engine.async_llm import AsyncLLM

        self.dtype = rollout_cfg.dtype or default_vllm_dtype(device)  # null: bf16 only where it is native
        extra = vllm_overrides(rollout_cfg, AutoConfig.from_pretrained(model_cfg.require_path()),
                               torch_dtype(self.dtype, "rollout.dtype"), device)
        extra.update(cpu_kernel_config(device))  # RMSNorm on the CPU build's fused kernels (rlcore.engines.vllm_cpu_norm)
        args = AsyncEngineArgs(
            model=model_cfg.require_path(), dtype=torch_dtype(self.dtype, "rollout.dtype"),
            enforce_eager=rollout_cfg.enforce_eager, max_model_len=rollout_cfg.max_model_len,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization, seed=rollout_cfg.seed + rank,
            logprobs_mode="processed_logprobs", worker_extension_cls="rlcore.engines.vllm_worker.BucketLoader",
            # nobody reads vLLM's own stats here; keeping them (prometheus counters, per-request
            # histograms, scheduler stats every step) was ~1 s of the 5.9 s the runner's process
            # spent on 3072 agentic turns (profiled), and more in the engine core
            disable_log_stats=True, **extra)
        self.llm = AsyncLLM.from_engine_args(args)
        tokenizer = self.llm.get_tokenizer()
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.engine_id, self.policy_version = engine_id, 0
        self._ids = itertools.count()
        self._id_prefix = f"{engine_id}-{uuid.uuid4().hex[:8]}"  # request ids: unique across engines and runs
        self._running = 0
        self._peak_running = 0  # the most requests decoded at once: where cpu_weight_layout "auto" measures
        self.cpu_weight_layout = rollout_cfg.cpu_weight_layout
        self._version_set = False
        self._update: dict | None = None

    async def _ensure_version(self) -> None:
        if not self._version_set:  # vLLM starts at "default"; ours are integers
            await self.llm.update_weight_version(str(self.policy_version))
            self._version_set = True

    def _sampling_params(self, s: SamplingSettings, stream: bool = False):
        from vllm import SamplingParams  # optional dependency (see __init__)
        from vllm.sampling_params import RequestOutputKind

        sample = dict(temperature=0.0) if s.greedy else dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
        return SamplingParams(n=1, **sample, max_tokens=s.max_new_tokens, stop=list(s.stop) or None,
                              stop_token_ids=list(s.stop_token_ids) or None, ignore_eos=s.ignore_eos, logprobs=s.top_logprobs,
                              detokenize=bool(s.stop),
                              output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        from vllm.inputs import TokensPrompt  # optional dependency (see __init__)

        if sampling.n != 1:
            raise ValueError(f"one request samples one continuation (n=1), got n={sampling.n}")
        await self._ensure_version()
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        start = time.perf_counter()
        final = None
        self._running += 1
        self._peak_running = max(self._peak_running, self._running)
        self._request_started()
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                               self._sampling_params(sampling), request_id):
                final = out
        finally:
            self._running -= 1
            self._request_finished()
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        c = final.outputs[0]
        tokens = list(c.token_ids)
        return self._completion(tokens, _log_probs(c.logprobs, tokens), _top(c.logprobs, sampling), c, start)

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                              session_id: Hashable | None = None) -> AsyncIterator[TokenChunk | Completion]:
        from vllm.inputs import TokensPrompt  # optional dependency (see __init__)

        if sampling.n != 1:
            raise ValueError(f"one request samples one continuation (n=1), got n={sampling.n}")
        await self._ensure_version()
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        start = time.perf_counter()
        tokens, log_probs, top, last = [], [], [] if sampling.top_logprobs else None, None
        self._running += 1
        self._peak_running = max(self._peak_running, self._running)
        self._request_started()
        outputs = self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                    self._sampling_params(sampling, stream=True), request_id)
        try:
            async for out in outputs:
                last = out.outputs[0]
                new = list(last.token_ids)
                if not new:
                    continue
                chunk = TokenChunk(new, _log_probs(last.logprobs, new), [self.policy_version] * len(new),
                                   _top(last.logprobs, sampling))
                tokens += chunk.token_ids
                log_probs += chunk.log_probs
                if top is not None:
                    top += chunk.top_logprobs
                yield chunk
        finally:
            await outputs.aclose()  # a stream closed early: vLLM aborts the request
            self._running -= 1
            self._request_finished()
        if last is None:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        yield self._completion(tokens, log_probs, top, last, start)

    def _completion(self, tokens: list[int], log_probs: list[float], top, c, start: float) -> Completion:
        """The Completion of a finished request (``c``: its last ``CompletionOutput``, with the version spans)."""
        versions = _versions(c.weight_versions, len(tokens), self.policy_version)
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(str(c.finish_reason), "stop")
        return Completion(tokens, log_probs, reason, versions, engine_id=self.engine_id,
                          metrics={"engine/request_s": time.perf_counter() - start}, top_logprobs=top)

    def num_running(self) -> int:
        return self._running

    # ------------------------------------------------------------------ weights
    async def begin_update(self, version: int, in_flight: bool = False) -> None:
        if self._update is not None:
            raise RuntimeError("begin_update while another weight update is in progress")
        await self._ensure_version()
        self._update = {"version": version, "start": time.perf_counter(), "load_s": 0.0, "bytes": 0, "peak": 0}
        await self.llm.pause_generation(mode="keep" if in_flight else "wait", clear_cache=in_flight)

    async def load_bucket(self, bucket: WeightBucket) -> None:
        if self._update is None:
            raise RuntimeError("load_bucket outside begin_update / finish_update")
        start = time.perf_counter()
        path = os.path.join(SHM_DIR, f"rlcore-bucket-{uuid.uuid4().hex}")
        try:
            shared = torch.from_file(path, shared=True, size=bucket.nbytes, dtype=torch.uint8)
            shared.copy_(bucket.buffer)
            entries = [(n, str(d).removeprefix("torch."), list(s), o) for n, d, s, o in bucket.entries]
            await self.llm.collective_rpc("load_bucket_file", args=(path, bucket.nbytes, entries,
                                                                    self.cpu_weight_layout, self._peak_running))
        finally:
            if os.path.exists(path):
                os.remove(path)
        u = self._update
        u["load_s"] += time.perf_counter() - start
        u["bytes"] += bucket.nbytes
        u["peak"] = max(u["peak"], bucket.nbytes)

    async def finish_update(self) -> dict[str, float]:
        if self._update is None:
            raise RuntimeError("finish_update without begin_update")
        u, self._update = self._update, None
        await self.llm.reset_prefix_cache()  # no KV computed with the old weights is reused
        await self.llm.update_weight_version(str(u["version"]))
        self.policy_version = u["version"]
        await self.llm.resume_generation()
        return {"engine/weight_update_s": time.perf_counter() - u["start"], "engine/weight_load_s": u["load_s"],
                "engine/weight_bytes": float(u["bytes"]), "engine/peak_bucket_bytes": float(u["peak"]),
                "engine/policy_version": float(self.policy_version)}

    async def weight_checksums(self) -> dict[str, tuple[str, int, int] | None] | None:
        """Read back in vLLM's worker (``BucketLoader.weight_checksums``, ``rlcore.engines.vllm_checksums``):
        ``None`` for a name whose layer keeps only a packed CPU kernel, ``None`` overall for a layout not mapped."""
        if self._update is not None:
            raise RuntimeError("weight_checksums during a weight update")
        return (await self.llm.collective_rpc("weight_checksums"))[0]

    async def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any]:
        """The prompt's log-probs from the engine's own kernels (``rlcore.engines.probe``)."""
        from vllm.inputs import TokensPrompt  # optional dependency (see __init__)

        if self._update is not None:
            raise RuntimeError("probe_log_probs during a weight update")
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(ids)), vllm_probe_params(),
                                           f"{self._id_prefix}-probe-{next(self._ids)}"):
            final = out
        return vllm_probe_reply(final, ids, str(torch_dtype(self.dtype, "rollout.dtype")).removeprefix("torch."))

    async def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()  # AsyncLLM's __del__ shuts down again: dropped here, it runs now, not at interpreter
            # exit, where it raised from a half-torn-down vllm module


def _log_probs(steps, tokens: list[int]) -> list[float]:
    return [step[t].logprob for step, t in zip(steps or [], tokens)]


def _top(steps, sampling: SamplingSettings) -> list[list[tuple[int, float]]] | None:
    """vLLM gives the top k plus the sampled token per step: rank them, keep k."""
    if not sampling.top_logprobs:
        return None
    k = sampling.top_logprobs
    return [sorted(((t, lp.logprob) for t, lp in step.items() if lp.rank is not None and lp.rank <= k),
                   key=lambda pair: -pair[1])[:k] for step in (steps or [])]


def _versions(spans, n: int, fallback: int) -> list[int]:
    """Per-token versions from vLLM's ``WeightVersionSpan``s (version, start, end) over the output tokens."""
    if not spans:
        return [fallback] * n
    out = [fallback] * n
    for span in spans:
        version = int(span.version) if str(span.version).lstrip("-").isdigit() else fallback
        for i in range(max(0, span.start), min(n, span.end)):
            out[i] = version
    return out
