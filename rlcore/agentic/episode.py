"""One episode as a coroutine: generate -> env.step -> generate ..., token ids end to end.

Why a coroutine per episode: an env's step may take a while (a tool call, a sandbox, a web
request). Played turn-lockstep, every episode of a batch waits for the slowest env of each turn;
played as independent coroutines on a continuously batching engine, one episode's env latency
overlaps the others' generation, and the engine always has whatever requests are ready.

The ``Trajectory`` is one row of the trainer's layout (``rlcore.engines.layout``): ``prompt_ids`` is
the env's first observation, ``token_ids`` everything after it; ``policy_mask`` is 1 only on the
tokens the policy sampled (env tokens condition the policy but are not trained on), each with its
sampler log-prob and the policy version that produced it (-1 on env tokens). Rewards are summed
over turns and placed on the last model token.

Chat formats: the episode only appends ids. The env renders its first prompt and each reply
through the tokenizer's chat template as deltas (``Env.render_prompt`` / ``Env.render_turn``), so a
real chat model gets its own format while the ids of earlier turns, and the model's sampled ids,
stay exactly as they were (``tests/agentic/test_chat_template_turns.py``).

Budget: an episode never exceeds ``max_total_tokens`` (prompt + all turns). A model turn gets at
most ``min(sampling.max_new_tokens, tokens left)`` tokens and, like a response cut at
``max_new_tokens``, is still handed to the env. An env reply that would leave no room for another
model token ends the episode as truncated (the reply is not appended); so does ``max_turns``.
Every env call has a timeout (``step_timeout_s``): a hung env is an ``EnvError`` naming the env,
the session and the turn, never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from rlcore.agentic.env import Env, LatencyEnv, Result
from rlcore.data.dataset import collate_prompts
from rlcore.engines.async_base import Completion
from rlcore.engines.base import SamplingSettings
from rlcore.protocol import DataProto

ENV_TOKEN_VERSION = -1  # the "version" of tokens the env wrote (and of padding)


class EnvError(RuntimeError):
    """An env's reset or step raised or did not return in time."""


class Generator(Protocol):
    """What an episode needs of an engine (an ``AsyncEngine``, a ``RemoteEngine``, a router)."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingSettings,
                       session_id: Hashable | None = None) -> Completion: ...


@dataclasses.dataclass
class Trajectory:
    prompt_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)  # everything after the prompt
    policy_mask: list[int] = dataclasses.field(default_factory=list)  # 1 where the policy sampled the token
    log_probs: list[float] = dataclasses.field(default_factory=list)  # the sampler's; 0 on env tokens
    versions: list[int] = dataclasses.field(default_factory=list)  # policy version per token; -1 on env tokens
    reward: float = 0.0  # summed over turns
    turns: int = 0
    terminated: bool = False
    truncated: bool = False
    engine_id: Any = None  # the engine that took its last turn
    info: dict[str, float] = dataclasses.field(default_factory=dict)  # the env's scalars, last value of each
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # time spent generating / in the env
    last_action: list[int] = dataclasses.field(default_factory=list)  # the model's latest turn
    episode_id: Any = None  # set when one episode yields several trajectories (a chat agent's segments)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_model_turn(self, completion: Completion) -> None:
        self.token_ids += completion.token_ids
        self.policy_mask += [1] * len(completion.token_ids)
        self.log_probs += completion.log_probs
        self.versions += completion.policy_versions
        self.engine_id = completion.engine_id
        self.last_action = list(completion.token_ids)
        self.turns += 1

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self.token_ids += list(token_ids)
        self.policy_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)
        self.versions += [ENV_TOKEN_VERSION] * len(token_ids)

    def add_result(self, result: Result) -> None:
        self.reward += float(result.reward)
        self.info.update(result.info)
        self.terminated = self.terminated or result.terminated
        self.truncated = self.truncated or result.truncated

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the model's tokens (-1 if it has none)."""
        own = [v for v, m in zip(self.versions, self.policy_mask) if m]
        return min(own) if own else ENV_TOKEN_VERSION


def env_name(env: Env) -> str:
    """The env's class name for messages: the configured env's, not that of the latency wrapper around it."""
    return type(env.env if isinstance(env, LatencyEnv) else env).__name__


async def env_call(what: str, coro, timeout_s: float, env: Env, session_id: Hashable, turn: int):
    """``await coro`` within ``timeout_s``; a timeout or an exception becomes an ``EnvError`` naming it."""
    try:
        async with asyncio.timeout(timeout_s):  # in this task: wait_for would start one per call
            return await coro
    except TimeoutError:
        raise EnvError(f"{env_name(env)}.{what} did not return within {timeout_s:g}s "
                       f"(session {session_id!r}, turn {turn})") from None
    except EnvError:
        raise
    except Exception as exc:
        raise EnvError(f"{env_name(env)}.{what} raised {type(exc).__name__}: {exc} "
                       f"(session {session_id!r}, turn {turn})") from exc


def continue_after(traj: Trajectory, result: Result, max_total_tokens: int) -> bool:
    """Fold one env step into the trajectory; whether the episode goes on (its observation appended)."""
    traj.add_result(result)
    if result.terminated or result.truncated:
        return False
    if len(traj) + len(result.observation) >= max_total_tokens:
        traj.truncated = True  # no room for the reply and another model token
        return False
    traj.add_observation(result.observation)
    return True


