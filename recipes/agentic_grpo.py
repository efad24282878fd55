"""Agentic GRPO: multi-turn episodes as coroutines on engine servers, a streaming rollout pool,
weights streamed to the engines in buckets while episodes keep going.

    python -m recipes.agentic_grpo                        # arithmetic_retry with env latency, CPU
    python -m recipes.agentic_grpo agentic.partial_rollout=true agentic.num_engines=2 rollout.backend=vllm

The pieces (``rlcore.agentic``, ``rlcore.engines``):
    engine servers   Ray actors, one engine each (HF batching loop or vLLM AsyncLLM), own CPUs/GPU
    runners          Ray actors playing many episodes at once, each a coroutine: generate -> env.step
                     (with the env's latency) -> generate ..., every turn of an episode on one engine
    pool             keeps agentic.groups_in_flight prompt groups (default: one batch) being played,
                     hands the trainer finished groups as they finish, carries the rest over, tops up
                     at once: batch k+1 is played while the trainer updates on batch k; drops groups
                     more than agentic.max_staleness versions old
Per step:
    take train_batch_size finished groups (rollout.n episodes of one task each)         wait_rollout
    reference log-probs; advantage = the episode reward against its group's             ref / adv
    update; the loss is reweighted per token by min(pi_current / pi_sampler, cap)       update
      (actor.use_rollout_is): tokens sampled by older weights are corrected
    stream the new weights to the engines as version `step`, bucket by bucket,         sync_weights
      straight from the FSDP shards (in flight with agentic.partial_rollout)
Validation is the single-turn greedy one of the other recipes, on the engine servers.
Resume restores the trainer's weights and pushes them to the engines; groups in flight are not saved.
The loop (``rlcore.trainer.streamed_grpo``) is shared with ``recipes/chat_agent_grpo.py``.
"""

from __future__ import annotations

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from rlcore.agentic import EpisodeSpec, start_runners
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.streamed_grpo import train_on_streamed_episodes

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "env", "agentic", "trainer")
register_schema("agentic_grpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    a, e = cfg.agentic, cfg.env

    def env_runners(engines, sampling):
        spec = EpisodeSpec(e.name, cfg.model.path, sampling, OmegaConf.to_container(e.kwargs), e.max_turns,
                           e.max_total_tokens, e.step_timeout_s)
        return start_runners(a.num_runners, spec, engines, num_cpus=a.cpus_per_runner)

    return train_on_streamed_episodes(cfg, env_runners, lambda played, version: ({}, episode_metrics(played, version)))


def episode_metrics(played: list, version: int) -> dict[str, float]:
    trajs = [t for group in played for t in group]
    rewards = np.array([t.reward for t in trajs])
    turns = np.array([t.turns for t in trajs])
    return {"episode/reward_mean": float(rewards.mean()), "episode/turns_mean": float(turns.mean()),
            "episode/first_try_right": float(((turns == 1) & (rewards > 0)).mean()),
            "episode/env_s_mean": float(np.mean([t.metrics["episode/env_s"] for t in trajs])),
            "episode/version_lag_mean": float(np.mean([version - t.oldest_version for t in trajs]))}


@hydra.main(config_path="config", config_name="agentic_grpo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
