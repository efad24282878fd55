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
"""

from __future__ import annotations

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlcore.agentic import EpisodeSpec, RolloutPool, start_runners, to_dataproto
from rlcore.agentic.episode import mask_stale_tokens
from rlcore.agentic.runner import generate_prompts, stop_runners
from rlcore.engines import RolloutConfig, SamplingSettings
from rlcore.engines.server import engine_idle_metrics, start_engine_servers, stop_engine_servers
from rlcore.models import ModelConfig
from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.builder import build_data, build_workers, init_ray
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.tasks import episode_tasks
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "env", "agentic", "trainer")
register_schema("agentic_grpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    a, e = cfg.agentic, cfg.env
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    kl_ctrl = build_kl_controller(cfg.algorithm)  # with algorithm.use_kl_in_reward: the penalty's coefficient
    workers = build_workers(cfg, ["actor"] + (["ref"] if use_ref else []))
    init_ray(cfg)
    model_cfg, rollout_cfg = ModelConfig(**cfg.model), RolloutConfig(**OmegaConf.to_container(cfg.rollout))
    engines = start_engine_servers(a.num_engines, model_cfg, rollout_cfg, num_cpus=a.cpus_per_engine,
                                   num_gpus=a.gpus_per_engine)
    sampling = SamplingSettings.resolve(rollout_cfg, {"n": 1})
    spec = EpisodeSpec(e.name, cfg.model.path, sampling, OmegaConf.to_container(e.kwargs), e.max_turns,
                       e.max_total_tokens, e.step_timeout_s)
    runners = start_runners(a.num_runners, spec, engines, num_cpus=a.cpus_per_runner)
    reward_fn = RuleRewardManager.from_config(cfg)  # for the single-turn validation
    groups = cfg.data.train_batch_size
    bucket_bytes = int(a.bucket_mb * 2**20)

    def validate_on_engines() -> dict[str, float]:
        return validate(lambda prompts: generate_prompts(engines, prompts, rollout_cfg), val_batches, reward_fn)

    state = {"kl_ctrl": kl_ctrl} if cfg.algorithm.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, validate_on_engines, state) as run:
        run.on_close(lambda: stop_engine_servers(engines))
        run.on_close(lambda: stop_runners(runners))
        workers.actor.push_weights(engines, run.start_step, bucket_bytes)  # the resumed weights, if any
        pool = RolloutPool(runners, episode_tasks(run), cfg.rollout.n, a.groups_in_flight or groups,
                           max_staleness=a.max_staleness, max_ready=a.max_ready).start()
        run.on_close(pool.stop)
        _, engine_state = engine_idle_metrics(engines)
        for step in run.steps():
            with run.timer("wait_rollout"):
                played = pool.get_groups(groups, current_version=step - 1, timeout_s=a.pop_timeout_s)
            uid = np.array([str(g) for g, group in enumerate(played) for _ in group], dtype=object)
            batch = to_dataproto([t for group in played for t in group], tokenizer.pad_token_id,
                                 1.0 if sampling.greedy else sampling.temperature, {"uid": uid})
            metrics = episode_metrics(played, step - 1)
            if a.max_token_staleness is not None:
                metrics.update(mask_stale_tokens(batch, step - 1, a.max_token_staleness))
            if needs_old_log_prob(cfg):
                with run.timer("old_log_prob"):
                    batch.union(workers.actor.compute_log_prob(batch))
            if use_ref:
                with run.timer("ref"):
                    batch.union(workers.ref.compute_ref_log_prob(batch))
            with run.timer("adv"):
                metrics.update(compute_rewards(batch, cfg.algorithm, kl_ctrl))
                compute_advantage(batch, cfg.algorithm)
            with run.timer("update_actor"):
                metrics.update(mean_over_ranks(workers.actor.update_policy(batch)))
            with run.timer("sync_weights"):
                metrics.update(workers.actor.push_weights(engines, step, bucket_bytes, a.partial_rollout))
            idle, engine_state = engine_idle_metrics(engines, engine_state)
            run.end_step(step, {**metrics, **idle, **pool.metrics(), **batch_metrics(batch)}, batch)
    return run


def episode_metrics(played: list, version: int) -> dict[str, float]:
    trajs = [t for group in played for t in group]
    rewards = np.array([t.reward for t in trajs])
    turns = np.array([t.turns for t in trajs])
    return {"episode/reward_mean": float(rewards.mean()), "episode/turns_mean": float(turns.mean()),
            "episode/first_try_right": float(((turns == 1) & (rewards > 0)).mean()),
            "episode/env_s_mean": float(np.mean([t.metrics["episode/env_s"] for t in trajs])),
            "episode/version_lag_mean": float(np.mean([version - t.oldest_version for t in trajs]))}


@hydra.main(config_path="config", config_name="agentic_grpo", version_base=None)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
