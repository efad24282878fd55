"""Engines as services: ``EngineServer`` holds one asynchronous engine in a Ray actor of its own
(its own CPUs or GPU, on any node), and ``RemoteEngine`` is the ``AsyncEngine`` interface over its
handle, so episode code runs unchanged against an engine in this process or in another one.

The server is an async Ray actor: every ``generate`` call is a coroutine on the actor's event
loop, so concurrent requests from many episode runners meet in the engine's own continuous
batching. ``generate_stream`` is a Ray streaming generator (``num_returns="streaming"``): each
chunk is an object the caller reads as soon as the engine yields it; a caller that stops
reading cancels the actor's generator (``ray.cancel``), which closes the engine's stream. Weight updates arrive as
``begin_update`` / one ``load_bucket`` per bucket (a Ray object each, so an engine holds one
bucket at a time) / ``finish_update``. Every call from a ``RemoteEngine`` has a timeout; an engine
process that died raises ``EngineDiedError`` naming it, which routers use to re-home sessions.

Ray is an optional dependency (the GPU check machine has none): without it this module still
imports, and starting or calling a server says that Ray is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Hashable, Iterable, Sequence
from typing import Any

import torch

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ImportError:  # optional dependency: only engine servers need it
    ray = None

    class GetTimeoutError(Exception):
        pass

    class RayActorError(Exception):
        pass

from rlcore.engines.async_base import AsyncEngine, Completion, TokenChunk
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.async_vllm import AsyncVLLMEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.weights import WeightBucket
from rlcore.models.config import ModelConfig


class EngineDiedError(RuntimeError):
    """The engine's process is gone (killed, crashed, out of memory): its requests will not return."""


def build_async_engine(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0,
                       engine_id: int | str | None = None) -> AsyncEngine:
    """The asynchronous engine ``rollout.backend`` names."""
    engine_cls = {"hf": AsyncHFEngine, "vllm": AsyncVLLMEngine}[rollout_cfg.backend]
    return engine_cls(model_cfg, rollout_cfg, device=device, rank=rank, engine_id=engine_id)


class EngineServer:
    """One asynchronous engine in this (Ray actor) process; see the module docstring."""

    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0,
                 engine_id: int | str | None = None, torch_threads: int | None = None) -> None:
        if torch_threads:
            torch._C.set_num_threads(torch_threads)  # the builtin: vLLM replaces torch.set_num_threads
        self.engine_id = rank if engine_id is None else engine_id
        self.engine = build_async_engine(model_cfg, rollout_cfg, device=device, rank=rank, engine_id=self.engine_id)
        self.started = time.perf_counter()

    def info(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "pad_token_id": self.engine.pad_token_id,
                "eos_token_id": self.engine.eos_token_id, "policy_version": self.engine.policy_version}

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        return await self.engine.generate(prompt_ids, sampling, session_id)

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                              session_id: Hashable | None = None) -> AsyncIterator[TokenChunk | Completion]:
        items = self.engine.generate_stream(prompt_ids, sampling, session_id)
        async with contextlib.aclosing(items):  # cancelled by the caller: the engine drops the request
            async for item in items:
                yield item

    async def begin_update(self, version: int, in_flight: bool = False) -> None:
        await self.engine.begin_update(version, in_flight)

    async def load_bucket(self, bucket: WeightBucket) -> None:
        await self.engine.load_bucket(bucket)

    async def finish_update(self) -> dict[str, float]:
        return await self.engine.finish_update()

    async def weight_checksums(self) -> dict[str, tuple[str, int, int]]:
        return await self.engine.weight_checksums()

    async def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any] | None:
        return await self.engine.probe_log_probs(ids)

    async def stats(self) -> dict[str, float]:
        return {"num_running": float(self.engine.num_running()), "policy_version": float(self.engine.policy_version),
                "busy_s": float(self.engine.busy_s), "wall_s": time.perf_counter() - self.started}

    async def close(self) -> None:
        await self.engine.close()


