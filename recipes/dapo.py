"""DAPO: decoupled clip and dynamic sampling policy optimisation (Yu et al. 2025), GRPO's group
baseline with four changes, on actor and rollout colocated in one process per rank.

    python -m recipes.dapo                   # tiny warm-started model on the arithmetic task, CPU
    python -m recipes.dapo model.path=<HF dir> data.train_files=<f> data.val_files=<f> \\
        rollout.backend=vllm trainer.device=cuda rollout.max_new_tokens=20480 algorithm.overlong_buffer.len=4096

Per step:
    repeat, at most algorithm.filter_groups.max_num_gen_batches times:
        draw data.train_batch_size prompts, sample rollout.n responses each         generate
        score them, plus the soft overlong penalty (0 -> -1 over the last
          overlong_buffer.len tokens before the length limit)                        reward
        keep the prompts whose responses do not all score the same                  dynamic sampling
    until data.train_batch_size prompts are kept: train on exactly that many
      (too few after the last round: topped up with dropped ones; rlcore.trainer.dapo)
    advantage = (score - mean of its prompt's group) / std of that group             advantages
    responses cut at the length limit get no loss                                    overlong filtering
    clipped policy-gradient step, ratio clipped to [1 - 0.2, 1 + 0.28]
      (clip-higher: low-probability tokens may grow further), every token of the
      batch weighted the same (token-mean), no KL term and no reference              update
    the rollout engine loads the new weights                                         sync
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.builder import build_data, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.dapo import (
    GroupCollector,
    add_overlong_penalty,
    check_dapo_config,
    filter_values,
    mask_truncated,
    stop_token_ids,
)
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "trainer")
register_schema("dapo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    check_dapo_config(cfg)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    algo, max_len = cfg.algorithm, cfg.rollout.max_new_tokens
    use_ref = cfg.actor.use_kl_loss or algo.use_kl_in_reward  # DAPO: neither (dapo.yaml)
    use_old = needs_old_log_prob(cfg)
    workers = build_workers(cfg, ["actor", "rollout"] + (["ref"] if use_ref else []))
    reward_fn = RuleRewardManager.from_config(cfg)
    kl_ctrl = build_kl_controller(algo)
    stop_ids = stop_token_ids(cfg, tokenizer)
    state = {"kl_ctrl": kl_ctrl} if algo.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, lambda: validate(workers.rollout, val_batches, reward_fn), state) as run:
        for step in run.steps():
            groups = GroupCollector(cfg.data.train_batch_size, tokenizer.pad_token_id)
            while not groups.full and groups.rounds < algo.filter_groups.max_num_gen_batches:
                prompts = run.next_prompts()  # each draw advances the loader: a resume continues after it
                with run.timer("gen"):
                    out = workers.rollout.generate_sequences(prompts)
                with run.timer("reward"):
                    out.union(reward_fn(out))
                    if algo.overlong_buffer.enable:
                        add_overlong_penalty(out, max_len, algo.overlong_buffer.len, algo.overlong_buffer.penalty_factor)
                groups.add(out, filter_values(out, algo.filter_groups.metric) if algo.filter_groups.enable else None)
            batch, metrics = groups.batch()
            if use_old:
                with run.timer("old_log_prob"):
                    batch.union(workers.actor.compute_log_prob(batch))
            if use_ref:
                with run.timer("ref"):
                    batch.union(workers.ref.compute_ref_log_prob(batch))
            with run.timer("adv"):
                metrics.update(compute_rewards(batch, algo, kl_ctrl))
                compute_advantage(batch, algo)
            metrics.update(batch_metrics(batch))  # before overlong filtering zeroes the cut responses' masks
            if algo.overlong_buffer.enable:
                metrics["dapo/overlong_penalty_mean"] = batch.batch["overlong_penalty"].mean().item()
            if algo.overlong_filter:
                metrics["dapo/overlong_masked_frac"] = mask_truncated(batch, max_len, stop_ids).double().mean().item()
            if batch.batch["response_mask"].any():  # not when every response was cut: nothing to learn from
                with run.timer("update_actor"):
                    metrics.update(mean_over_ranks(workers.actor.update_policy(batch)))
                with run.timer("sync_weights"):
                    workers.rollout.sync_weights()
            run.end_step(step, metrics, batch)
    return run


@hydra.main(config_path="config", config_name="dapo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
