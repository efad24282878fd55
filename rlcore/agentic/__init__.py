"""Agentic, asynchronous RL: multi-turn environments in token ids, decoupled rollout/training.

- ``env``: the ``Env`` contract (token ids in and out), a registry, the ``guess_number`` game.
- ``multi_turn``: ``MultiTurnRollout`` runs batches of episodes turn by turn into one trajectory
  row each, with ``response_mask`` covering only the policy's own tokens.
- ``replay_buffer``: ``ReplayBuffer`` (staleness-bounded, version-tagged rows),
  ``importance_weights`` for stale rows, ``AsyncRolloutLoop`` (a rollout producer thread).
- ``router``: ``SessionRouter`` keeps each session's turns on one engine (prefix-cache reuse).
"""

from rlcore.agentic.env import Env, GuessNumberEnv, StepResult, make_env, register_env
from rlcore.agentic.multi_turn import EnvEpisodes, MultiTurnRollout
from rlcore.agentic.replay_buffer import AsyncRolloutLoop, ReplayBuffer, importance_weights
from rlcore.agentic.router import SessionRouter, TurnOutput

__all__ = [
    "AsyncRolloutLoop", "Env", "EnvEpisodes", "GuessNumberEnv", "MultiTurnRollout", "ReplayBuffer", "SessionRouter", "StepResult",
    "TurnOutput", "importance_weights", "make_env", "register_env",
]
