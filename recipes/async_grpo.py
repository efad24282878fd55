"""Asynchronous GRPO: the rollout engine samples the next batches while the trainer updates.

    python -m recipes.async_grpo              # tiny warm-started model on the arithmetic task, CPU
    python -m recipes.async_grpo replay.max_staleness=0      # on-policy: each batch from the newest weights

Two worker groups instead of one hybrid engine: the trainer's (actor + reference) and a rollout
group of its own. A producer thread (``AsyncRolloutLoop``) keeps asking the rollout group for
batches and puts them in a ``ReplayBuffer``, each row tagged with the policy version that sampled
it; the trainer pops the oldest fresh batch, so it may train on samples one version old while the
engine already samples the next. Per step:
    pop the oldest batch whose policy is at most replay.max_staleness versions old    wait_rollout
    score it, reference log-probs, group advantages (as recipes/grpo.py)            reward / ref / adv
    update; the loss is reweighted by min(pi_current / pi_sampler, cap) per token     update
      (actor.use_rollout_is), the correction for rows sampled by older weights
    publish the new weights to the rollout group as version `step`                   sync_weights
Resume restores the trainer's weights and then the engine's; the buffer's rows are not saved (the
producer samples new ones), so a resumed run is not step-for-step equal to an uninterrupted one.
"""

from __future__ import annotations

import itertools

import hydra
import numpy as np
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlcore.agentic import AsyncRolloutLoop, ReplayBuffer
from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.builder import build_data, build_rollout_group, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.consistency import stamp_row_versions
from rlcore.trainer.loop import TrainingRun, probe_check
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "replay", "trainer")
register_schema("async_grpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    use_old = needs_old_log_prob(cfg)
    workers = build_workers(cfg, ["actor"] + (["ref"] if use_ref else []))
    engine = build_rollout_group(cfg)
    reward_fn = RuleRewardManager.from_config(cfg)
    rows = cfg.data.train_batch_size * cfg.rollout.n
    buffer = ReplayBuffer(rows * cfg.replay.capacity_batches, cfg.replay.max_staleness, tokenizer.pad_token_id)
    loop = None

    def validate_between_generations() -> dict[str, float]:
        if loop is None:  # before the producer starts
            return validate(engine.rollout, val_batches, reward_fn)
        with loop.paused():
            return validate(engine.rollout, val_batches, reward_fn)

    kl_ctrl = build_kl_controller(cfg.algorithm)  # with algorithm.use_kl_in_reward: the penalty's coefficient
    state = {"kl_ctrl": kl_ctrl} if cfg.algorithm.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, validate_between_generations, state) as run:
        engine.rollout.update_weights(workers.actor.get_full_state_dict.options(blocking=False)())  # resumed ones
        prompts = (run.next_prompts() for _ in itertools.count())  # endless: the loader repeats the data
        run.on_close(engine.shutdown)
        loop = AsyncRolloutLoop(engine.rollout, prompts, buffer, version=run.start_step).start()
        run.on_close(loop.stop)
        # the consistency check reads the engine between two generations, after each publish: its weights
        # and the end-to-end probe, like the other recipes' engines (the engine lags the trainer 0 versions)
        run.check.watch(loop.between_generations(engine.rollout.weight_checksums),
                        probe_check(cfg, workers.actor, loop.between_generations(engine.rollout.probe_log_probs)))
        for step in run.steps():
            with run.timer("wait_rollout"):
                batch = loop.pop_batch(rows, timeout=cfg.replay.pop_timeout_s)
            staleness = step - 1 - batch.non_tensor_batch["policy_version"]
            stamp_row_versions(batch, step - 1)  # the consistency check judges current-version rows only
            with run.timer("reward"):
                batch.union(reward_fn(batch))
            if use_old:
                with run.timer("old_log_prob"):
                    batch.union(workers.actor.compute_log_prob(batch))
            if use_ref:
                with run.timer("ref"):
                    batch.union(workers.ref.compute_ref_log_prob(batch))
            with run.timer("adv"):
                metrics = compute_rewards(batch, cfg.algorithm, kl_ctrl)
                compute_advantage(batch, cfg.algorithm)
            with run.timer("update_actor"):
                metrics.update(mean_over_ranks(workers.actor.update_policy(batch)))
            with run.timer("sync_weights"):
                loop.publish_weights(workers.actor.get_full_state_dict.options(blocking=False)(), version=step)
            metrics["check/engine_lag"] = float(step - loop.version)  # versions the engine is behind: 0 after a publish
            metrics.update({"replay/staleness_mean": float(np.mean(staleness)),
                            "replay/dropped_stale": buffer.num_dropped_stale, **loop.rollout_metrics})
            run.end_step(step, {**metrics, **batch_metrics(batch)}, batch)
    return run


@hydra.main(config_path="config", config_name="async_grpo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
