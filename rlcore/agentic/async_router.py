"""Session-sticky routing of asynchronous requests over several engines, with failover.

Every turn of an episode is a request of one session; all of a session's turns go to the engine
that took its first (its prefix cache holds the conversation so far). A new session goes to the
engine with the fewest live sessions (ties: the fewest requests running). When an engine dies
(``EngineDiedError``), it is taken out of the rotation, its sessions are re-homed on the next
``generate``, and the turn in flight is retried there from the same context ids: a retried turn is
token-exact, it only loses the dead engine's cache. The run goes on with the engines left; when
none is left, the error says so. ``generate_stream`` routes the same way; a stream is retried
elsewhere only if its engine died before sending anything (tokens a client has seen are not
taken back), and closing it closes the engine's stream (which cancels the request).

Engines here are ``AsyncEngine``s: in this process, or ``RemoteEngine``s over engine servers in
Ray actors of their own. (These engines are not HTTP servers, so vllm-router, which fronts HTTP
engines, has nothing to front here; Ray carries the calls.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Hashable, Sequence

from rlcore.engines.async_base import AsyncEngine, Completion, TokenChunk
from rlcore.engines.base import SamplingSettings
from rlcore.engines.server import EngineDiedError


class AsyncSessionRouter:
    def __init__(self, engines: Sequence[AsyncEngine], max_retries: int = 2) -> None:
        if not engines:
            raise ValueError("AsyncSessionRouter needs at least one engine")
        self.engines = list(engines)
        self.alive = [True] * len(self.engines)
        self.max_retries = max_retries
        self.sessions: dict[Hashable, int] = {}  # session -> engine index
        self.live_sessions = [0] * len(self.engines)  # per engine: its sessions in self.sessions
        self.retries = 0  # turns retried on another engine after theirs died

    @property
    def pad_token_id(self) -> int:
        return self.engines[0].pad_token_id

    def _load(self, index: int) -> tuple[int, int]:
        return self.live_sessions[index], self.engines[index].num_running()

    def engine_for(self, session_id: Hashable) -> int:
        """The session's engine; a new (or re-homed) session goes to the least-loaded live engine."""
        index = self.sessions.get(session_id)
        if index is None or not self.alive[index]:
            live = [i for i, ok in enumerate(self.alive) if ok]
            if not live:
                raise EngineDiedError(f"all {len(self.engines)} engines died; nothing left to route to")
            if session_id in self.sessions:  # re-homed: it leaves its dead engine's count
                self.live_sessions[self.sessions[session_id]] -= 1
            index = live[0] if len(live) == 1 else min(live, key=self._load)
            self.sessions[session_id] = index
            self.live_sessions[index] += 1
        return index

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion:
        for attempt in range(self.max_retries + 1):
            index = self.engine_for(session_id)
            try:
                completion = await self.engines[index].generate(prompt_ids, sampling, session_id)
            except EngineDiedError:
                self.alive[index] = False
                if attempt == self.max_retries or not any(self.alive):
                    raise
                self.retries += 1
                continue
            completion.engine_id = index
            return completion
        raise AssertionError("unreachable")

    async def generate_stream(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                              session_id: Hashable | None = None) -> AsyncIterator[TokenChunk | Completion]:
        for attempt in range(self.max_retries + 1):
            index, sent = self.engine_for(session_id), False
            try:
                items = self.engines[index].generate_stream(prompt_ids, sampling, session_id)
                async with contextlib.aclosing(items):
                    async for item in items:
                        if isinstance(item, Completion):
                            item.engine_id = index
                        sent = True
                        yield item
                return
            except EngineDiedError:
                self.alive[index] = False
                if sent or attempt == self.max_retries or not any(self.alive):
                    raise
                self.retries += 1
        raise AssertionError("unreachable")

    def release(self, session_id: Hashable) -> None:
        """The session is over: it no longer counts towards its engine's load."""
        index = self.sessions.pop(session_id, None)
        if index is not None:
            self.live_sessions[index] -= 1
