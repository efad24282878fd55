"""SFT: supervised fine-tuning on prompt -> answer + eos; also the warm start of the RL recipes.

    python -m recipes.sft                    # a tiny model from scratch on the arithmetic task (CPU)
    python -m recipes.sft model.path=<HF dir> data.train_files=<f> data.val_files=<f> trainer.device=cuda

Each step takes a batch of prompts, appends each one's answer and eos as the "response" (the
rollout layout, so the actor's forward is reused unchanged), and takes one optimizer step on the
token-mean negative log-likelihood of those response tokens. ``data.response_key`` names another
column to train on instead of the bare answer: the generated ``multi_step`` task's worked
``solution`` (a warm start that shows a small model the form of a multi-step answer before RL).
Validation decodes greedily and scores with the reward function, exactly as the RL recipes
validate, so the numbers compare.

The RL recipes get a policy that is sometimes right when ``model.path`` is null by running this
recipe as a command, briefly, on their data (``rlcore.trainer.warmstart``).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlcore.algos.losses import LossScale, agg_loss
from rlcore.algos.stats import masked_mean
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.rewards.manager import RuleRewardManager
from rlcore.single_controller import Dispatch, register
from rlcore.trainer.builder import build_data, build_workers
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.validation import mean_over_ranks, validate
from rlcore.workers.actor import INPUT_KEYS, ActorWorker

SECTIONS = ("model", "tiny_model", "data", "actor", "rollout", "reward", "trainer")
register_schema("sft_schema", SECTIONS)


class SFTWorker(ActorWorker):
    """The actor plus an NLL update; FSDP, checkpoints and HF export are the actor's own."""

    @register(Dispatch.DP_COMPUTE_METRIC)
    def train_sft(self, data: DataProto) -> dict[str, float]:
        return self.run_updates(data.select(batch_keys=INPUT_KEYS + ["response_mask"]), self._nll, prefix="sft")

    def _nll(self, micro: DataProto, scale: LossScale) -> tuple[torch.Tensor, dict[str, float]]:
        log_prob, _ = self._forward(micro)
        mask = micro.batch["response_mask"]
        return agg_loss(-log_prob, mask, "token-mean", scale), {"nll": masked_mean(-log_prob.detach(), mask).item()}


def check_targets(dataset, response_key: str) -> None:
    """Every row's ``response_key`` is a non-empty string: checked once when the data is loaded, so a
    bad row fails with its number before the first step rather than training on ``"None"``."""
    for row in range(len(dataset)):
        value = dataset[row][response_key]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"data.response_key={response_key!r}: row {row} of the training data has "
                             f"{value!r}; SFT needs a non-empty string reply in every row")


def sft_batch(prompts: DataProto, tokenizer, response_key: str | None = None) -> DataProto:
    """prompts ++ (target + eos), right-padded: the rollout's layout with the target as the response.
    The target is the ``response_key`` column when given, else the answer (ground truth)."""
    targets = prompts.non_tensor_batch[response_key or "ground_truth"]
    answers = [tokenizer(str(a), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in targets]
    width = max(len(a) for a in answers)
    responses = torch.full((len(answers), width), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(answers), width), dtype=torch.long)
    for row, ids in enumerate(answers):
        responses[row, : len(ids)] = torch.tensor(ids)
        response_mask[row, : len(ids)] = 1
    p = prompts.batch
    return DataProto.from_dict({
        "prompts": p["input_ids"], "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([p["input_ids"], responses], 1),
        "attention_mask": torch.cat([p["attention_mask"], response_mask], 1),
        "position_ids": torch.cat([p["position_ids"], p["position_ids"][:, -1:] + 1 + torch.arange(width)], 1),
    }, prompts.non_tensor_batch)


def train(cfg: DictConfig) -> TrainingRun:
    """Run SFT; the trained model is exported as a HF directory to ``<run dir>/hf``."""
    cfg = load_config(cfg, SECTIONS)
    run_dir = Path(cfg.trainer.output_dir) / cfg.trainer.project / cfg.trainer.run_name
    if cfg.model.path is None:  # a fresh tiny model, trained from scratch
        cfg.model.path = build_tiny_model(run_dir.resolve() / "init_model", **OmegaConf.to_container(cfg.tiny_model))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    if cfg.data.response_key:
        check_targets(loader.dataset, cfg.data.response_key)
    workers = build_workers(cfg, ["actor", "rollout"], classes={"actor": SFTWorker})
    reward_fn = RuleRewardManager.from_config(cfg)

    def validate_now() -> dict[str, float]:
        workers.rollout.sync_weights()  # greedy decoding with the weights trained so far
        return validate(workers.rollout, val_batches, reward_fn)

    with TrainingRun(cfg, workers, loader, validate_now) as run:
        for step in run.steps():
            batch = sft_batch(run.next_prompts(), tokenizer, cfg.data.response_key)
            with run.timer("update_actor"):
                metrics = mean_over_ranks(workers.actor.train_sft(batch))
            metrics["response_length/mean"] = batch.batch["response_mask"].sum(-1).double().mean().item()
            run.end_step(step, metrics, batch)
    return run


@hydra.main(config_path="config", config_name="sft", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
