"""Rollout: generate responses (and the sampler's log-probs) from the current policy.

``RolloutWorker`` is the role; ``HFRollout`` (transformers ``generate``) and ``VLLMRollout`` (a vLLM
engine) are its two backends, chosen by ``rollout.backend``. The backends are imported lazily, so
this package imports without vLLM installed.
"""

from rlcore.workers.rollout.base import Generation, ModelConfig, RolloutBackend, RolloutConfig, SamplingSettings
from rlcore.workers.rollout.worker import RolloutWorker

__all__ = ["Generation", "ModelConfig", "RolloutBackend", "RolloutConfig", "RolloutWorker", "SamplingSettings"]
