"""GRPO: group-relative policy optimisation (Shao et al. 2024) with actor, rollout and reference
colocated in one process per rank (the hybrid engine).

    python -m recipes.grpo                   # tiny warm-started model on the arithmetic task, CPU
    python -m recipes.grpo model.path=<HF dir> data.train_files=<f> data.val_files=<f> \\
        rollout.backend=vllm trainer.device=cuda trainer.procs_per_node=8

Per step, for a batch of prompts:
    sample rollout.n responses per prompt from the current policy          generate
    score each response with the rule reward (on its last token)           reward
      (with reward.model.path: a learned reward model's score, or the sum: rlcore.trainer.learned_reward)
    log-probs of the responses under the current policy, and the ref       old / ref log-probs
      (old ones only when the update takes several optimizer steps: see needs_old_log_prob;
      both started before the reward, so that the workers run them while the driver scores)
    advantage = (score - mean of its prompt's group) / std of that group   advantages
    clipped policy-gradient step with a KL(pi || ref) loss term            update
    the rollout engine loads the new weights                               sync
No critic: the other samples of the same prompt are the baseline. With algorithm.adv_estimator=remax
(ReMax, Li et al. 2023) the baseline is instead the reward of one greedy response per prompt,
generated and scored each step beside the samples (and not trained on).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import (
    build_kl_controller,
    compute_advantage,
    compute_rewards,
    greedy_baselines,
    greedy_prompts,
    needs_old_log_prob,
)
from rlcore.trainer.builder import build_data, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.learned_reward import reward_roles, training_reward
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "trainer")
register_schema("grpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    use_old = needs_old_log_prob(cfg)  # not for a one-step update: its own log-probs are the old ones
    workers = build_workers(cfg, ["actor", "rollout"] + (["ref"] if use_ref else []) + reward_roles(cfg))
    rule_fn = RuleRewardManager.from_config(cfg)  # validation's score, with or without a reward model
    reward_fn = training_reward(cfg, rule_fn, workers)  # the rule; with reward.model.path the model's score (+ rule)
    kl_ctrl = build_kl_controller(cfg.algorithm)  # with algorithm.use_kl_in_reward: the penalty's coefficient
    state = {"kl_ctrl": kl_ctrl} if cfg.algorithm.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, lambda: validate(workers.rollout, val_batches, rule_fn), state) as run:
        for step in run.steps():
            prompts = run.next_prompts()
            with run.timer("gen"):
                batch = workers.rollout.generate_sequences(prompts)
            # The log-probs read only the tokens: started now, the workers compute them while the driver scores.
            old = workers.actor.compute_log_prob.options(blocking=False)(batch) if use_old else None
            ref = workers.ref.compute_ref_log_prob.options(blocking=False)(batch) if use_ref else None
            with run.timer("reward"):
                batch.union(reward_fn(batch))
            if cfg.algorithm.adv_estimator == "remax":  # baseline: the reward of each prompt's greedy response
                with run.timer("gen_greedy"):
                    greedy = workers.rollout.generate_sequences(greedy_prompts(prompts))
                    greedy.union(reward_fn(greedy))
                batch.batch["reward_baselines"] = greedy_baselines(batch, greedy)  # greedy rows: not trained on
            if old is not None:
                with run.timer("old_log_prob"):  # what is left of it once the reward is in
                    batch.union(old.get())
            if ref is not None:
                with run.timer("ref"):
                    batch.union(ref.get())
            with run.timer("adv"):
                metrics = compute_rewards(batch, cfg.algorithm, kl_ctrl)
                compute_advantage(batch, cfg.algorithm)
            with run.timer("update_actor"):
                workers.rollout.release_weights()  # the engine's copy waits idle for the sync below: let it go
                metrics.update(mean_over_ranks(workers.actor.update_policy(batch)))
            with run.timer("sync_weights"):
                workers.rollout.sync_weights()
            run.end_step(step, {**metrics, **batch_metrics(batch)}, batch)
    return run


@hydra.main(config_path="config", config_name="grpo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
