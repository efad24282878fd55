"""RL roles as SPMD workers: the policy and reference (ActorWorker), the value model (CriticWorker),
the rollout (RolloutWorker, holding a generation engine), a learned reward model
(RewardModelWorker) and rule rewards spread over a group (RewardWorker). The training roles are
FSDP2-sharded; every role runs in-process or as N Ray ranks with no code change."""

from rlcore.workers.actor import ActorWorker
from rlcore.workers.config import ActorConfig, CriticConfig, TrainConfig
from rlcore.workers.critic import CriticWorker
from rlcore.workers.reward import RewardWorker
from rlcore.workers.reward_model import RewardModelConfig, RewardModelWorker
from rlcore.workers.rollout import EpisodeRunner, RolloutWorker

__all__ = ["ActorConfig", "ActorWorker", "CriticConfig", "CriticWorker", "EpisodeRunner", "RewardModelConfig",
           "RewardModelWorker", "RewardWorker", "RolloutWorker", "TrainConfig"]
