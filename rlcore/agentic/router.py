"""Several rollout engines behind one session-sticky router.

Why sticky: turn k+1 of an agentic session starts with the whole of turn k (prompt, answers,
tool results). An engine with prefix caching (vLLM's is on by default) still holds the KV blocks
of that prefix, so sending every turn of a session to the same engine skips recomputing it;
another engine would start from scratch. New sessions go to the engine with the fewest active
sessions ("least_loaded") or in turn ("round_robin"). When an engine is removed (it failed, or
is being drained) its sessions are re-homed at once; they lose their cache, not their place.

``generate`` takes one turn of one session; ``generate_batch`` one turn of many (what
``MultiTurnRollout`` calls when handed a router): each engine continues its sessions as one batch,
the engines at the same time.

An engine is anything with a rollout backend's ``generate(input_ids, attention_mask,
position_ids, settings) -> Generation`` (``HFEngine``, ``VLLMEngine``). The HF backend keeps no
cache between calls, so with it stickiness only decides where work runs. Calls on one engine are
serialised (a backend is not safe to call from two threads at once); calls on different engines
may run concurrently from different threads.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from rlcore.data.dataset import collate_prompts
from rlcore.engines.base import SamplingSettings

POLICIES = ("least_loaded", "round_robin")


class TurnOutput(NamedTuple):
    token_ids: list[int]
    log_probs: list[float]
    engine: int  # which engine produced it


class SessionRouter:
    """Maps session ids to engine indices (positions in the ``engines`` list, stable across removals).

    ``failover=True``: an engine whose ``generate`` raises is removed (recorded in ``failures``)
    and the call is retried on the engine its session is re-homed to; with no engine left the
    last error is raised. ``failover=False`` raises at once and keeps the engine.
    """

    def __init__(self, engines: Sequence[Any], policy: str = "least_loaded", failover: bool = True) -> None:
        if not engines:
            raise ValueError("SessionRouter needs at least one engine")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {POLICIES}")
        for i, engine in enumerate(engines):
            if not callable(getattr(engine, "generate", None)):
                raise TypeError(f"engine {i} ({type(engine).__name__}) has no generate method")
        self.engines: dict[int, Any] = dict(enumerate(engines))
        self.policy, self.failover = policy, failover
        self.failures: list[tuple[int, str]] = []
        self._sessions: dict[Hashable, int] = {}
        self._load = {i: 0 for i in self.engines}
        self._engine_locks = {i: threading.Lock() for i in self.engines}
        self._cursor = 0  # round robin: the next engine index to try
        self._lock = threading.Lock()

    @property
    def sessions(self) -> dict[Hashable, int]:
        """Live sessions and their engines."""
        with self._lock:
            return dict(self._sessions)

    @property
    def load(self) -> dict[int, int]:
        """Active sessions per live engine."""
        with self._lock:
            return dict(self._load)

    def route(self, session_id: Hashable) -> int:
        """The session's engine; a new session is placed by the policy and stays there."""
        with self._lock:
            if session_id not in self._sessions:
                self._assign(session_id)
            return self._sessions[session_id]

    def release(self, session_id: Hashable) -> None:
        """The session is over: its engine's load drops (its cache is the engine's to evict)."""
        with self._lock:
            if session_id not in self._sessions:
                raise KeyError(f"unknown session {session_id!r}")
            self._load[self._sessions.pop(session_id)] -= 1

    def remove_engine(self, index: int) -> dict[Hashable, int]:
        """Take engine ``index`` out; returns its sessions' new engines (empty if none is left)."""
        with self._lock:
            return self._remove(index)

    def _remove(self, index: int) -> dict[Hashable, int]:
        if index not in self.engines:
            raise KeyError(f"engine {index} is not in the router (live: {sorted(self.engines)})")
        del self.engines[index], self._load[index]
        moved = [s for s, e in self._sessions.items() if e == index]
        for session_id in moved:
            del self._sessions[session_id]
        if not self.engines:
            return {}
        for session_id in moved:
            self._assign(session_id)
        return {s: self._sessions[s] for s in moved}

    def _assign(self, session_id: Hashable) -> None:
        live = sorted(self.engines)
        if not live:
            raise RuntimeError("no rollout engines left in the router")
        if self.policy == "least_loaded":
            index = min(live, key=lambda i: (self._load[i], i))
        else:
            index = next((i for i in live if i >= self._cursor), live[0])
            self._cursor = index + 1
        self._sessions[session_id] = index
        self._load[index] += 1

    def generate(self, session_id: Hashable, prompt_token_ids: Sequence[int], settings: SamplingSettings) -> TurnOutput:
        """One turn of ``session_id``: the engine's continuation of the full context ``prompt_token_ids``."""
        return self.generate_batch([session_id], [prompt_token_ids], settings)[0]

    def generate_batch(self, session_ids: Sequence[Hashable], contexts: Sequence[Sequence[int]],
                       settings: SamplingSettings) -> list[TurnOutput]:
        """One turn of several sessions, in their order. The sessions of one engine go to it as one
        left-padded batch; different engines work at the same time (a thread each). With failover,
        the sessions of an engine that raises are re-homed and their turn is run again there."""
        if len(session_ids) != len(contexts):
            raise ValueError(f"got {len(contexts)} contexts for {len(session_ids)} sessions")
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a session may take one turn per call; session_ids has duplicates")
        for session_id, ids in zip(session_ids, contexts):
            if not len(ids):
                raise ValueError(f"session {session_id!r}: prompt_token_ids is empty")
        results: list[TurnOutput | None] = [None] * len(contexts)
        pending = list(range(len(contexts)))
        while pending:
            groups: dict[int, list[int]] = {}
            for row in pending:
                groups.setdefault(self.route(session_ids[row]), []).append(row)
            calls = {index: [contexts[row] for row in rows] for index, rows in groups.items()}
            if len(calls) == 1:
                outcomes = {index: self._call(index, batch, settings) for index, batch in calls.items()}
            else:
                with ThreadPoolExecutor(len(calls)) as pool:
                    futures = {index: pool.submit(self._call, index, batch, settings) for index, batch in calls.items()}
                outcomes = {index: future.result() for index, future in futures.items()}
            pending = []
            for index, outcome in outcomes.items():
                if outcome is None:  # the engine was removed meanwhile: its sessions are re-homed
                    pending += groups[index]
                    continue
                if isinstance(outcome, Exception):
                    self._fail(index, outcome)
                    pending += groups[index]
                    continue
                for row, turn in zip(groups[index], outcome):
                    results[row] = turn
        return results  # type: ignore[return-value]

    def _call(self, index: int, contexts: list[Sequence[int]],
              settings: SamplingSettings) -> list[TurnOutput] | Exception | None:
        """Engine ``index`` continues ``contexts``; an engine's exception is returned, not raised;
        None if the engine was removed (by another thread) since the sessions were routed."""
        engine = self.engines.get(index)
        if engine is None:
            return None
        batch, _ = collate_prompts([{"input_ids": torch.tensor([int(t) for t in ids])} for ids in contexts],
                                   getattr(engine, "pad_token_id", 0) or 0)
        try:
            with self._engine_locks[index]:
                gen = engine.generate(batch["input_ids"], batch["attention_mask"], batch["position_ids"], settings)
        except Exception as exc:  # noqa: BLE001 - the caller fails over or re-raises it
            return exc
        if gen.responses.shape[0] != len(contexts):
            return RuntimeError(f"engine {index} returned {gen.responses.shape[0]} rows for {len(contexts)} contexts")
        lengths = [int(n) for n in gen.lengths]
        return [TurnOutput(gen.responses[row, :n].tolist(), gen.log_probs[row, :n].float().tolist(), index)
                for row, n in enumerate(lengths)]

    def _fail(self, index: int, exc: Exception) -> None:
        """Engine ``index`` raised ``exc``: re-raise it, or (failover) take the engine out."""
        if not self.failover:
            raise exc
        with self._lock:
            self.failures.append((index, repr(exc)))
            if index in self.engines:
                self._remove(index)
            if not self.engines:
                raise RuntimeError(f"every rollout engine failed; the last ({index}) with {exc!r}") from exc
