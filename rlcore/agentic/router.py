"""Several rollout engines behind one session-sticky router.

Why sticky: turn k+1 of an agentic session starts with the whole of turn k (prompt, answers,
tool results). An engine with prefix caching (vLLM's is on by default) still holds the KV blocks
of that prefix, so sending every turn of a session to the same engine skips recomputing it;
another engine would start from scratch. New sessions go to the engine with the fewest active
sessions ("least_loaded") or in turn ("round_robin"). When an engine is removed (it failed, or
is being drained) its sessions are re-homed at once; they lose their cache, not their place.

An engine is anything with a rollout backend's ``generate(input_ids, attention_mask,
position_ids, settings) -> Generation`` (``HFRollout``, ``VLLMRollout``). The HF backend keeps no
cache between calls, so with it stickiness only decides where work runs. Calls on one engine are
serialised (a backend is not safe to call from two threads at once); calls on different engines
may run concurrently from different threads.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from rlcore.workers.rollout.base import SamplingSettings

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
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError(f"session {session_id!r}: prompt_token_ids is empty")
        input_ids = torch.tensor([ids])
        mask = torch.ones_like(input_ids)
        positions = torch.arange(len(ids)).unsqueeze(0)
        while True:
            index = self.route(session_id)
            engine = self.engines.get(index)
            if engine is None:  # removed by another thread since route(); the session was re-homed
                continue
            try:
                with self._engine_locks[index]:
                    gen = engine.generate(input_ids, mask, positions, settings)
            except Exception as exc:
                if not self.failover:
                    raise
                with self._lock:
                    self.failures.append((index, repr(exc)))
                    if index in self.engines:
                        self._remove(index)
                    if not self.engines:
                        raise RuntimeError(f"every rollout engine failed; the last ({index}) with {exc!r}") from exc
                continue
            n = int(gen.lengths[0])
            return TurnOutput(gen.responses[0, :n].tolist(), gen.log_probs[0, :n].float().tolist(), index)
