"""Black-box chat agents: the ``ChatAgent`` contract, and the runner that plays their episodes.

Why: an env (``rlcore.agentic.env``) hands the framework the loop; an agent written against the
OpenAI client owns its loop (asks, parses tool calls, runs tools, asks again) and must not be
rewritten to be trained. So the framework gives it what a deployment would, an OpenAI endpoint,
and takes the trajectory from what the endpoint served (``rlcore.agentic.chat_proxy``)::

    class MyAgent(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result | float:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return float(reply.choices[0].message.content.strip() == ctx.label)

A fresh agent instance plays each episode. ``run`` may also be a plain ``def`` (a synchronous
client): it then runs in a thread of the runner's own pool (``sync_threads`` of them: as many as
episodes are in flight, not asyncio's default pool of ``cpu_count + 4``, which on a small machine
let only ~6 synchronous episodes run at once) while the endpoint serves it on the event loop; its
``episode_timeout_s`` counts from when its thread starts it, not from when it queued. Its return value
is the episode's reward (a number, or a ``Result`` with ``reward`` and scalar ``info``); every
segment of the episode gets it. An agent that raises, or outlives ``episode_timeout_s``, is an
``AgentError`` naming it and the session; one that never asked the model has nothing to train on,
and is an error too.

``ChatAgentRunner`` is the ``EpisodeRunner`` of agents: in a Ray actor (``start_runners(...,
runner_cls=ChatAgentRunner)``) it serves the proxy on the actor's event loop, next to the agents'
coroutines, and routes every session's requests to one engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import inspect
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import openai
from transformers import AutoTokenizer

from rlcore.agentic.async_router import AsyncSessionRouter
from rlcore.agentic.chat_proxy import ChatProxy, ChatProxyConfig, session_trajectories
from rlcore.agentic.drops import FinishedEpisodes
from rlcore.agentic.env import Result
from rlcore.agentic.episode import Trajectory
from rlcore.engines.async_base import AsyncEngine
from rlcore.engines.base import SamplingSettings
from rlcore.registry import load_named


class AgentError(RuntimeError):
    """An agent's episode failed: it raised, timed out, or never asked the model."""


@dataclasses.dataclass(frozen=True)
class ChatContext:
    """What an agent gets for one episode."""

    messages: list[dict[str, Any]]  # the task's conversation so far, OpenAI wire format
    tools: list[dict[str, Any]] | None  # the task's tools (OpenAI function schemas), if any
    prompt: str  # the last user message's text (for grading)
    label: Any  # the task's answer / ground truth
    task: Mapping[str, Any]  # the whole dataset row
    session_id: str
    base_url: str  # http://127.0.0.1:<port>/s/<session>/v1: for openai.AsyncOpenAI(base_url=...)
    api_key: str  # this session's key (opens no other session); Anthropic's client sends it as x-api-key
    session_url: str  # http://127.0.0.1:<port>/s/<session>: for anthropic.AsyncAnthropic(base_url=...)
    model_name: str
    sampling: Mapping[str, Any]  # the run's defaults: temperature, top_p, max_tokens (per turn)
    max_length: int  # prompt + all replies of a segment, in tokens
    # The runner's pooled HTTP client, for openai.AsyncOpenAI(..., http_client=ctx.http_client):
    # optional, but a client built without one sets up its own (TLS context included, ~40 ms of CPU).
    http_client: Any = None


class ChatAgent:
    """Subclass and implement ``run`` (async, or a plain def); see the module docstring."""

    async def run(self, ctx: ChatContext) -> Result | float:  # pragma: no cover - the user's
        raise NotImplementedError


def load_agent(path: str, kwargs: Mapping[str, Any] | None = None) -> type:
    """The agent class at ``file.py:Class`` or ``package.module:Class``; with ``kwargs``, also checks
    that its constructor takes them (``check_agent_kwargs``)."""
    cls = load_named(path, "agent")
    if cls is None or not callable(getattr(cls, "run", None)):
        raise ValueError(f"{path!r}: no class {path.rpartition(':')[2]!r} with a run(ctx) method in "
                         f"{path.rpartition(':')[0]}")
    if kwargs is not None:
        check_agent_kwargs(cls, kwargs, path)
    return cls


