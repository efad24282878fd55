"""``AsyncHFEngine``: an HF model behind the asynchronous interface, with token-level continuous batching.

Why not batch per ``generate`` call: requests that arrive while a call runs would wait for all of
it, and with episodes that spend half their time in an env the calls get small. Here one engine
thread runs a decode loop over a running batch (``rlcore.engines.kv_batch.KVBatch``): between two
decode steps it admits the requests that arrived (one left-padded prefill, merged into the batch's
KV cache), and a request that finishes leaves at once; nothing waits for a batch to fill or drain.

Sampling is HF's, row by row: rows whose settings match (temperature, top-k, top-p, greedy) are
sampled together through HF's own warpers (``hf_engine.sampling_warpers``), and every token's
log-prob is the ``log_softmax`` of the warped scores at that token (greedy: of the raw logits), as
``HFEngine`` records them. Stopping is ``HFEngine``'s: eos / stop ids, stop strings on the decoded
response, or the request's own ``max_new_tokens``; a stop completed by the last budgeted token is a
"stop". Greedy output equals HF ``generate`` on the prompt alone.

The engine thread talks to the event loops only through ``call_soon_threadsafe`` (results, one
callback per loop per step) and a condition variable (new requests, pauses), so requests may come
from any event loop, one after another (``asyncio.run`` again and again). A request whose caller
went away (cancelled, timed out, a closed stream) leaves the batch at the next step.

Prefix cache: a session's next turn extends its last request's ids (prompt, reply, the env's
text), so when a request finishes its KV is kept per session (``_PrefixCache``) and the next
request of that session prefills only its new tokens (``engine/cached_prompt_tokens`` says how
many it reused). Sticky routing sends a session's turns here; another engine starts from scratch.

Weight updates: ``begin_update`` parks the engine thread between two steps, after the requests in
flight finish (default: every response from one version) or at once (``in_flight``: requests keep
their place). ``load_bucket`` copies into the parameters while it is parked; ``finish_update``
stamps the new version and, after an in-flight swap, recomputes the running rows' KV cache with the
new weights before their next token (the tokens sampled before the swap stay, stamped with the old
version). Every wait has a timeout.

Seeds: ``sampling.seed`` is dropped; rows sample from the engine's own ``torch.Generator`` (seeded
with ``rollout.seed + rank``): which requests share a step depends on timing, so a per-request seed
would not make an asynchronous run repeatable.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.engines.async_base import AsyncEngine, Completion, TokenChunk
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine, sampling_warpers
from rlcore.engines.kv_batch import KVBatch, RowKV, use_gqa_sdpa
from rlcore.engines.weights import WeightBucket
from rlcore.models.config import ModelConfig

DEFAULT_MAX_BATCH = 256  # requests decoded at once when rollout.max_num_seqs is null


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    sampling: SamplingSettings
    session_id: Hashable | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future | None  # generate: the Completion
    chunks: asyncio.Queue | None  # generate_stream: TokenChunks, then the Completion
    queued_at: float
    cancelled: bool = False  # the caller went away: the engine thread drops it


class _PrefixCache:
    """Per session, the KV of its last finished request (prompt and reply): the session's next turn
    extends those ids, so only its new tokens need a forward. Least recently used out first, within
    ``max_bytes``; emptied by every weight update (old weights' KV)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.nbytes = max_bytes, 0
        self.entries: collections.OrderedDict[Hashable, tuple[list[int], RowKV]] = collections.OrderedDict()

    def put(self, session_id: Hashable, ids: list[int], kv: RowKV) -> None:
        self.pop(session_id)
        if kv.nbytes > self.max_bytes:
            return
        self.entries[session_id] = (ids, kv)
        self.nbytes += kv.nbytes
        while self.nbytes > self.max_bytes:
            _, (_, old) = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def pop(self, session_id: Hashable) -> tuple[list[int], RowKV] | None:
        entry = self.entries.pop(session_id, None)
        if entry is not None:
            self.nbytes -= entry[1].nbytes
        return entry

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


@dataclass(eq=False)
class _Row:
    """A request in the running batch, with what it has sampled so far."""

    request: _Request
    stop_ids: frozenset[int]
    key: SamplingSettings  # the sampling without budget and stops: rows with equal keys are sampled together
    admitted_at: float
    cached: int = 0  # prompt tokens whose KV came from the session's last request
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None
    sent: int = 0  # tokens already posted as chunks
    finish: str | None = None


class AsyncHFEngine(AsyncEngine):
    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0,
                 engine_id: int | str | None = None, max_prefill_tokens: int = 16384, request_timeout_s: float = 600.0,
                 update_timeout_s: float = 600.0) -> None:
        self.engine = HFEngine(model_cfg, rollout_cfg, device=device, rank=rank)
        self.pad_token_id, self.eos_token_id = self.engine.pad_token_id, self.engine.eos_token_id
        self.max_batch_size = rollout_cfg.max_num_seqs or DEFAULT_MAX_BATCH
        self.engine_id = engine_id
        self.max_prefill_tokens = max_prefill_tokens  # padded prompt tokens one admission may prefill
        self.request_timeout_s, self.update_timeout_s = request_timeout_s, update_timeout_s
        self.policy_version = 0
        use_gqa_sdpa(self.engine.model)  # this engine's own model: grouped KV heads without a copy per step
        self.batch = KVBatch(self.engine.model, self.pad_token_id)
        self.generator = torch.Generator(device=self.engine.device).manual_seed(rollout_cfg.seed + rank)
        self.rows: list[_Row] = []  # the engine thread's: same order as the batch's rows
        self.prefix_cache = _PrefixCache(rollout_cfg.prefix_cache_bytes)  # the engine thread's (and finish_update's, parked)
        self.peak_batch = 0  # the most rows decoded in one step
        self.steps = 0
        self._pending: collections.deque[_Request] = collections.deque()
        self._cond = threading.Condition()
        self._pause: str | None = None  # None | "drain" (wait for the rows) | "keep" (at once)
        self._parked = False
        self._recompute = False  # the rows' KV came from older weights
        self._closing = False
        self._thread: threading.Thread | None = None
        self._running = 0
        self._update: dict | None = None

    # ------------------------------------------------------------------ requests (event loop side)
    def _submit(self, prompt_ids: Sequence[int], sampling: SamplingSettings, session_id: Hashable | None,
                stream: bool) -> _Request:
        if sampling.n != 1:
            raise ValueError(f"one request samples one continuation (n=1), got n={sampling.n}")
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt token")
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), sampling, session_id, loop, None if stream else loop.create_future(),
                           asyncio.Queue() if stream else None, time.perf_counter())
        self._ensure_thread()
        with self._cond:
            self._pending.append(request)
            self._cond.notify_all()
        return request

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        request = self._submit(prompt_ids, sampling, session_id, stream=False)
        self._running += 1
        self._request_started()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                return await request.future
        except TimeoutError:
            raise TimeoutError(f"engine {self.engine_id}: a request did not finish within "
                               f"{self.request_timeout_s:g}s") from None
        finally:
            request.cancelled = True  # a no-op once finished; otherwise the thread drops it
            self._running -= 1
            self._request_finished()

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                              session_id: Hashable | None = None) -> AsyncIterator[TokenChunk | Completion]:
        request = self._submit(prompt_ids, sampling, session_id, stream=True)
        self._running += 1
        self._request_started()
        deadline = time.perf_counter() + self.request_timeout_s
        try:
            while True:
                try:
                    item = await asyncio.wait_for(request.chunks.get(), timeout=max(deadline - time.perf_counter(), 0))
                except asyncio.TimeoutError:
                    raise TimeoutError(f"engine {self.engine_id}: a request did not finish within "
                                       f"{self.request_timeout_s:g}s") from None
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Completion):
                    return
        finally:
            request.cancelled = True
            self._running -= 1
            self._request_finished()

    def num_running(self) -> int:
        return self._running

    # ------------------------------------------------------------------ the engine thread
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            if self._closing:
                raise RuntimeError(f"engine {self.engine_id} is closed")
            self._thread = threading.Thread(target=self._serve, name=f"async-hf-{self.engine_id}", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while True:
            with self._cond:
                admit = self._wait_for_work()
                if admit is None:
                    return
            posts: dict[asyncio.AbstractEventLoop, list] = collections.defaultdict(list)
            try:
                if self._recompute:
                    self._recompute_cache()
                if admit:
                    self._admit(admit)
                    self._retire(posts)
                if self.rows:
                    self._step()
                    self._retire(posts)
            except Exception as exc:  # every request of the batch learns why; the engine goes on
                for row in self.rows:
                    _fail(posts, row.request, exc)
                for request in admit:
                    _fail(posts, request, exc)
                self.rows = []
                self.batch.reset()
            _post(posts)

    def _wait_for_work(self) -> list[_Request] | None:
        """Under the lock: park while paused; the requests to admit now ([] to just step); None to exit."""
        while True:
            if self._closing:
                return None
            while self._pending and self._pending[0].cancelled:
                self._pending.popleft()
            if self._pause == "keep" or (self._pause == "drain" and not self.rows):
                if not self._parked:
                    self._parked = True
                    self._cond.notify_all()
                self._cond.wait(timeout=1.0)
                continue
            self._parked = False
            admit = self._take_pending() if self._pause is None else []
            if admit or self.rows:
                return admit
            self._cond.wait(timeout=1.0)

    def _take_pending(self) -> list[_Request]:
        taken, width = [], 0
        while self._pending and len(self.rows) + len(taken) < self.max_batch_size:
            request = self._pending[0]
            if request.cancelled:
                self._pending.popleft()
                continue
            width = max(width, len(request.prompt_ids))
            if taken and width * (len(taken) + 1) > self.max_prefill_tokens:
                break
            taken.append(self._pending.popleft())
        return taken

    def _admit(self, requests: list[_Request]) -> None:
        now = time.perf_counter()
        seqs, pasts, rows = [], [], []
        for r in requests:
            cached = self.prefix_cache.pop(r.session_id) if r.session_id is not None else None
            ids, kv = cached if cached is not None else ([], None)
            if kv is None or len(ids) >= len(r.prompt_ids) or r.prompt_ids[:len(ids)] != ids:
                ids, kv = [], None  # not an extension of the session's last request: from scratch
            seqs.append(r.prompt_ids[len(ids):])
            pasts.append(kv)
            rows.append(_Row(r, frozenset(self.engine.stop_token_ids(r.sampling)), _sampling_key(r.sampling), now,
                             cached=len(ids)))
        logits = self.batch.admit(seqs, pasts)
        self._sample(rows, logits)
        self.rows += rows

    def _step(self) -> None:
        tokens = torch.tensor([row.tokens[-1] for row in self.rows], dtype=torch.long)
        self.peak_batch = max(self.peak_batch, len(self.rows))
        self.steps += 1
        self._sample(self.rows, self.batch.step(tokens))

    def _recompute_cache(self) -> None:
        """New weights under running rows: their cache again, from their ids (all but the pending token)."""
        self._recompute = False
        rows, self.rows = self.rows, []
        self.batch.reset()
        if rows:
            self.batch.admit([row.request.prompt_ids + row.tokens[:-1] for row in rows])
            self.rows = rows

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        version = self.policy_version
        groups: dict[SamplingSettings, list[int]] = collections.defaultdict(list)
        for i, row in enumerate(rows):
            groups[row.key].append(i)
        for key, index in groups.items():
            sub = logits if len(index) == len(rows) else logits[torch.tensor(index)]
            tokens, log_probs, top = sample_next(sub, key, self.generator)
            top = None if top is None else [list(zip(i, v)) for i, v in zip(top[0].tolist(), top[1].tolist())]
            for j, (token, log_prob) in enumerate(zip(tokens.tolist(), log_probs.tolist())):
                row = rows[index[j]]
                row.tokens.append(token)
                row.log_probs.append(log_prob)
                row.versions.append(version)
                if top is not None:
                    row.top = (row.top or []) + [top[j]]
                row.finish = self._finish_reason(row)

    def _finish_reason(self, row: _Row) -> str | None:
        s = row.request.sampling
        if row.tokens[-1] in row.stop_ids:
            return "stop"
        if s.stop:  # the same text HFEngine checks: the response only, special tokens skipped
            text = self.engine.tokenizer.decode(row.tokens, skip_special_tokens=True)
            if any(stop in text for stop in s.stop):
                return "stop"
        return "length" if len(row.tokens) >= s.max_new_tokens else None

    def _retire(self, posts: dict) -> None:
        """Post the streaming rows' new tokens and the finished rows' completions; drop them from the batch."""
        keep = []
        for i, row in enumerate(self.rows):
            request = row.request
            if request.cancelled:
                continue
            if request.chunks is not None and len(row.tokens) > row.sent:
                posts[request.loop].append((request.chunks.put_nowait, _chunk(row)))
            if row.finish is None:
                keep.append(i)
                continue
            if request.session_id is not None and self.prefix_cache.max_bytes:
                self.prefix_cache.put(request.session_id, request.prompt_ids + row.tokens[:-1], self.batch.row_kv(i))
            completion = Completion(row.tokens, row.log_probs, row.finish, row.versions, engine_id=self.engine_id,
                                    metrics={"engine/queue_s": row.admitted_at - request.queued_at,
                                             "engine/cached_prompt_tokens": float(row.cached)},
                                    top_logprobs=row.top)
            if request.chunks is not None:
                posts[request.loop].append((request.chunks.put_nowait, completion))
            else:
                posts[request.loop].append((_resolve(request.future), completion))
        self.batch.keep(keep)
        self.rows = [self.rows[i] for i in keep]

    # ------------------------------------------------------------------ weights
    async def begin_update(self, version: int, in_flight: bool = False) -> None:
        if self._update is not None:
            raise RuntimeError("begin_update while another weight update is in progress")
        self._ensure_thread()
        self._update = {"version": version, "start": time.perf_counter(), "in_flight": in_flight}
        with self._cond:
            self._pause = "keep" if in_flight else "drain"
            self._cond.notify_all()
        if not await asyncio.to_thread(self._wait_parked, self.update_timeout_s):
            with self._cond:
                self._pause, self._update = None, None
                self._cond.notify_all()
            raise TimeoutError(f"engine {self.engine_id}: the requests in flight did not let a weight update "
                               f"in within {self.update_timeout_s:g}s")

    def _wait_parked(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._parked, timeout=timeout_s)

    async def load_bucket(self, bucket: WeightBucket) -> None:
        if self._update is None:
            raise RuntimeError("load_bucket outside begin_update / finish_update")
        self.engine.load_partial(bucket.tensors())  # the engine thread is parked

    async def finish_update(self) -> dict[str, float]:
        if self._update is None:
            raise RuntimeError("finish_update without begin_update")
        update, self._update = self._update, None
        with self._cond:
            self.policy_version = update["version"]
            self.prefix_cache.clear()  # KV of the old weights
            self._recompute = bool(self.rows)
            self._pause, self._parked = None, False  # a next begin_update waits for the thread to park again
            self._cond.notify_all()
        return {"engine/weight_update_s": time.perf_counter() - update["start"],
                "engine/policy_version": float(self.policy_version)}

    async def weight_checksums(self) -> dict[str, tuple[str, int, int]]:
        # read-only while the engine thread decodes; an update in progress would be a mix, refused
        if self._update is not None:
            raise RuntimeError("weight_checksums during a weight update")
        return await asyncio.to_thread(self.engine.weight_checksums)

    async def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any]:
        if self._update is not None:
            raise RuntimeError("probe_log_probs during a weight update")
        return await asyncio.to_thread(self.engine.probe_log_probs, ids)

    async def close(self) -> None:
        with self._cond:
            self._closing = True
            pending, self._pending = list(self._pending), collections.deque()
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        posts: dict = collections.defaultdict(list)
        for request in pending + [row.request for row in self.rows]:
            _fail(posts, request, RuntimeError(f"engine {self.engine_id} closed"))
        _post(posts)


