"""GRPO on episodes streamed from engine servers: the loop the agentic recipes share.

Why one loop: ``recipes/agentic_grpo.py`` (env episodes) and ``recipes/chat_agent_grpo.py`` (a
black-box agent's sessions) differ only in who plays the episodes (the runner actors) and how a
step's finished groups become training rows and metrics; engine servers, the streaming pool,
the reference / advantage / update / bucketed weight push and validation on the engines are the
same, and are here once.

    start_runners(engines, sampling) -> runner actors with a ``run_group(group_id, task, size)``
    describe(played, version) -> (extra non-tensor columns, metrics)   # played: groups of trajectories

Each step's rows are the trajectories of ``train_batch_size`` finished groups, ``uid`` their group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlcore.agentic import RolloutPool
from rlcore.agentic.episode import Trajectory, mask_stale_tokens, to_dataproto
from rlcore.agentic.runner import generate_prompts, stop_runners
from rlcore.engines import RolloutConfig, SamplingSettings
from rlcore.engines.server import (
    engine_idle_metrics,
    engine_probe_log_probs,
    engine_weight_checksums,
    start_engine_servers,
    stop_engine_servers,
)
from rlcore.models import ModelConfig
from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.builder import build_data, build_workers, init_ray
from rlcore.trainer.loop import TrainingRun, probe_check
from rlcore.trainer.progress import phase
from rlcore.trainer.tasks import episode_tasks
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

StartRunners = Callable[[Sequence[Any], SamplingSettings], list]
Describe = Callable[[list[list[Trajectory]], int], tuple[dict[str, np.ndarray], dict[str, float]]]


def train_on_streamed_episodes(cfg: DictConfig, start_runners: StartRunners, describe: Describe) -> TrainingRun:
    """The whole run of an agentic recipe (``cfg`` loaded, with ``agentic`` among its sections)."""
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    a = cfg.agentic
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    kl_ctrl = build_kl_controller(cfg.algorithm)  # with algorithm.use_kl_in_reward: the penalty's coefficient
    workers = build_workers(cfg, ["actor"] + (["ref"] if use_ref else []))
    init_ray(cfg)
    model_cfg, rollout_cfg = ModelConfig(**cfg.model), RolloutConfig(**OmegaConf.to_container(cfg.rollout))
    phase(f"starting {a.num_engines} engine server(s) ({rollout_cfg.backend}) and {a.num_runners} episode runner(s)")
    engines = start_engine_servers(a.num_engines, model_cfg, rollout_cfg, num_cpus=a.cpus_per_engine,
                                   num_gpus=a.gpus_per_engine)
    sampling = SamplingSettings.resolve(rollout_cfg, {"n": 1})
    runners = start_runners(engines, sampling)
    reward_fn = RuleRewardManager.from_config(cfg)  # for the single-turn validation
    groups = cfg.data.train_batch_size
    bucket_bytes = int(a.bucket_mb * 2**20)
    temperature = 1.0 if sampling.greedy else sampling.temperature

    def validate_on_engines() -> dict[str, float]:
        return validate(lambda prompts: generate_prompts(engines, prompts, rollout_cfg), val_batches, reward_fn)

    state = {"kl_ctrl": kl_ctrl} if cfg.algorithm.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, validate_on_engines, state) as run:
        run.on_close(lambda: stop_engine_servers(engines))
        run.on_close(lambda: stop_runners(runners))
        workers.actor.push_weights(engines, run.start_step, bucket_bytes)  # the resumed weights, if any
        # the consistency check: the servers' weights, and the end-to-end probe on every server (calibrated now)
        run.check.watch(lambda: engine_weight_checksums(engines),
                        probe_check(cfg, workers.actor, lambda ids: engine_probe_log_probs(engines, ids)))
        pool = RolloutPool(runners, episode_tasks(run), cfg.rollout.n, a.groups_in_flight or groups,
                           max_staleness=a.max_staleness, max_ready=a.max_ready,
                           drop_failed=a.drop_failed_groups).start()
        run.on_close(lambda: close_pool(pool, run.dir))
        run.watchdog.add_probe("rollout pool", pool.describe)  # a late wait_rollout says which groups it waits for
        _, engine_state = engine_idle_metrics(engines)
        for step in run.steps():
            with run.timer("wait_rollout"):
                played = pool.get_groups(groups, current_version=step - 1, timeout_s=a.pop_timeout_s)
            uid = np.array([str(g) for g, group in enumerate(played) for _ in group], dtype=object)
            columns, metrics = describe(played, step - 1)
            batch = to_dataproto([t for group in played for t in group], tokenizer.pad_token_id, temperature,
                                 {"uid": uid, **columns})
            batch.meta_info.update(sampling.log_prob_meta())  # top-k / top-p too: the actor scores under them
            batch.meta_info["policy_version"] = step - 1  # token_versions' lags, for the consistency check
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


def close_pool(pool: RolloutPool, folder: Path) -> None:
    """Stop the pool and say what it dropped, and why: printed, and ``<run>/drops.txt`` / ``drops.json``."""
    pool.stop()
    text, _ = pool.drops.write(folder)
    print(f"{pool.drops.summary_text()}\n(written to {text} and drops.json)", flush=True)
