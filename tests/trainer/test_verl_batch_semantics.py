"""Batch sizes mean what verl's mean: ``ppo_mini_batch_size`` counts prompts, the workers get rows.

verl normalises a worker's mini-batch to ``ppo_mini_batch_size * rollout.n // dp_size`` rows per
rank (``verl/workers/fsdp_workers.py``, actor and critic alike), so a step of ``data.train_batch_size``
prompts takes ``train_batch_size / ppo_mini_batch_size * ppo_epochs`` optimizer steps whatever
``rollout.n`` and the ranks are. The expected numbers below are worked out by hand from that rule.
"""

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import recipes.ppo
import recipes.sft
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.trainer.builder import build_workers
from rlcore.trainer.config import ConfigError, load_config, mini_batch_rows, rows_per_prompt, to_worker_config
from rlcore.trainer.validation import mean_over_ranks
from rlcore.typed_config import read_section
from rlcore.workers.config import ActorConfig, CriticConfig

SECTIONS = ("model", "actor", "critic", "rollout", "data", "trainer", "algorithm")
CONFIG_DIR = Path(recipes.sft.__file__).parent / "config"


def run_config(train_batch_size=8, n=4, ranks=1, **actor):
    return load_config({"data": {"train_batch_size": train_batch_size}, "rollout": {"n": n},
                        "trainer": {"procs_per_node": ranks}, "actor": actor}, SECTIONS)