def start_engine_servers(count: int, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, *, num_cpus: float = 1.0,
                         num_gpus: float = 0.0, device: str = "cpu", spread: bool = True,
                         ready_timeout_s: float = 600.0) -> list["RemoteEngine"]:
    """``count`` engine servers, each a Ray actor with its own resources (spread over the nodes),
    ready to serve; a server that cannot start within ``ready_timeout_s`` is an error naming it."""
    _require_ray()
    actor_cls = ray.remote(EngineServer)
    handles = [
        actor_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=4096,
                          scheduling_strategy="SPREAD" if spread else "DEFAULT").remote(model_cfg, rollout_cfg, device, i, i, max(1, int(num_cpus)))
        for i in range(count)
    ]
    return [RemoteEngine(h, timeout_s=ready_timeout_s) for h in handles]


def stop_engine_servers(engines: Sequence["RemoteEngine"], timeout_s: float = 60.0) -> None:
    """Close every engine (vLLM's engine-core subprocess included), then end its actor."""
    _require_ray()
    try:
        ray.get([e.handle.close.remote() for e in engines], timeout=timeout_s)
    except (RayActorError, GetTimeoutError):
        pass  # a dead or hung engine is ended below all the same
    for engine in engines:
        ray.kill(engine.handle)


def push_buckets(engines: Sequence["RemoteEngine"], buckets: Iterable[WeightBucket], version: int,
                 in_flight: bool = False, timeout_s: float = 600.0) -> dict[str, float]:
    """One weight update of every engine server, bucket by bucket (synchronous; Ray calls). A bucket
    is put in Ray's object store once and every engine loads it from there; the next bucket is
    packed (``buckets`` is lazy) while the engines load the last, and at most one bucket is loading
    at a time, so an engine holds one bucket's worth of extra memory."""
    _require_ray()
    start = time.perf_counter()
    handles = [e.handle for e in engines]
    _wait([h.begin_update.remote(version, in_flight) for h in handles], "begin_update", engines, timeout_s)
    pending, nbytes, peak, count = [], 0, 0, 0
    for bucket in buckets:
        ref = ray.put(bucket)
        _wait(pending, "load_bucket", engines, timeout_s)
        pending = [h.load_bucket.remote(ref) for h in handles]
        nbytes, peak, count = nbytes + bucket.nbytes, max(peak, bucket.nbytes), count + 1
    _wait(pending, "load_bucket", engines, timeout_s)
    results = _wait([h.finish_update.remote() for h in handles], "finish_update", engines, timeout_s)
    for engine in engines:
        engine.policy_version = version
    return {"sync/push_s": time.perf_counter() - start, "sync/bytes": float(nbytes), "sync/buckets": float(count),
            "sync/peak_bucket_bytes": float(peak),
            "sync/engine_load_s_max": max(r.get("engine/weight_update_s", 0.0) for r in results)}


def engine_weight_checksums(engines: Sequence["RemoteEngine"], timeout_s: float = 600.0) -> list[dict]:
    """Every engine server's ``weight_checksums`` (the consistency check), one dict per engine."""
    _require_ray()
    return _wait([e.handle.weight_checksums.remote() for e in engines], "weight_checksums", engines, timeout_s)


def engine_probe_log_probs(engines: Sequence["RemoteEngine"], ids: Sequence[int], timeout_s: float = 600.0) -> list:
    """Every engine server's ``probe_log_probs`` (the consistency check's end-to-end probe), one per engine."""
    _require_ray()
    return _wait([e.handle.probe_log_probs.remote(list(ids)) for e in engines], "probe_log_probs", engines, timeout_s)


def engine_idle_metrics(engines: Sequence["RemoteEngine"], previous: dict | None = None) -> tuple[dict[str, float], dict]:
    """``engine/idle_frac``: the share of wall time since ``previous`` (the state this returned last
    time) in which the engines had no request at all, averaged over the engines."""
    _require_ray()
    stats = ray.get([e.handle.stats.remote() for e in engines], timeout=60)
    state = {i: (s["busy_s"], s["wall_s"]) for i, s in enumerate(stats)}
    fracs = []
    for i, (busy, wall) in state.items():
        busy0, wall0 = (previous or {}).get(i, (0.0, 0.0))
        if wall > wall0:
            fracs.append(1.0 - (busy - busy0) / (wall - wall0))
    return ({"engine/idle_frac": sum(fracs) / len(fracs)} if fracs else {}), state


