"""The asynchronous engine interface: one request at a time from the caller's side, continuously
batched on the engine's side, every token stamped with the weights version that sampled it.

Why a second interface beside ``Engine``: a synchronous ``generate`` over a batch is the right
shape for a turn-lockstep rollout, but an agent's episodes are independent coroutines, each
waiting on its own env between turns. They must be able to ask for one continuation whenever
they are ready, and the engine must batch whatever requests are pending at that moment
(continuous batching), never waiting for a batch to fill or to drain.

Contract:

    completion = await engine.generate(prompt_ids, sampling, session_id)
    completion.token_ids, completion.log_probs       # the sampled ids and their sampler log-probs
    completion.finish_reason                         # "stop" | "length" | "abort"
    completion.policy_versions                       # per token: the version that produced it

    async for item in engine.generate_stream(prompt_ids, sampling, session_id):
        ...  # TokenChunks as the engine samples them, then the final Completion (the same as generate's)

    await engine.update_weights(buckets, version)    # new weights, streamed in buckets:
    #   = begin_update(version, in_flight); load_bucket(b) for each bucket; finish_update()
    engine.policy_version                            # the version now loaded

``update_weights`` has two modes. By default it waits until the requests in flight finish (new
ones wait), swaps the weights, and resumes: every response then comes from one version, though
an episode's later turns may come from a newer one. With ``in_flight=True`` (partial rollouts) it
pauses between engine steps, requests keeping their place, loads the new version, and resumes:
one response may then span two versions, and ``policy_versions`` says which token came from
which, so the loss can correct (or mask) each token by its own staleness.

Streaming: ``generate_stream`` yields the tokens while the request runs (a chat client's first
token need not wait for the whole turn), then the Completion, which alone is the record: its ids,
log-probs and versions are exactly the chunks' concatenated (the trajectory is built from it, never
from the chunks). Closing the iterator early (a client that hung up) cancels the request. The
default here yields the Completion alone, for engines that cannot stream.

Implementations: ``AsyncHFEngine`` (token-level continuous batching over an HF model) and
``AsyncVLLMEngine`` (vLLM's ``AsyncLLM``); ``EngineServer`` serves either from a Ray actor of its
own, and ``RemoteEngine`` is the same interface over such a server's handle.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlcore.engines.base import SamplingSettings
from rlcore.engines.weights import WeightBucket

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    log_probs: list[float]  # the sampler's log-prob of each token (under the distribution it sampled from)
    finish_reason: str  # "stop": eos / a stop token or string; "length": max_new_tokens; "abort": cancelled
    policy_versions: list[int]  # per token: the weights version that sampled it
    engine_id: int | str | None = None  # which engine served it (set by routers and servers)
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. queue time of the request
    # per token, when asked (sampling.top_logprobs = k): the k most likely (token id, log-prob) of its step
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.log_probs) == len(self.policy_versions):
            raise ValueError(f"a completion needs one log-prob and one version per token: {len(self.token_ids)} "
                             f"tokens, {len(self.log_probs)} log-probs, {len(self.policy_versions)} versions")
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.token_ids):
            raise ValueError(f"top_logprobs needs one entry per token: {len(self.top_logprobs)} for "
                             f"{len(self.token_ids)} tokens")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@dataclass
class TokenChunk:
    """Tokens of a running request, as the engine sampled them (see ``generate_stream``)."""

    token_ids: list[int]
    log_probs: list[float]
    policy_versions: list[int]  # HF: exact; vLLM: the engine's version when the chunk arrived (exact in the Completion)
    top_logprobs: list[list[tuple[int, float]]] | None = None


class AsyncEngine(ABC):
    """One copy of the policy weights serving concurrent requests (see the module docstring)."""

    pad_token_id: int
    eos_token_id: int
    policy_version: int = 0
    _active = 0  # requests in flight, for busy_s
    _busy_since = 0.0
    _busy_total = 0.0

    def _request_started(self) -> None:
        if self._active == 0:
            self._busy_since = time.perf_counter()
        self._active += 1

    def _request_finished(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy_total += time.perf_counter() - self._busy_since

    @property
    def busy_s(self) -> float:
        """Seconds during which at least one request was in flight: wall time minus this is idle time."""
        now = time.perf_counter() - self._busy_since if self._active else 0.0
        return self._busy_total + now

    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        """One continuation of ``prompt_ids`` (``sampling.n`` must be 1; for n samples, n requests)."""

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                              session_id: Hashable | None = None) -> AsyncIterator[TokenChunk | Completion]:
        """``TokenChunk``s as they are sampled, then the final ``Completion`` (the last item)."""
        yield await self.generate(prompt_ids, sampling, session_id)

    @abstractmethod
    async def begin_update(self, version: int, in_flight: bool = False) -> None:
        """Stop generating for a weight swap: after the requests in flight finish (default), or
        between engine steps with the requests kept in place (``in_flight``)."""

    @abstractmethod
    async def load_bucket(self, bucket: WeightBucket) -> None:
        """Load the tensors of one bucket (HF parameter names) into the engine's weights."""

    @abstractmethod
    async def finish_update(self) -> dict[str, float]:
        """Make the loaded weights ``version`` and resume generating; returns timing metrics."""

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int,
                             in_flight: bool = False) -> dict[str, float]:
        """The whole swap in one call: ``begin_update``, every bucket, ``finish_update``. A bucket that
        fails to load leaves the engine paused (its weights are a mix): the error propagates."""
        await self.begin_update(version, in_flight)
        for bucket in buckets:
            await self.load_bucket(bucket)
        return await self.finish_update()

    @abstractmethod
    def num_running(self) -> int:
        """Requests admitted and not finished: the engine's load, for routing."""

    async def weight_checksums(self) -> dict[str, tuple[str, int, int]] | None:
        """As ``Engine.weight_checksums``: the weights this engine samples with, for the consistency
        check; None where it cannot report them."""
        return None

    async def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any] | None:
        """As ``Engine.probe_log_probs``: the consistency check's end-to-end probe; None where it cannot."""
        return None

    async def close(self) -> None:
        """Release the engine (its processes, its memory)."""