def optimizer_steps(worker_rows: int | None, step_rows: int, ranks: int, epochs: int) -> int:
    """Optimizer steps one rank takes over its share of a step's rows: the mini-batch iterator
    ``FSDPTrainWorker.run_updates`` loops over, fed the mini-batch a worker is handed."""
    share = DataProto.from_dict({"x": torch.arange(step_rows // ranks)})
    per_rank = (worker_rows or step_rows) // ranks
    return len(list(share.make_iterator(per_rank, epochs, seed=0)))


@pytest.mark.parametrize("train_batch_size, n, mini, epochs, ranks, rows, steps", [
    (8, 4, 4, 1, 1, 16, 2),  # 8 prompts x 4 = 32 rows: 2 optimizer steps of 4 prompts = 16 rows
    (8, 4, 2, 2, 2, 8, 8),  # 4 mini-batches of 8 rows (4 per rank), twice
    (8, 4, 8, 1, 1, 32, 1),  # the whole batch in one step
    (8, 4, None, 3, 1, None, 3),  # null: the whole batch, once per epoch
    (6, 1, 3, 1, 1, 3, 2),  # n=1 (SFT): a prompt is one row
])
def test_a_mini_batch_of_prompts_takes_the_optimizer_steps_verl_takes(train_batch_size, n, mini, epochs, ranks,
                                                                       rows, steps):
    cfg = run_config(train_batch_size, n, ranks, ppo_mini_batch_size=mini, ppo_epochs=epochs)
    assert cfg.actor.ppo_mini_batch_size == mini  # the run config keeps the prompts it was given
    assert mini_batch_rows(cfg, "actor") == rows
    worker = to_worker_config(cfg)
    assert worker["actor"]["ppo_mini_batch_size"] == rows
    assert read_section(worker, "actor", ActorConfig).ppo_mini_batch_size == rows  # what the worker reads
    assert optimizer_steps(rows, train_batch_size * n, ranks, epochs) == steps
    if mini is not None:  # verl's rule, the other way round: prompts / mini-batch prompts, per epoch
        assert steps == train_batch_size // mini * epochs


def test_the_critic_counts_prompts_too_and_each_role_keeps_its_own_value():
    cfg = load_config({"data": {"train_batch_size": 8}, "rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 4},
                       "critic": {"ppo_mini_batch_size": 2}}, SECTIONS)
    worker = to_worker_config(cfg)
    assert (worker["actor"]["ppo_mini_batch_size"], worker["critic"]["ppo_mini_batch_size"]) == (16, 8)
    assert read_section(worker, "critic", CriticConfig).ppo_mini_batch_size == 8
    assert to_worker_config(cfg) == worker  # built from the run config each time: never multiplied twice


def test_rows_per_prompt_of_pairs_and_of_sampled_groups():
    dpo = run_config(n=4, policy_loss="dpo", ppo_mini_batch_size=2)
    assert rows_per_prompt(dpo, "actor") == 2 and mini_batch_rows(dpo, "actor") == 4  # one (chosen, rejected) pair
    reward_model = load_config({"data": {"train_batch_size": 8}, "reward_model": {"ppo_mini_batch_size": 4}},
                               ("model", "data", "reward_model", "trainer"))
    assert rows_per_prompt(reward_model, "reward_model") == 1  # a row is a pair already
    assert to_worker_config(reward_model)["reward_model"]["ppo_mini_batch_size"] == 4


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_mini_batch_that_does_not_divide_the_prompts_fails_at_load_naming_both_keys(role):
    with pytest.raises(ConfigError, match=rf"{role}\.ppo_mini_batch_size=3 does not divide data\.train_batch_size=8: "
                                          "both count prompts"):
        load_config({"data": {"train_batch_size": 8}, "rollout": {"n": 4}, role: {"ppo_mini_batch_size": 3}},
                    SECTIONS)
    # 16 was a valid mini-batch when the key counted rows (32 rows / 16: 2 steps); as prompts it is more
    # than the batch holds, and is refused rather than quietly read either way
    with pytest.raises(ConfigError, match=rf"{role}\.ppo_mini_batch_size=16 does not divide data\.train_batch_size=8"):
        load_config({"data": {"train_batch_size": 8}, "rollout": {"n": 4}, role: {"ppo_mini_batch_size": 16}},
                    SECTIONS)


def test_verls_global_micro_batch_key_is_refused_with_what_to_write():
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size=8 is verl's deprecated global micro-batch size: "
                                          r"use ppo_micro_batch_size_per_gpu \(rows per rank\) instead"):
        run_config(ppo_micro_batch_size=8)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):  # a command-line override too
        cfg = compose("ppo", overrides=["critic.ppo_micro_batch_size=16"])
    with pytest.raises(ConfigError, match=r"config section 'critic': ppo_micro_batch_size=16 .* "
                                          r"ppo_micro_batch_size_per_gpu"):
        load_config(cfg, recipes.ppo.SECTIONS)


@pytest.mark.parametrize("key", ["save_freq", "val_freq"])
def test_verls_minus_one_for_never_is_refused_rather_than_read_as_every_step(key):
    with pytest.raises(ConfigError, match=rf"trainer\.{key}=-1: write 0 for never \(verl's -1\)"):
        load_config({"trainer": {key: -1}}, SECTIONS)
    assert load_config({"trainer": {key: 0}}, SECTIONS).trainer[key] == 0


# Global rows per optimizer step of every shipped recipe, as they were when the key counted rows
# (ppo.yaml: 256 rows, now 32 prompts x rollout.n=8); null everywhere else (the whole batch).
SHIPPED_ROWS = {"ppo": {"actor": 256, "critic": 256}, "grpo": {"actor": None}, "dapo": {"actor": None},
                "online_dpo": {"actor": None}, "async_grpo": {"actor": None}, "multi_turn_grpo": {"actor": None},
                "agentic_grpo": {"actor": None}, "chat_agent_grpo": {"actor": None}, "sft": {"actor": None},
                "reward_model": {"reward_model": None}}


@pytest.mark.parametrize("recipe", sorted(SHIPPED_ROWS))
def test_every_shipped_recipe_hands_its_workers_the_rows_it_trained_on_before(recipe):
    module = importlib.import_module(f"recipes.{recipe}")  # registers the recipe's schema
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = load_config(compose(recipe), module.SECTIONS)
    worker = to_worker_config(cfg)
    assert {role: worker[role]["ppo_mini_batch_size"] for role in SHIPPED_ROWS[recipe]} == SHIPPED_ROWS[recipe]
    if recipe == "ppo":  # the yaml's comment: 2 mini-batches x 2 epochs = 4 clipped updates per batch
        step_rows = cfg.data.train_batch_size * cfg.rollout.n
        assert step_rows == 512
        assert optimizer_steps(worker["actor"]["ppo_mini_batch_size"], step_rows, 1, cfg.actor.ppo_epochs) == 4


def test_the_actor_a_recipe_builds_gets_rows_and_takes_verls_steps(tmp_path):
    """Through the builder, as every recipe builds its workers: 8 prompts x 4 samples, mini-batches of
    4 prompts, one epoch: the actor is handed 16 rows and takes 2 AdamW steps on the 32-row batch."""
    model = build_tiny_model(tmp_path / "m", hidden_size=64, num_heads=2, num_kv_heads=1)
    cfg = load_config({"model": {"path": model}, "data": {"train_batch_size": 8}, "rollout": {"n": 4},
                       "trainer": {"backend": "local", "cpus_per_proc": 1, "output_dir": str(tmp_path)},
                       "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8, "lr": 1e-3}},
                      ("model", "actor", "rollout", "data", "trainer"))
    threads = torch.get_num_threads()
    workers = build_workers(cfg, ["actor"])
    try:
        actor = workers.group.worker(0, "actor")
        assert actor.train_cfg.ppo_mini_batch_size == 16
        batch = update_batch(rows=32)
        batch.union(workers.actor.compute_log_prob(batch))
        metrics = mean_over_ranks(workers.actor.update_policy(batch))
        assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
        steps = {int(state["step"]) for state in actor.optimizer.state.values()}
        assert steps == {2}
    finally:
        workers.shutdown()
        torch._C.set_num_threads(threads)


def update_batch(rows: int, prompt_width: int = 3, response_width: int = 2) -> DataProto:
    """A rollout-shaped batch of unpadded rows (token ids >= 4: no special tokens), random advantages."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 60, (rows, prompt_width), generator=g)
    responses = torch.randint(4, 60, (rows, response_width), generator=g)
    width = prompt_width + response_width
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.ones(rows, width, dtype=torch.long),
        "position_ids": torch.arange(width).expand(rows, -1).clone(),
        "response_mask": torch.ones(rows, response_width),
        "advantages": torch.randn(rows, response_width, generator=g),
    })


def test_a_decaying_learning_rate_without_total_steps_spans_the_whole_run():
    """lr_scheduler cosine/linear with total_steps null: the trainer fills in the run's optimizer steps
    (trainer.total_steps x prompts / mini-batch prompts x epochs), so the decay reaches its floor at the
    last update; a total_steps given is kept."""
    from rlcore.workers.optim import lr_multiplier

    cfg = load_config({"data": {"train_batch_size": 8}, "rollout": {"n": 4}, "trainer": {"total_steps": 5},
                       "actor": {"ppo_mini_batch_size": 2, "ppo_epochs": 3, "lr_scheduler": "cosine",
                                 "min_lr_ratio": 0.1},
                       "critic": {"lr_scheduler": "linear"}}, SECTIONS)
    assert cfg.actor.total_steps is None  # the run config keeps what was given
    worker = to_worker_config(cfg)
    assert worker["actor"]["total_steps"] == 5 * (8 // 2) * 3 == 60
    assert worker["critic"]["total_steps"] == 5 * 1 * 1  # null mini-batch: the whole batch, one epoch
    actor = read_section(worker, "actor", ActorConfig)
    multipliers = [lr_multiplier(s, 0, actor.total_steps, "cosine", 0.1) for s in range(60)]
    assert multipliers[0] == 1.0 and multipliers[-1] > 0.1 and lr_multiplier(60, 0, 60, "cosine", 0.1) == pytest.approx(0.1)
    given = load_config({"data": {"train_batch_size": 8}, "actor": {"lr_scheduler": "cosine", "total_steps": 7}},
                        SECTIONS)
    assert to_worker_config(given)["actor"]["total_steps"] == 7


def test_the_default_ppo_run_decays_both_learning_rates_over_its_600_updates():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = load_config(compose(config_name="ppo"), recipes.ppo.SECTIONS)
    worker = to_worker_config(cfg)
    for role in ("actor", "critic"):  # 150 steps x 64 / 32 prompts x 2 epochs
        assert (worker[role]["lr_scheduler"], worker[role]["total_steps"], worker[role]["min_lr_ratio"]) == \
            ("cosine", 600, 0.1)
