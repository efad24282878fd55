"""Helpers of the rollout-worker tests: a RolloutWorker group in this process, and the engine tests'
prompts and hand-computed references (tests/engines/engine_fixtures.py), re-exported."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engines"))

from engine_fixtures import PROMPTS, generate, hand_greedy, hand_log_probs, make_prompts, unpadded  # noqa: E402

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup  # noqa: E402
from rlcore.workers.rollout import RolloutWorker  # noqa: E402

__all__ = ["PROMPTS", "generate", "hand_greedy", "hand_log_probs", "local_rollout", "make_prompts", "unpadded"]


def local_rollout(model_dir: str, world_size: int = 1, model: dict | None = None, **rollout) -> LocalWorkerGroup:
    config = {"model": {"path": model_dir, **(model or {})}, "rollout": rollout}
    wg = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, config), world_size=world_size)
    wg.init_model()
    return wg
