"""Turn-lockstep multi-turn rollouts: the policy and envs take turns, in token ids, batched per turn.

Each turn is one batched engine call over the episodes still running, then every env steps
(concurrently, ``asyncio.gather``), then the next turn. A batch of episodes costs about
``max_turns`` generate calls, and it fits engines that only batch synchronously (the rollout
worker's engine on its ranks, ``generate_episodes``). Its price: every turn waits for the slowest
env step of the batch, and the engine idles while the envs step. ``rlcore.agentic.runner`` plays
episodes as independent coroutines on continuously batching engines instead; this class stays as
the simple path and the baseline ``benchmarks/agentic.py`` measures that against.

Trajectories, budget and the layout are those of ``rlcore.agentic.episode`` (``play_episode``'s
rules, turn for turn); tokens carry policy version 0 (the engine's weights do not change during a
call), which ``meta_info[PER_CALL_VERSIONS]`` says: 0 is this call's weights, not a run's version. As there, the envs render their turns through the tokenizer's chat template as deltas, and
the rollout only appends ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlcore.agentic.env import Env, make_env
from rlcore.agentic.episode import Trajectory, continue_after, env_call, to_dataproto
from rlcore.agentic.router import SessionRouter
from rlcore.engines.async_base import Completion
from rlcore.engines.base import Engine, Generation, SamplingSettings
from rlcore.engines.layout import PER_CALL_VERSIONS
from rlcore.protocol import DataProto

GenerateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SamplingSettings], Generation]


class MultiTurnRollout:
    """Run episodes of ``env_factory()`` envs against a rollout engine.

    ``engine``: a generation engine (``HFEngine``, ``VLLMEngine``: anything with ``.generate``), a
    plain function with the same signature, ``(input_ids, attention_mask, position_ids,
    settings) -> Generation`` on left-padded contexts, or a ``SessionRouter`` over several
    engines: each episode is then a session whose every turn runs on one engine (prefix-cache
    reuse), the engines working on their episodes at the same time; the row's engine is in the
    ``engine`` column. ``settings.n`` must be 1: for several samples of one task, repeat the task.
    """

    def __init__(self, engine: Any, tokenizer, env_factory: Callable[[], Env], max_turns: int,
                 max_total_tokens: int, settings: SamplingSettings, step_timeout_s: float = 60.0) -> None:
        if not isinstance(engine, SessionRouter):
            generate = getattr(engine, "generate", engine)
            if not callable(generate):
                raise TypeError(f"engine must be a generation engine, a generate function or a SessionRouter, "
                                f"got {type(engine).__name__}")
        if max_turns < 1 or max_total_tokens < 2:
            raise ValueError(f"need max_turns >= 1 and max_total_tokens >= 2, got {max_turns}, {max_total_tokens}")
        if settings.n != 1:
            raise ValueError(f"MultiTurnRollout samples one episode per task (settings.n=1), got n={settings.n}")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if isinstance(engine, SessionRouter):
            self.router = engine
        else:  # one engine: a router of one, which fails as the engine does
            self.router = SessionRouter([_Engine(generate, self.pad_token_id)], failover=False)
        self._runs = 0
        self.env_factory, self.max_turns, self.max_total_tokens, self.settings = (
            env_factory, max_turns, max_total_tokens, settings)
        self.step_timeout_s = step_timeout_s

    def run(self, tasks: Sequence[Mapping[str, Any]], seeds: Sequence[int] | None = None) -> DataProto:
        """One episode per task (``env.reset({**tasks[i], "seed": seeds[i]})``; seeds default to 0..n-1)."""
        if not tasks:
            raise ValueError("MultiTurnRollout.run needs at least one task")
        seeds = list(range(len(tasks))) if seeds is None else list(seeds)
        if len(seeds) != len(tasks):
            raise ValueError(f"got {len(seeds)} seeds for {len(tasks)} tasks")
        self._runs += 1
        sessions = [(id(self), self._runs, i) for i in range(len(tasks))]
        try:
            trajectories, gen_time = asyncio.run(self._play(tasks, seeds, sessions))
        finally:
            live = self.router.sessions
            for session in sessions:  # over: the engines' load drops
                if session in live:
                    self.router.release(session)
        out = to_dataproto(trajectories, self.pad_token_id, 1.0 if self.settings.greedy else self.settings.temperature)
        out.meta_info.update({**self.settings.log_prob_meta(), PER_CALL_VERSIONS: True, "rollout/gen_time_s": gen_time,
                              "rollout/num_generated_tokens": int(out.batch["response_mask"].sum())})
        return out

    async def _play(self, tasks, seeds, sessions) -> tuple[list[Trajectory], float]:
        envs = [self.env_factory() for _ in tasks]
        observations = await asyncio.gather(*[
            env_call("reset", env.reset({**task, "seed": seed}), self.step_timeout_s, env, session, 0)
            for env, task, seed, session in zip(envs, tasks, seeds, sessions)])
        trajectories = [Trajectory(list(obs)) for obs in observations]
        for i, traj in enumerate(trajectories):
            if not 0 < len(traj.prompt_ids) < self.max_total_tokens:
                raise ValueError(f"episode {i}: initial observation has {len(traj.prompt_ids)} tokens; it needs 1 "
                                 f"to max_total_tokens - 1 = {self.max_total_tokens - 1}")
        live = list(range(len(trajectories)))
        gen_time = 0.0
        for turn in range(1, self.max_turns + 1):
            if not live:
                break
            start = time.perf_counter()
            self._generate_turn([trajectories[i] for i in live], [sessions[i] for i in live])
            gen_time += time.perf_counter() - start
            results = await asyncio.gather(*[
                env_call("step", envs[i].step(trajectories[i].last_action),
                         self.step_timeout_s, envs[i], sessions[i], turn) for i in live])
            live = [i for i, result in zip(live, results) if continue_after(trajectories[i], result,
                                                                           self.max_total_tokens)]
        for i in live:
            trajectories[i].truncated = True  # ran out of max_turns
        return trajectories, gen_time

    def _generate_turn(self, trajectories: list[Trajectory], sessions: list) -> None:
        budgets = [min(self.settings.max_new_tokens, self.max_total_tokens - len(t)) for t in trajectories]
        settings = dataclasses.replace(self.settings, max_new_tokens=max(budgets))
        turns = self.router.generate_batch(sessions, [t.context() for t in trajectories], settings)
        for row, (traj, turn, budget) in enumerate(zip(trajectories, turns, budgets)):
            n = min(len(turn.token_ids), budget)
            if n < 1:
                raise RuntimeError(f"generate returned an empty turn (length {len(turn.token_ids)}) for row {row}")
            traj.add_model_turn(Completion(turn.token_ids[:n], turn.log_probs[:n], "stop", [0] * n,
                                           engine_id=turn.engine))


class _Engine:
    """A generate function as a router engine (with the pad id its batches are padded with)."""

    def __init__(self, generate: GenerateFn, pad_token_id: int) -> None:
        self.generate, self.pad_token_id = generate, pad_token_id


@dataclasses.dataclass(frozen=True)
class EnvEpisodes:
    """The rollout worker's ``EpisodeRunner`` for registered envs: one ``MultiTurnRollout`` episode
    per task row on the rank's engine. Plain data, so the driver builds it and every rank gets a copy.

    Rows: non-tensor ``task`` (the ``env.reset`` keyword arguments, a dict) and optionally ``seed``;
    other non-tensor columns (e.g. ``uid``) are carried over. Output: the single-turn layout,
    ``response_mask`` 1 only on the policy's tokens, the episode's reward on its last model token
    (``token_level_scores``), ``num_turns``, ``truncated``.
    """

    env: str  # a registered env name
    env_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # its constructor arguments
    max_turns: int = 3
    max_total_tokens: int = 64

    def run(self, engine: Engine, tokenizer: Any, tasks: DataProto, settings: SamplingSettings) -> DataProto:
        columns = tasks.non_tensor_batch
        if "task" not in columns:
            raise KeyError("EnvEpisodes needs a non-tensor 'task' column (env.reset kwargs)")

        def env_factory() -> Env:
            return make_env(self.env, tokenizer, **dict(self.env_kwargs))

        rollout = MultiTurnRollout(engine, tokenizer, env_factory, self.max_turns, self.max_total_tokens, settings)
        seeds = [int(s) for s in columns["seed"]] if "seed" in columns else None
        out = rollout.run([dict(t) for t in columns["task"]], seeds=seeds)
        for key, values in columns.items():
            out.non_tensor_batch.setdefault(key, values)
        return out
