"""Episode runners: actors that play many episodes at once, each a coroutine, against shared engines.

A runner holds no model. It builds a fresh env per episode (a registered name or an import path,
``EpisodeSpec.env``), routes each episode's turns through its ``AsyncSessionRouter`` (every turn of
an episode on one engine), and runs all of them on one event loop: while one episode waits on its
env, the others' requests keep the engines busy. ``run_group`` plays the ``size`` episodes of one
task (a GRPO group) and returns their trajectories when all have finished.

Runners live in Ray actors of their own (``start_runners``: a pool spread over the nodes, apart
from the engines); ``EpisodeRunner`` is the same class in this process for notebooks and tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from transformers import AutoTokenizer

from rlcore.agentic.async_router import AsyncSessionRouter
from rlcore.agentic.drops import FinishedEpisodes
from rlcore.agentic.env import make_env
from rlcore.agentic.episode import Trajectory, play_episode
from rlcore.engines.async_base import AsyncEngine
from rlcore.engines.base import Generation, RolloutConfig, SamplingSettings
from rlcore.engines.layout import build_output
from rlcore.protocol import DataProto


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """What a runner needs to play episodes: plain data, so it travels to runner actors as it is."""

    env: str  # a registered env name, or "package.module:Class"
    tokenizer_path: str  # the policy's tokenizer directory (envs encode their text with it)
    sampling: SamplingSettings  # per turn; max_new_tokens is each turn's cap
    env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int = 3
    max_total_tokens: int = 64
    step_timeout_s: float = 60.0  # an env reset/step that takes longer is an EnvError


class EpisodeRunner:
    def __init__(self, spec: EpisodeSpec, engines: Sequence[AsyncEngine], runner_id: int = 0,
                 max_retries: int = 2) -> None:
        self.spec, self.runner_id = spec, runner_id
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        self.router = AsyncSessionRouter(engines, max_retries=max_retries)
        self.episodes_done = 0
        self.finished = FinishedEpisodes()

    async def play(self, task: Mapping[str, Any], session_id: Any) -> Trajectory:
        """One episode of ``task`` (its ``seed`` key, if any, seeds the env) as session ``session_id``."""
        env = make_env(self.spec.env, self.tokenizer, **dict(self.spec.env_kwargs))
        try:
            traj = await play_episode(env, self.router, task, self.spec.sampling, max_turns=self.spec.max_turns,
                                      max_total_tokens=self.spec.max_total_tokens, session_id=session_id,
                                      step_timeout_s=self.spec.step_timeout_s)
        finally:
            self.router.release(session_id)
        self.episodes_done += 1
        return traj

    async def run_group(self, group_id: Any, task: Mapping[str, Any], size: int) -> list[Trajectory]:
        """The ``size`` episodes of one task, concurrently; each gets its own session and env seed."""
        start = time.perf_counter()
        base_seed = int(task.get("seed", 0)) if isinstance(task.get("seed", 0), int) else 0
        trajs = await self.finished.gather(group_id, [
            self.play({**task, "seed": base_seed * size + i}, (self.runner_id, group_id, i)) for i in range(size)],
            lambda t: t.reward)
        for t in trajs:
            t.metrics["episode/group_s"] = time.perf_counter() - start
        return trajs

    async def finished_rewards(self, group_ids: Sequence[Any]) -> dict[Any, list[float]]:
        """The rewards of the finished episodes of groups still being played (or failed): what the pool
        reports of a group it drops."""
        return self.finished.pop(group_ids)

    def stats(self) -> dict[str, float]:
        return {"episodes_done": float(self.episodes_done), "retries": float(self.router.retries),
                "live_sessions": float(len(self.router.sessions))}


def generate_prompts(engines: Sequence[AsyncEngine], prompts: DataProto, rollout_cfg: RolloutConfig) -> DataProto:
    """One completion per prompt row (left-padded ``input_ids``/``attention_mask``/``position_ids``),
    spread over ``engines``, in the rollout layout: what greedy validation needs from engine
    servers. Sampling: ``rollout_cfg`` with ``prompts.meta_info`` overrides (``validate=True``: greedy)."""
    settings = SamplingSettings.resolve(rollout_cfg, {**prompts.meta_info, "n": 1})
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    rows = [row[keep].tolist() for row, keep in zip(ids, mask)]

    async def run() -> list:
        return await asyncio.gather(*[engines[i % len(engines)].generate(r, settings) for i, r in enumerate(rows)])

    start = time.perf_counter()
    completions = asyncio.run(run())
    width = settings.max_new_tokens
    responses = torch.full((len(rows), width), engines[0].pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, c in enumerate(completions):
        responses[i, :len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        log_probs[i, :len(c.token_ids)] = torch.tensor(c.log_probs, dtype=torch.float32)
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    out = build_output(prompts.select(batch_keys=["input_ids", "attention_mask", "position_ids"]),
                       Generation(responses, lengths, log_probs), engines[0].pad_token_id, time.perf_counter() - start)
    out.meta_info.update(settings.log_prob_meta())  # what the log-probs refer to (the actor reads it)
    return out


def stop_runners(runners: Sequence[Any]) -> None:
    for runner in runners:
        ray.kill(runner)


def start_runners(count: int, spec: Any, engines: Sequence[AsyncEngine], num_cpus: float = 0.5,
                  max_concurrency: int = 4096, runner_cls: type = EpisodeRunner) -> list[Any]:
    """``count`` runner actors spread over the nodes (``SPREAD``), each routing over all ``engines``:
    ``EpisodeRunner``s of an ``EpisodeSpec`` or, with ``runner_cls``, e.g. ``ChatAgentRunner``s of a
    ``ChatAgentSpec``."""
    actor_cls = ray.remote(runner_cls)
    return [actor_cls.options(num_cpus=num_cpus, max_concurrency=max_concurrency, scheduling_strategy="SPREAD")
            .remote(spec, list(engines), i) for i in range(count)]