def check_agent_kwargs(cls: type, kwargs: Mapping[str, Any], path: str) -> None:
    """A ``TypeError`` naming ``agent.kwargs``, the keys and the class unless ``cls(**kwargs)`` binds:
    raised in the driver, before any engine starts, not in the first episode of a runner actor."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a C extension type): the first episode tells
        return
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        params = signature.parameters.values()
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [] if takes_any else sorted(set(kwargs) - names)
        missing = sorted(p.name for p in params if p.default is p.empty and p.name not in kwargs
                         and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        what = (f"has keys {unknown} that it does not take" if unknown
                else f"lacks its required argument(s) {missing}" if missing else f"does not bind ({exc})")
        raise TypeError(f"agent.kwargs {dict(kwargs)!r} {what}: the agent class {cls.__qualname__} "
                        f"({path}) is constructed as {cls.__qualname__}{signature}, once per episode. "
                        "agent.kwargs are passed to whichever agent agent.path names; set "
                        "agent.kwargs to that class's arguments ({} for none)") from None


@dataclasses.dataclass(frozen=True)
class ChatAgentSpec:
    """What a runner needs to play an agent's episodes: plain data, so it travels to runner actors."""

    agent: str  # "path/to/file.py:Class" (made absolute here) or "package.module:Class"
    tokenizer_path: str
    sampling: SamplingSettings  # per request; max_new_tokens is each reply's cap
    agent_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_total_tokens: int = 128
    episode_timeout_s: float = 300.0
    proxy: ChatProxyConfig = ChatProxyConfig()
    sync_threads: int = 64  # threads for synchronous agents (def run): the episodes a runner plays at once

    def __post_init__(self) -> None:
        where, _, name = self.agent.rpartition(":")
        if where.endswith(".py") and not os.path.isabs(where):  # runner actors need not share our cwd
            object.__setattr__(self, "agent", f"{os.path.abspath(where)}:{name}")
        load_agent(self.agent, self.agent_kwargs)  # a bad path or kwargs fail here, in the driver
        if self.sync_threads < 1:
            raise ValueError(f"sync_threads must be >= 1, got {self.sync_threads}")


def _freeze_heap() -> None:
    """Set the process's long-lived objects (modules, the tokenizer, the proxy) aside from the cyclic
    garbage collector. Why: every request allocates enough (the agent's client, HTTP, the session) to
    set off a full collection every few hundred requests, and a full collection walks the whole heap:
    ~540k objects with torch and transformers loaded, ~0.3 s, so ~1 ms a request on the toy model
    (``benchmarks/chat_proxy.py``). Frozen objects are only left out of those walks: nothing is freed
    that would have been, except cycles among them, which live as long as the runner anyway (the young
    generations are collected first; a full collection, ~0.3 s, would only catch older cyclic garbage)."""
    gc.collect(1)
    gc.freeze()


def _outcome(value: Any, agent: str, session_id: str) -> tuple[float, dict[str, float]]:
    if isinstance(value, Result):
        return float(value.reward), dict(value.info)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), {}
    raise AgentError(f"{agent} returned {type(value).__name__} for session {session_id}; "
                     "run(ctx) must return a number (the reward) or a Result")


