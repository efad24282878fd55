"""One place that maps ``rollout.backend`` to an engine class."""

from __future__ import annotations

from rlcore.engines.base import Engine, RolloutConfig
from rlcore.engines.hf_engine import HFEngine
from rlcore.engines.vllm_engine import VLLMEngine
from rlcore.models.config import ModelConfig


def build_engine(model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0) -> Engine:
    """The engine ``rollout_cfg.backend`` names, loaded from ``model_cfg.path``; rank r samples with seed + r."""
    engine_cls = {"hf": HFEngine, "vllm": VLLMEngine}[rollout_cfg.backend]
    return engine_cls(model_cfg, rollout_cfg, device=device, rank=rank)
