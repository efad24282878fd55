"""Multi-turn GRPO: episodes against an environment, trained on in token ids end to end.

    python -m recipes.multi_turn_grpo             # tiny warm-started model, arithmetic with retries, CPU
    python -m recipes.multi_turn_grpo env.name=guess_number env.kwargs='{max_turns: 4}' ...

Per step, for a batch of tasks (the dataset's questions and answers):
    rollout.n episodes per task, turn by turn on the rollout ranks          episodes
      (``generate_multi_turn``: the env's replies are appended as token ids, never re-tokenized
      text; ``response_mask`` is 1 only on the policy's own tokens)
    the episode's reward sits on its last model token                       (from the env)
    reference log-probs, group advantages over a task's episodes            ref / adv
    one clipped policy-gradient step with the KL loss, weights to the engine update / sync
Validation is the single-turn one of recipes/grpo.py: greedy, first try only, so the numbers
compare with the other recipes' (the default env rewards being right at the first try most).
"""

from __future__ import annotations

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlcore.agentic import EnvEpisodes
from rlcore.protocol import DataProto
from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.builder import build_data, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "env", "trainer")
register_schema("multi_turn_grpo_schema", SECTIONS)


def episode_tasks(prompts: DataProto, cfg: DictConfig) -> DataProto:
    """A batch of prompts as rollout.n episode tasks each (adjacent, sharing the prompt's uid), with the
    batch's sampling seed (each turn's engine call derives its own from it)."""
    columns = prompts.non_tensor_batch
    messages = columns.get("messages")  # chat data: the env asks them through the template
    tasks = np.array([{"prompt": p, "answer": a, **({"messages": messages[i]} if messages is not None else {})}
                      for i, (p, a) in enumerate(zip(columns["raw_prompt"], columns["ground_truth"]))], dtype=object)
    return DataProto.from_dict(non_tensors={"task": tasks, "uid": columns["uid"]},
                               meta_info={"seed": prompts.meta_info.get("seed")}).repeat(cfg.rollout.n, interleave=True)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    use_old = needs_old_log_prob(cfg)
    workers = build_workers(cfg, ["actor", "rollout"] + (["ref"] if use_ref else []))
    reward_fn = RuleRewardManager.from_config(cfg)  # for the single-turn validation
    episodes = EnvEpisodes(cfg.env.name, OmegaConf.to_container(cfg.env.kwargs), cfg.env.max_turns,
                           cfg.env.max_total_tokens)  # played on the rollout ranks
    kl_ctrl = build_kl_controller(cfg.algorithm)  # with algorithm.use_kl_in_reward: the penalty's coefficient
    state = {"kl_ctrl": kl_ctrl} if cfg.algorithm.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, lambda: validate(workers.rollout, val_batches, reward_fn), state) as run:
        for step in run.steps():
            tasks = episode_tasks(run.next_prompts(), cfg)
            with run.timer("gen"):
                batch = workers.rollout.generate_episodes(tasks, episodes)
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
                workers.rollout.sync_weights()
            turns = batch.non_tensor_batch["num_turns"]
            scores = batch.batch["token_level_scores"].sum(-1).numpy()
            metrics.update({"episode/reward_mean": float(scores.mean()), "episode/turns_mean": float(turns.mean()),
                            "episode/first_try_right": float(((turns == 1) & (scores > 0)).mean())})
            run.end_step(step, {**metrics, **batch_metrics(batch)}, batch)
    return run


@hydra.main(config_path="config", config_name="multi_turn_grpo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