def _sampling_key(s: SamplingSettings) -> SamplingSettings:
    return dataclasses.replace(s, max_new_tokens=1, seed=None, stop=(), stop_token_ids=(), ignore_eos=False)


def sample_next(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator):
    """(tokens, their log-probs, top (ids, log-probs) or None) of one step for rows of one setting:
    HF's warpers, then argmax (greedy) or a draw from the softmax, log-probs of the warped scores."""
    scores = logits.float()
    if not settings.greedy:
        for warper in sampling_warpers(settings):
            scores = warper(None, scores)
    log_probs = torch.log_softmax(scores, dim=-1)
    if settings.greedy:
        tokens = scores.argmax(dim=-1)
    else:
        tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
    top = None
    if settings.top_logprobs:
        values, ids = log_probs.topk(settings.top_logprobs, dim=-1)
        top = (ids, values)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(1), top


def _chunk(row: _Row) -> TokenChunk:
    start, row.sent = row.sent, len(row.tokens)
    return TokenChunk(row.tokens[start:], row.log_probs[start:], row.versions[start:],
                      None if row.top is None else row.top[start:])


def _resolve(future: asyncio.Future):
    def set_result(value) -> None:
        if not future.done():
            future.set_result(value)
    return set_result


def _fail(posts: dict, request: _Request, exc: BaseException) -> None:
    if request.chunks is not None:
        posts[request.loop].append((request.chunks.put_nowait, exc))
    else:
        def set_exception(_: object, future: asyncio.Future = request.future) -> None:
            if not future.done():
                future.set_exception(exc)
        posts[request.loop].append((set_exception, None))


def _post(posts: dict) -> None:
    """One callback per event loop for this step's results (a closed loop's requests are gone)."""
    for loop, calls in posts.items():
        def run(calls: list = calls) -> None:
            for fn, value in calls:
                fn(value)
        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:
            pass