class ChatAgentRunner:
    def __init__(self, spec: ChatAgentSpec, engines: Sequence[AsyncEngine], runner_id: int = 0,
                 max_retries: int = 2) -> None:
        self.spec, self.runner_id = spec, runner_id
        self.agent_cls = load_agent(spec.agent)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        self.router = AsyncSessionRouter(engines, max_retries=max_retries)
        self.proxy = ChatProxy(self.router, self.tokenizer, spec.sampling, spec.proxy)
        self._starting: asyncio.Lock | None = None
        self.http_client: Any = None  # made on the actor's loop, with the proxy
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None  # for synchronous agents, made on use
        self.episodes_done = 0
        self.finished = FinishedEpisodes()

    async def url(self) -> str:
        """The proxy's root URL, started on first use on the running loop (the actor's)."""
        if self.proxy.url is None:
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                if self.proxy.url is None:
                    await self.proxy.start()
                    self.http_client = openai.DefaultAsyncHttpxClient(timeout=self.spec.episode_timeout_s)
                    _freeze_heap()
        return self.proxy.url

    async def close(self) -> None:
        if self.proxy.url is not None:
            gc.unfreeze()  # what was set aside goes back to the collector (collected at exit, as usual)
        await self.proxy.stop()
        if self.http_client is not None:
            await self.http_client.aclose()
        if self.threads is not None:  # a synchronous agent still running past its timeout is not waited for
            self.threads.shutdown(wait=False, cancel_futures=True)

    async def _run_sync(self, agent: Any, ctx: ChatContext) -> Any:
        """``agent.run(ctx)`` in a thread of the runner's pool; the timeout counts from the thread's start."""
        if self.threads is None:
            self.threads = concurrent.futures.ThreadPoolExecutor(self.spec.sync_threads, "rlcore-agent")
        loop, started = asyncio.get_running_loop(), asyncio.Event()

        def run() -> Any:
            loop.call_soon_threadsafe(started.set)
            return agent.run(ctx)

        future = loop.run_in_executor(self.threads, run)
        try:
            await asyncio.wait_for(started.wait(), timeout=self.spec.episode_timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            raise AgentError(f"{self.spec.agent}: no thread was free to run it within {self.spec.episode_timeout_s:g}s "
                             f"(session {ctx.session_id}): all {self.spec.sync_threads} threads for synchronous "
                             "agents are busy (agent.sync_threads)") from None
        return await asyncio.wait_for(future, timeout=self.spec.episode_timeout_s)

    def _context(self, task: Mapping[str, Any], access) -> ChatContext:
        messages = task.get("messages")
        if messages is None:
            if not isinstance(task.get("prompt"), str):
                raise AgentError(f"a chat task needs 'messages' or a 'prompt' string, got keys {sorted(task)}")
            messages = [{"role": "user", "content": task["prompt"]}]
        messages = [dict(m) for m in messages]
        users = [m.get("content") for m in messages if m.get("role") == "user"]
        s = self.spec.sampling
        return ChatContext(
            messages=messages, tools=task.get("tools"), prompt=users[-1] if users and isinstance(users[-1], str) else "",
            label=task.get("answer", task.get("label")), task=dict(task), session_id=access.session_id,
            base_url=access.base_url, api_key=access.api_key, session_url=access.session_url,
            model_name=self.spec.proxy.model_name,
            sampling={"temperature": 0.0 if s.greedy else s.temperature, "top_p": s.top_p,
                      "max_tokens": s.max_new_tokens},
            max_length=self.spec.max_total_tokens, http_client=self.http_client)

    async def play(self, task: Mapping[str, Any], session_id: str, episode: Any = None) -> list[Trajectory]:
        """One episode of the agent on ``task``: its segments, each with the episode's reward."""
        await self.url()
        access = self.proxy.open_session(session_id, self.spec.max_total_tokens)
        agent, start = self.agent_cls(**dict(self.spec.agent_kwargs)), time.perf_counter()
        try:
            ctx = self._context(task, access)
            if inspect.iscoroutinefunction(agent.run):
                value = await asyncio.wait_for(agent.run(ctx), timeout=self.spec.episode_timeout_s)
            else:
                value = await self._run_sync(agent, ctx)
        except asyncio.TimeoutError:
            raise AgentError(f"{self.spec.agent} did not finish within {self.spec.episode_timeout_s:g}s "
                             f"(session {session_id})") from None
        except AgentError:
            raise
        except Exception as exc:
            raise AgentError(f"{self.spec.agent} raised {type(exc).__name__}: {exc} (session {session_id})") from exc
        finally:
            session = self.proxy.close_session(session_id)
        reward, info = _outcome(value, self.spec.agent, session_id)
        trajs = session_trajectories(session, reward, info, episode if episode is not None else session_id)
        if not trajs:
            raise AgentError(f"{self.spec.agent} finished session {session_id} without a reply from the model: "
                             "nothing to train on")
        for t in trajs:
            t.metrics["episode/agent_s"] = time.perf_counter() - start
        self.episodes_done += 1
        return trajs

    async def run_group(self, group_id: Any, task: Mapping[str, Any], size: int) -> list[Trajectory]:
        """The ``size`` episodes of one task, concurrently, each its own session; their segments."""
        tag = uuid.uuid4().hex[:6]
        episodes = await self.finished.gather(group_id, [
            self.play(task, f"r{self.runner_id}-g{group_id}-e{i}-{tag}", episode=f"{group_id}/{i}")
            for i in range(size)], lambda segments: segments[0].reward)
        return [t for segments in episodes for t in segments]

    async def finished_rewards(self, group_ids: Sequence[Any]) -> dict[Any, list[float]]:
        """The rewards of the finished episodes of groups still being played (or failed)."""
        return self.finished.pop(group_ids)

    def stats(self) -> dict[str, float]:
        return {"episodes_done": float(self.episodes_done), "retries": float(self.router.retries),
                "live_sessions": float(len(self.proxy.sessions))}
