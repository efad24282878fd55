"""Agentic, asynchronous RL: envs in token ids, episodes as coroutines, engines as services.

- ``env``: the ``Env`` contract (``async reset(task)``, ``async step(action) -> Result``), a registry,
  the built-in envs (``guess_number``, ``arithmetic_retry``), simulated step latency;
- ``chat``: ``ChatDelta``, a chat env's turns rendered through the tokenizer's template, one delta
  at a time;
- ``episode``: ``play_episode`` (one episode as a coroutine), ``Trajectory``, ``to_dataproto``;
- ``async_router``: ``AsyncSessionRouter``, every turn of a session on one engine, failover;
- ``runner``: ``EpisodeRunner``, many episodes at once in a (Ray) actor; ``start_runners``;
- ``pool``: ``RolloutPool``, the streaming pool of prompt groups in flight;
- ``multi_turn``: ``MultiTurnRollout``, turn-lockstep episodes on a batched engine, and
  ``EnvEpisodes``, the rollout worker's ``EpisodeRunner`` built on it;
- ``replay_buffer``: ``ReplayBuffer`` (staleness-bounded, version-tagged rows),
  ``importance_weights``, ``AsyncRolloutLoop`` (a producer thread over a rollout group);
- ``router``: ``SessionRouter`` over synchronous engines (batched turns);
- ``chat_agent``: the ``ChatAgent`` contract (a black-box agent on the OpenAI or the Anthropic
  client) and ``ChatAgentRunner``; ``chat_proxy``: the per-session OpenAI- and Anthropic-compatible
  endpoints it talks to; ``chat_session``: its token-exact trajectories; ``chat_turn``: one request's
  generation; ``chat_stream``: streamed replies; ``openai_wire``, ``anthropic_wire``, ``tool_calls``:
  the wire formats.
"""

from rlcore.agentic.async_router import AsyncSessionRouter
from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.chat_agent import AgentError, ChatAgent, ChatAgentRunner, ChatAgentSpec, ChatContext
from rlcore.agentic.chat_proxy import ChatProxy, ChatProxyConfig
from rlcore.agentic.env import ArithmeticRetryEnv, Env, GuessNumberEnv, LatencyEnv, Result, make_env, register_env
from rlcore.agentic.episode import EnvError, Trajectory, play_episode, to_dataproto
from rlcore.agentic.multi_turn import EnvEpisodes, MultiTurnRollout
from rlcore.agentic.pool import RolloutError, RolloutPool
from rlcore.agentic.replay_buffer import AsyncRolloutLoop, ReplayBuffer, importance_weights
from rlcore.agentic.router import SessionRouter, TurnOutput
from rlcore.agentic.runner import EpisodeRunner, EpisodeSpec, generate_prompts, start_runners, stop_runners

__all__ = [
    "AgentError", "ChatAgent", "ChatAgentRunner", "ChatAgentSpec", "ChatContext", "ChatProxy", "ChatProxyConfig",
    "ArithmeticRetryEnv", "AsyncRolloutLoop", "AsyncSessionRouter", "ChatDelta", "Env", "EnvEpisodes", "EnvError",
    "EpisodeRunner", "EpisodeSpec", "GuessNumberEnv", "LatencyEnv", "MultiTurnRollout", "ReplayBuffer", "Result",
    "RolloutError", "RolloutPool", "SessionRouter", "Trajectory", "TurnOutput", "importance_weights", "make_env",
    "generate_prompts", "play_episode", "register_env", "start_runners", "stop_runners", "to_dataproto",
]