async def play_episode(env: Env, engine: Generator, task: Mapping[str, Any], sampling: SamplingSettings, *,
                       max_turns: int, max_total_tokens: int, session_id: Hashable,
                       step_timeout_s: float = 60.0) -> Trajectory:
    """Play one episode of ``env`` on ``engine`` (see the module docstring); ``sampling.n`` must be 1."""
    if sampling.n != 1:
        raise ValueError(f"an episode samples one continuation per turn (sampling.n=1), got n={sampling.n}")
    if max_turns < 1 or max_total_tokens < 2:
        raise ValueError(f"need max_turns >= 1 and max_total_tokens >= 2, got {max_turns}, {max_total_tokens}")
    observation = await env_call("reset", env.reset(task), step_timeout_s, env, session_id, 0)
    traj = Trajectory(list(observation))
    if not 0 < len(traj.prompt_ids) < max_total_tokens:
        raise EnvError(f"{env_name(env)}.reset gave {len(traj.prompt_ids)} tokens (session {session_id!r}); "
                       f"an episode needs 1 to max_total_tokens - 1 = {max_total_tokens - 1}")
    gen_s = env_s = 0.0
    for turn in range(1, max_turns + 1):
        budget = min(sampling.max_new_tokens, max_total_tokens - len(traj))
        turn_sampling = sampling if budget == sampling.max_new_tokens else dataclasses.replace(sampling,
                                                                                               max_new_tokens=budget)
        start = time.perf_counter()
        completion = await engine.generate(traj.context(), turn_sampling, session_id)
        gen_s += time.perf_counter() - start
        if not completion.token_ids:
            raise RuntimeError(f"the engine returned an empty turn (session {session_id!r}, turn {turn}, "
                               f"finish_reason {completion.finish_reason!r})")
        traj.add_model_turn(completion)
        start = time.perf_counter()
        result = await env_call("step", env.step(completion.token_ids), step_timeout_s, env, session_id, turn)
        env_s += time.perf_counter() - start
        if not continue_after(traj, result, max_total_tokens):
            break
    else:
        traj.truncated = True  # ran out of max_turns
    traj.metrics = {"episode/gen_s": gen_s, "episode/env_s": env_s}
    return traj


def to_dataproto(trajectories: Sequence[Trajectory], pad_token_id: int, temperature: float,
                 non_tensors: Mapping[str, np.ndarray] | None = None) -> DataProto:
    """Trajectories as the trainer's layout, plus ``token_versions`` (B, T_r; -1 on env tokens and
    padding) and the non-tensor columns ``num_turns``, ``truncated``, ``engine``."""
    if not trajectories:
        raise ValueError("to_dataproto needs at least one trajectory")
    prompts, _ = collate_prompts([{"input_ids": torch.tensor(t.prompt_ids)} for t in trajectories], pad_token_id)
    t_r = max(max(len(t.token_ids) for t in trajectories), 1)
    n = len(trajectories)
    responses = torch.full((n, t_r), pad_token_id, dtype=torch.long)
    attention = torch.zeros((n, t_r), dtype=torch.long)
    response_mask = torch.zeros((n, t_r), dtype=torch.long)
    log_probs = torch.zeros((n, t_r), dtype=torch.float32)
    versions = torch.full((n, t_r), ENV_TOKEN_VERSION, dtype=torch.long)
    scores = torch.zeros((n, t_r), dtype=torch.float32)
    for row, t in enumerate(trajectories):
        k = len(t.token_ids)
        responses[row, :k] = torch.tensor(t.token_ids, dtype=torch.long)
        attention[row, :k] = 1
        response_mask[row, :k] = torch.tensor(t.policy_mask, dtype=torch.long)
        log_probs[row, :k] = torch.tensor(t.log_probs, dtype=torch.float32)
        versions[row, :k] = torch.tensor(t.versions, dtype=torch.long)
        model_positions = [j for j, m in enumerate(t.policy_mask) if m]
        if model_positions:
            scores[row, model_positions[-1]] = t.reward
    positions = prompts["position_ids"][:, -1:] + 1 + torch.arange(t_r)  # padding included; it is masked
    columns = {
        "num_turns": np.array([t.turns for t in trajectories], dtype=np.int64),
        "truncated": np.array([t.truncated for t in trajectories], dtype=bool),
        "engine": np.array([t.engine_id for t in trajectories], dtype=object),
        **dict(non_tensors or {}),
    }
    return DataProto.from_dict(
        tensors={
            "prompts": prompts["input_ids"],
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts["input_ids"], responses], 1),
            "attention_mask": torch.cat([prompts["attention_mask"], attention], 1),
            "position_ids": torch.cat([prompts["position_ids"], positions], 1),
            "rollout_log_probs": log_probs,
            "token_versions": versions,
            "token_level_scores": scores,
        },
        non_tensors=columns,
        meta_info={"temperature": temperature},  # what rollout_log_probs refer to (the actor reads it)
    )


def mask_stale_tokens(batch: DataProto, current_version: int, max_token_staleness: int) -> dict[str, float]:
    """Drop from the loss (``response_mask`` 0) the model tokens sampled by weights more than
    ``max_token_staleness`` versions older than ``current_version``; returns the fraction masked."""
    b = batch.batch
    mask = b["response_mask"].bool()
    stale = mask & (b["token_versions"] < current_version - max_token_staleness)
    b["response_mask"] = (mask & ~stale).to(b["response_mask"].dtype)
    return {"episode/stale_token_frac": float(stale.sum()) / max(int(mask.sum()), 1)}
