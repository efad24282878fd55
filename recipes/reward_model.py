"""Reward-model training: a scalar head on a decoder, fit to preference pairs with the
Bradley-Terry loss (Ouyang et al. 2022's reward model), for the RL recipes to score with.

    python -m recipes.reward_model           # the warm-started tiny policy's body on arithmetic pairs, CPU
    python -m recipes.reward_model model.path=<HF dir> data.train_files=<pairs> data.val_files=<pairs> \\
        trainer.device=cuda trainer.procs_per_node=8
    python -m recipes.grpo reward.model.path=outputs/reward_model/default/hf    # RL on its scores

Per step, for a batch of (prompt, chosen, rejected) pairs:
    score both sequences: r = head(hidden state at the last token)         forward
    loss = mean over pairs of -log sigmoid(r_chosen - r_rejected)           Bradley-Terry
    one optimizer step on it                                                update
Validation scores the held-out pairs: the fraction where chosen is scored above rejected (overall
and per kind of wrong answer), and their loss. The trained model is exported as a HF directory
(``AutoModelForSequenceClassification``, one label) to ``<run dir>/hf``.

The model starts from ``model.path``; null: the policy the RL recipes warm-start from (its body, a
fresh head), so the reward model reads responses with the representation the policy writes them in.
Pairs: ``data.train_files`` / ``data.val_files`` (columns prompt, chosen, rejected); null: the
arithmetic task's prompts, each with a near miss, a random number and a malformed answer
(``rlcore.data.preference``).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from transformers import AutoTokenizer

from rlcore.trainer.builder import build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import ConfigError, load_config, register_schema
from rlcore.trainer.learned_reward import build_pair_data, pair_metrics
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import mean_over_ranks
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "reward_model", "trainer")
register_schema("reward_model_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    """Train the reward model; it is exported as a HF directory to ``<run dir>/hf``."""
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        if cfg.data.train_files is not None:
            raise ConfigError("model.path is null, whose warm start is an SFT run on the arithmetic task, but "
                              "data.train_files names pair files: give model.path (a policy or reward model)")
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_pair_data(cfg, tokenizer)
    workers = build_workers(cfg, ["rm"])  # trained: this run has the reward_model section
    with TrainingRun(cfg, workers, loader, lambda: pair_metrics(workers.rm, val_batches)) as run:
        for step in run.steps():
            pairs = run.next_prompts()
            with run.timer("update_rm"):
                metrics = mean_over_ranks(workers.rm.update_rm(pairs))
            run.end_step(step, metrics, pairs)
    return run


@hydra.main(config_path="config", config_name="reward_model", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
