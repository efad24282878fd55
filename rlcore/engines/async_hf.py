"""``AsyncHFEngine``: the HF engine behind the asynchronous interface, batching concurrent requests.

Requests are queued; a batching loop takes every request pending when the engine becomes free,
groups them by sampling settings (one ``generate`` call needs one temperature, top-p, ...), and
runs each group as one batched, left-padded ``HFEngine.generate`` in a worker thread, so the event
loop (the episodes' env steps) keeps running meanwhile. Requests that arrive during a call wait
for the next one: batching per call, not per token, which is what transformers can do. A group
is generated to its longest budget and each request cut to its own (sampling is autoregressive:
the first k tokens do not depend on how many follow).

Weight updates wait for the call in flight, then copy the buckets' tensors into the parameters
(names checked); HF responses therefore always come from one version, ``in_flight`` or not.

Seeds: ``sampling.seed`` is dropped (requests of several seeds batch together) and calls sample
from the engine's stream: which requests share a call depends on timing, so a per-call seed would
not make an asynchronous run repeatable.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from rlcore.engines.async_base import AsyncEngine, Completion
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.engines.weights import WeightBucket
from rlcore.models.config import ModelConfig


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingSettings
    future: asyncio.Future
    queued_at: float


class AsyncHFEngine(AsyncEngine):
    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0,
                 max_batch_size: int = 256, engine_id: int | str | None = None) -> None:
        self.engine = HFEngine(model_cfg, rollout_cfg, device=device, rank=rank)
        self.pad_token_id, self.eos_token_id = self.engine.pad_token_id, self.engine.eos_token_id
        self.max_batch_size, self.engine_id = max_batch_size, engine_id
        self.policy_version = 0
        self._queue: asyncio.Queue[_Request] | None = None
        self._loop_task: asyncio.Task | None = None
        self._idle = asyncio.Event()  # set while no generate call runs (weight updates wait for it)
        self._updating = False
        self._resume = asyncio.Event()
        self._running = 0
        self._update_started = 0.0

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        if sampling.n != 1:
            raise ValueError(f"one request samples one continuation (n=1), got n={sampling.n}")
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        self._ensure_loop()
        future = asyncio.get_running_loop().create_future()
        self._running += 1
        self._request_started()
        try:
            await self._queue.put(_Request(list(prompt_ids), sampling, future, time.perf_counter()))
            return await future
        finally:
            self._running -= 1
            self._request_finished()

    def num_running(self) -> int:
        return self._running

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            # A new event loop (asyncio.run again): asyncio primitives bind to the loop that first
            # waits on them, so the queue and both events are made anew with the batching loop.
            self._queue = asyncio.Queue()
            self._idle, self._resume = asyncio.Event(), asyncio.Event()
            self._idle.set()
            self._resume.set()
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())

    async def _batch_loop(self) -> None:
        while True:
            first = await self._queue.get()
            await self._resume.wait()  # no new call while weights are being swapped
            batch = [first]
            while not self._queue.empty() and len(batch) < self.max_batch_size:
                batch.append(self._queue.get_nowait())
            groups: dict[SamplingSettings, list[_Request]] = {}
            for request in batch:
                key = dataclasses.replace(request.sampling, max_new_tokens=1, seed=None)
                groups.setdefault(key, []).append(request)
            self._idle.clear()
            try:
                for group in groups.values():
                    await self._run_group(group)
            finally:
                self._idle.set()

    async def _run_group(self, group: list[_Request]) -> None:
        live = [r for r in group if not r.future.cancelled()]
        if not live:
            return
        width = max(len(r.prompt_ids) for r in live)
        ids = torch.full((len(live), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for row, r in enumerate(live):
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        settings = dataclasses.replace(live[0].sampling, max_new_tokens=max(r.sampling.max_new_tokens for r in live),
                                       seed=None)
        version, start = self.policy_version, time.perf_counter()
        try:
            gen = await asyncio.to_thread(self.engine.generate, ids, mask, positions, settings)
        except Exception as exc:  # every request of the call learns why
            for r in live:
                if not r.future.done():
                    r.future.set_exception(exc)
            return
        for row, r in enumerate(live):
            n = min(int(gen.lengths[row]), r.sampling.max_new_tokens)
            stopped = int(gen.lengths[row]) <= r.sampling.max_new_tokens and self._ends_with_stop(gen, row, n, r)
            top = None
            if gen.top_ids is not None:
                top = [list(zip(ids, lps)) for ids, lps in zip(gen.top_ids[row, :n].tolist(),
                                                                gen.top_log_probs[row, :n].tolist())]
            completion = Completion(
                token_ids=gen.responses[row, :n].tolist(), log_probs=gen.log_probs[row, :n].tolist(),
                finish_reason="stop" if stopped else "length", policy_versions=[version] * n,
                engine_id=self.engine_id, metrics={"engine/queue_s": start - r.queued_at}, top_logprobs=top)
            if not r.future.done():
                r.future.set_result(completion)

    def _ends_with_stop(self, gen, row: int, n: int, request: _Request) -> bool:
        """Whether the response ended on a stop token or string rather than at its budget."""
        if n == 0:
            return False
        if n < request.sampling.max_new_tokens:
            return True
        last = int(gen.responses[row, n - 1])
        if last in self.engine.stop_token_ids(request.sampling):
            return True
        # A stop string completed by the last budgeted token (one completed earlier would have ended
        # the row sooner, n < max_new_tokens): it stopped, as vLLM reports it. Same text HF checks.
        if request.sampling.stop:
            text = self.engine.tokenizer.decode(gen.responses[row, :n], skip_special_tokens=True)
            return any(s in text for s in request.sampling.stop)
        return False

    # ------------------------------------------------------------------ weights
    async def begin_update(self, version: int, in_flight: bool = False) -> None:
        self._ensure_loop()
        if self._updating:
            raise RuntimeError("begin_update while another weight update is in progress")
        self._updating, self._update_started = True, time.perf_counter()
        self._resume.clear()  # the batching loop starts no new call ...
        await self._idle.wait()  # ... and the one in flight finishes (HF cannot pause mid-call)
        self._pending_version = version

    async def load_bucket(self, bucket: WeightBucket) -> None:
        if not self._updating:
            raise RuntimeError("load_bucket outside begin_update / finish_update")
        self.engine.load_partial(bucket.tensors())

    async def finish_update(self) -> dict[str, float]:
        if not self._updating:
            raise RuntimeError("finish_update without begin_update")
        self.policy_version = self._pending_version
        self._updating = False
        self._resume.set()
        return {"engine/weight_update_s": time.perf_counter() - self._update_started,
                "engine/policy_version": float(self.policy_version)}

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