async def _next_item(refs) -> Any:
    """The next object of a Ray streaming generator, fetched."""
    return await (await refs.__anext__())


def _require_ray() -> None:
    if ray is None:
        raise RuntimeError("engine servers run in Ray actors: install ray (pip install 'ray[default]')")


def _wait(refs: list, what: str, engines: Sequence["RemoteEngine"], timeout_s: float) -> list:
    try:
        return ray.get(refs, timeout=timeout_s)
    except RayActorError as exc:
        raise EngineDiedError(f"an engine died during {what} of a weight update: {exc}") from exc
    except GetTimeoutError:
        raise TimeoutError(f"{what} of a weight update did not finish within {timeout_s:g}s on engines "
                           f"{[e.engine_id for e in engines]}") from None


class RemoteEngine(AsyncEngine):
    """The ``AsyncEngine`` interface over an ``EngineServer`` handle (calls time out; death is named)."""

    def __init__(self, handle: Any, timeout_s: float = 600.0, request_timeout_s: float = 600.0) -> None:
        self.handle, self.request_timeout_s = handle, request_timeout_s
        try:
            info = ray.get(handle.info.remote(), timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError(f"engine server did not start within {timeout_s:g}s (not enough free CPUs/GPUs "
                               "for it, or its model is slow to load)") from None
        self.engine_id = info["engine_id"]
        self.pad_token_id, self.eos_token_id = info["pad_token_id"], info["eos_token_id"]
        self.policy_version = info["policy_version"]
        self._running = 0

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        try:
            return await asyncio.wait_for(getattr(self.handle, method).remote(*args),
                                          timeout=timeout_s or self.request_timeout_s)
        except RayActorError as exc:
            raise EngineDiedError(f"engine {self.engine_id} died during {method}: {exc}") from exc
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {self.engine_id}: {method} did not return within "
                               f"{timeout_s or self.request_timeout_s:g}s") from None

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        self._running += 1
        try:
            return await self._call("generate", list(prompt_ids), sampling, session_id)
        finally:
            self._running -= 1

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                              session_id: Hashable | None = None) -> AsyncIterator[TokenChunk | Completion]:
        """The server's stream, read as it comes; the whole request within ``request_timeout_s``."""
        self._running += 1
        refs = self.handle.generate_stream.options(num_returns="streaming").remote(list(prompt_ids), sampling,
                                                                                   session_id)
        deadline, finished = time.perf_counter() + self.request_timeout_s, False
        try:
            while not finished:
                remaining = max(deadline - time.perf_counter(), 0)
                try:
                    item = await asyncio.wait_for(_next_item(refs), timeout=remaining)
                except StopAsyncIteration:
                    raise RuntimeError(f"engine {self.engine_id}: the stream ended without a completion") from None
                finished = isinstance(item, Completion)
                yield item
        except RayActorError as exc:
            raise EngineDiedError(f"engine {self.engine_id} died during generate_stream: {exc}") from exc
        except asyncio.TimeoutError:
            raise TimeoutError(f"engine {self.engine_id}: generate_stream did not finish within "
                               f"{self.request_timeout_s:g}s") from None
        finally:
            if not finished:
                ray.cancel(refs)  # closes the server's generator, which cancels the engine's request
            self._running -= 1

    def num_running(self) -> int:
        return self._running

    async def begin_update(self, version: int, in_flight: bool = False) -> None:
        await self._call("begin_update", version, in_flight)

    async def load_bucket(self, bucket: WeightBucket) -> None:
        await self._call("load_bucket", bucket)

    async def finish_update(self) -> dict[str, float]:
        metrics = await self._call("finish_update")
        self.policy_version = int(metrics.get("engine/policy_version", self.policy_version))
        return metrics

    async def stats(self) -> dict[str, float]:
        return await self._call("stats")

    async def weight_checksums(self) -> dict[str, tuple[str, int, int]]:
        return await self._call("weight_checksums")

    async def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any] | None:
        return await self._call("probe_log_probs", list(ids))

    async def close(self) -> None:
        try:
            await self._call("close", timeout_s=30)
        except (EngineDiedError, TimeoutError):
            pass
        ray.kill(self.handle)
