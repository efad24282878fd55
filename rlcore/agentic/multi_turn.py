"""Multi-turn rollouts: the policy and an environment take turns, in token ids, batched.

Why one trajectory row per episode: the whole conversation (prompt, model turn, env reply, model
turn, ...) is one sequence the trainer scores with a single forward pass, so its layout is the
single-turn one (``rlcore.protocol``): ``prompts`` is the env's first observation, left-padded,
and ``responses`` is everything after it, right-padded. What differs is ``response_mask``: 1 only
on tokens the policy sampled, 0 on the env's tokens, so the loss, KL and entropy see exactly the
policy's own actions while the env's tokens still condition them (``attention_mask`` is 1 on both).

Why batched turn by turn: each turn is one engine call over the episodes still running, so a
batch of episodes costs about ``max_turns`` generate calls, not ``episodes * max_turns``.

Budget: an episode never exceeds ``max_total_tokens`` (prompt + all turns). A model turn gets at
most ``min(settings.max_new_tokens, tokens left)`` tokens and, like a response cut at
``max_new_tokens``, is still handed to the env. An env reply that would leave no room for another
model token ends the episode as truncated (the reply is not appended); so does ``max_turns``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from rlcore.agentic.env import Env, make_env
from rlcore.agentic.router import SessionRouter
from rlcore.data.dataset import collate_prompts
from rlcore.engines.base import Engine, Generation, SamplingSettings
from rlcore.protocol import DataProto

GenerateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SamplingSettings], Generation]


@dataclasses.dataclass
class _Episode:
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)  # everything after the prompt
    policy: list[int] = dataclasses.field(default_factory=list)  # 1 where the model sampled the token
    log_probs: list[float] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    engine: int = 0  # the router's engine that took its turns
    done: bool = False
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def extend(self, tokens: list[int], log_probs: list[float] | None) -> None:
        self.tokens += tokens
        self.policy += [int(log_probs is not None)] * len(tokens)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(tokens)


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
                 max_total_tokens: int, settings: SamplingSettings) -> None:
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

    def run(self, tasks: Sequence[Mapping[str, Any]], seeds: Sequence[int] | None = None) -> DataProto:
        """One episode per task (``env.reset(seed=seeds[i], **tasks[i])``; seeds default to 0..n-1)."""
        if not tasks:
            raise ValueError("MultiTurnRollout.run needs at least one task")
        seeds = list(range(len(tasks))) if seeds is None else list(seeds)
        if len(seeds) != len(tasks):
            raise ValueError(f"got {len(seeds)} seeds for {len(tasks)} tasks")
        envs = [self.env_factory() for _ in tasks]
        episodes = [_Episode(list(env.reset(seed=s, **t))) for env, s, t in zip(envs, seeds, tasks)]
        self._runs += 1
        sessions = [(id(self), self._runs, i) for i in range(len(episodes))]
        for i, ep in enumerate(episodes):
            if not 0 < len(ep.prompt) < self.max_total_tokens:
                raise ValueError(f"episode {i}: initial observation has {len(ep.prompt)} tokens; it needs 1 to "
                                 f"max_total_tokens - 1 = {self.max_total_tokens - 1}")
        gen_time = 0.0
        try:
            for _ in range(self.max_turns):
                alive = [i for i, ep in enumerate(episodes) if not (ep.done or ep.truncated)]
                if not alive:
                    break
                start = time.perf_counter()
                actions = self._generate_turn([episodes[i] for i in alive], [sessions[i] for i in alive])
                gen_time += time.perf_counter() - start
                for i, (tokens, log_probs) in zip(alive, actions):
                    self._take_turn(episodes[i], envs[i], tokens, log_probs)
        finally:
            live = self.router.sessions
            for session in sessions:  # over: the engines' load drops
                if session in live:
                    self.router.release(session)
        for ep in episodes:
            ep.truncated = ep.truncated or not ep.done  # ran out of max_turns
        return self._to_dataproto(episodes, gen_time)

    def _generate_turn(self, episodes: list[_Episode], sessions: list) -> list[tuple[list[int], list[float]]]:
        budgets = [min(self.settings.max_new_tokens, self.max_total_tokens - len(ep)) for ep in episodes]
        settings = dataclasses.replace(self.settings, max_new_tokens=max(budgets))
        turns = self.router.generate_batch(sessions, [ep.prompt + ep.tokens for ep in episodes], settings)
        out = []
        for row, (ep, turn, budget) in enumerate(zip(episodes, turns, budgets)):
            n = min(len(turn.token_ids), budget)
            if n < 1:
                raise RuntimeError(f"generate returned an empty turn (length {len(turn.token_ids)}) for row {row}")
            ep.engine = turn.engine
            out.append((turn.token_ids[:n], turn.log_probs[:n]))
        return out

    def _take_turn(self, ep: _Episode, env: Env, tokens: list[int], log_probs: list[float]) -> None:
        ep.extend(tokens, log_probs)
        ep.turns += 1
        observation, reward, done, _ = env.step(tokens)
        ep.reward += float(reward)
        if done:
            ep.done = True
        elif len(ep) + len(observation) >= self.max_total_tokens:
            ep.truncated = True
        else:
            ep.extend(list(observation), None)

    def _to_dataproto(self, episodes: list[_Episode], gen_time: float) -> DataProto:
        prompts, _ = collate_prompts([{"input_ids": torch.tensor(ep.prompt)} for ep in episodes], self.pad_token_id)
        t_r = max(len(ep.tokens) for ep in episodes)
        n = len(episodes)
        responses = torch.full((n, t_r), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, t_r), dtype=torch.long)
        response_mask = torch.zeros((n, t_r), dtype=torch.long)
        log_probs = torch.zeros((n, t_r), dtype=torch.float32)
        scores = torch.zeros((n, t_r), dtype=torch.float32)
        for row, ep in enumerate(episodes):
            k = len(ep.tokens)
            responses[row, :k] = torch.tensor(ep.tokens)
            attention[row, :k] = 1
            response_mask[row, :k] = torch.tensor(ep.policy)
            log_probs[row, :k] = torch.tensor(ep.log_probs)
            scores[row, max(j for j, p in enumerate(ep.policy) if p)] = ep.reward
        # Positions continue from the prompt's last one, padding included (it is masked anyway).
        positions = prompts["position_ids"][:, -1:] + 1 + torch.arange(t_r)
        greedy = self.settings.greedy
        return DataProto.from_dict(
            tensors={
                "prompts": prompts["input_ids"],
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": torch.cat([prompts["input_ids"], responses], 1),
                "attention_mask": torch.cat([prompts["attention_mask"], attention], 1),
                "position_ids": torch.cat([prompts["position_ids"], positions], 1),
                "rollout_log_probs": log_probs,
                "token_level_scores": scores,
            },
            non_tensors={
                "num_turns": np.array([ep.turns for ep in episodes], dtype=np.int64),
                "engine": np.array([ep.engine for ep in episodes], dtype=np.int64),
                "truncated": np.array([ep.truncated for ep in episodes], dtype=bool),
            },
            meta_info={
                # The temperature rollout_log_probs refer to, read by the actor's compute_log_prob.
                "temperature": 1.0 if greedy else self.settings.temperature,
                "rollout/gen_time_s": gen_time,
                "rollout/num_generated_tokens": int(response_mask.sum()),
            },
        )


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
