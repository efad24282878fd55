"""Online DPO: preference optimisation on pairs the current policy samples and a rule scores.

    python -m recipes.online_dpo             # tiny warm-started model on the arithmetic task, CPU
    python -m recipes.online_dpo model.path=<HF dir> data.train_files=<f> data.val_files=<f> \\
        rollout.backend=vllm trainer.device=cuda trainer.procs_per_node=8

Per step, for a batch of prompts:
    sample rollout.n responses per prompt from the current policy          generate
    score each response with the rule reward                               reward
    per prompt, pair the best response (chosen) with the worst (rejected);
    prompts whose samples all score the same give no pair                  pairs
    log-probs of the pairs under the frozen reference                      ref log-probs
    DPO step: -log sigmoid(beta * (margin of pi - margin of ref))          update
    the rollout engine loads the new weights                               sync
The loss is ``rlcore.trainer.preference:dpo_policy_loss``, named in ``actor.policy_loss`` like any
other policy loss (an import path, so Ray worker processes find it), and the actor's ordinary update
loop trains it: no DPO-specific worker.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlcore.algos.preference import best_worst_pairs
from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.builder import build_data, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "trainer")
register_schema("online_dpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.actor.shuffle:
        raise ValueError("online DPO trains on adjacent (chosen, rejected) rows: keep actor.shuffle=false")
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    workers = build_workers(cfg, ["actor", "rollout", "ref"])
    reward_fn = RuleRewardManager.from_config(cfg)
    dp_size = workers.actor.world_size
    with TrainingRun(cfg, workers, loader, lambda: validate(workers.rollout, val_batches, reward_fn)) as run:
        for step in run.steps():
            prompts = run.next_prompts()
            with run.timer("gen"):
                batch = workers.rollout.generate_sequences(prompts)
            with run.timer("reward"):
                batch.union(reward_fn(batch))
            pairs = best_worst_pairs(batch, batch.batch["reward_scores"])
            pairs = pairs[: len(pairs) - len(pairs) % (2 * dp_size)]  # whole pairs on every rank
            metrics = {**batch_metrics(batch), "dpo/pairs": len(pairs) // 2}
            if len(pairs):
                pairs.meta_info.update(dpo_beta=cfg.algorithm.dpo_beta, dpo_loss_type=cfg.algorithm.dpo_loss_type)
                with run.timer("ref"):
                    pairs.union(workers.ref.compute_ref_log_prob(pairs))
                with run.timer("update_actor"):  # contiguous split: a balanced one would break up the pairs
                    metrics.update(mean_over_ranks(workers.actor.update_policy.options(balance=False)(pairs)))
                with run.timer("sync_weights"):
                    workers.rollout.sync_weights()
            run.end_step(step, metrics, batch)
    return run


@hydra.main(config_path="config", config_name="online_dpo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
