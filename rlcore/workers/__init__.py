"""RL roles as SPMD workers: the policy and reference (ActorWorker), the value model (CriticWorker)
and a learned reward model (RewardModelWorker), all FSDP2-sharded, run in-process or as Ray groups.

Imported lazily, so that ``import rlcore.workers.<submodule>`` does not pull in every role.
"""

import importlib

_EXPORTS = {
    "ActorWorker": "rlcore.workers.actor",
    "ACTOR_DEFAULTS": "rlcore.workers.actor",
    "CriticWorker": "rlcore.workers.critic",
    "CRITIC_DEFAULTS": "rlcore.workers.critic",
    "RewardModelWorker": "rlcore.workers.reward_model",
    "RolloutWorker": "rlcore.workers.rollout",
    "RewardWorker": "rlcore.workers.reward",
    "RuleRewardManager": "rlcore.workers.reward",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rlcore.workers' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
