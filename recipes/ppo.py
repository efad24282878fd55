"""PPO with a learned critic and GAE (Schulman et al. 2017; Ouyang et al. 2022's KL-in-reward), with
actor, critic, rollout and reference colocated in one process per rank (the hybrid engine).

    python -m recipes.ppo                    # tiny warm-started model on the arithmetic task, CPU
    python -m recipes.ppo model.path=<HF dir> data.train_files=<f> data.val_files=<f> \\
        rollout.backend=vllm trainer.device=cuda trainer.procs_per_node=8

Per step, for a batch of prompts:
    sample rollout.n responses per prompt from the current policy          generate
    score each response with the rule reward (on its last token)           reward
      (with reward.model.path: a learned reward model's score, or the sum: rlcore.trainer.learned_reward)
    log-probs under the sampling policy and under the frozen reference     old / ref log-probs
    the critic's value of every response prefix                            values
      (these three forwards start before the reward: the workers run them while the driver scores)
    rewards = scores - beta * KL(pi_old || ref) per token, beta adapted    KL penalty
    GAE advantages and returns over the response tokens                    advantages
    clipped value regression to the returns; clipped policy step           update critic, actor
    the rollout engine loads the new weights                               sync
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards
from rlcore.trainer.builder import build_data, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.learned_reward import reward_roles, training_reward
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "critic", "rollout", "reward", "algorithm", "trainer")
register_schema("ppo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    workers = build_workers(cfg, ["actor", "critic", "rollout"] + (["ref"] if use_ref else []) + reward_roles(cfg))
    rule_fn = RuleRewardManager.from_config(cfg)  # validation's score, with or without a reward model
    reward_fn = training_reward(cfg, rule_fn, workers)  # the rule; with reward.model.path the model's score (+ rule)
    kl_ctrl = build_kl_controller(cfg.algorithm)
    with TrainingRun(cfg, workers, loader, lambda: validate(workers.rollout, val_batches, rule_fn),
                      state={"kl_ctrl": kl_ctrl}) as run:
        for step in run.steps():
            prompts = run.next_prompts()
            with run.timer("gen"):
                batch = workers.rollout.generate_sequences(prompts)
            # Log-probs and values read only the tokens: started now, the workers compute them while the driver scores.
            old = workers.actor.compute_log_prob.options(blocking=False)(batch)
            ref = workers.ref.compute_ref_log_prob.options(blocking=False)(batch) if use_ref else None
            values = workers.critic.compute_values.options(blocking=False)(batch)
            with run.timer("reward"):
                batch.union(reward_fn(batch))
            with run.timer("old_log_prob"):  # each timer: what is left of it once the reward is in
                batch.union(old.get())
            if ref is not None:
                with run.timer("ref"):
                    batch.union(ref.get())
            with run.timer("values"):
                batch.union(values.get())
            with run.timer("adv"):
                metrics = compute_rewards(batch, cfg.algorithm, kl_ctrl)
                compute_advantage(batch, cfg.algorithm)
            with run.timer("update_critic"):
                metrics.update(mean_over_ranks(workers.critic.update_critic(batch)))
            with run.timer("update_actor"):
                metrics.update(mean_over_ranks(workers.actor.update_policy(batch)))
            with run.timer("sync_weights"):
                workers.rollout.sync_weights()
            run.end_step(step, {**metrics, **batch_metrics(batch)}, batch)
    return run


@hydra.main(config_path="config", config_name="ppo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
