"""algorithm.use_kl_in_reward on the GRPO family: the recipes build the reference and a KL controller,
and log the penalty (they passed no controller and crashed at step 1 before)."""

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.agentic_grpo
import recipes.async_grpo
import recipes.grpo
import recipes.multi_turn_grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.tracking import read_jsonl_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
RECIPES = {"grpo": recipes.grpo, "async_grpo": recipes.async_grpo, "multi_turn_grpo": recipes.multi_turn_grpo}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("kl_model"), hidden_size=32, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_kl_in_reward_trains_and_logs_the_penalty(name, tmp_path, tiny_model):
    overrides = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=0", "trainer.save_freq=0",
                 "data.train_batch_size=2", "data.arithmetic.n_train=8", "data.arithmetic.n_val=2", "rollout.n=2",
                 "rollout.max_new_tokens=3", "actor.ppo_micro_batch_size_per_gpu=4", "algorithm.use_kl_in_reward=true",
                 "algorithm.kl_ctrl.type=adaptive", "actor.use_kl_loss=false", "env.max_total_tokens=32"]
    if name != "multi_turn_grpo":
        overrides.remove("env.max_total_tokens=32")
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(name, overrides=overrides)
    run = RECIPES[name].train(cfg)
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["actor/reward_kl_penalty"]) and row["actor/reward_kl_penalty_coeff"] > 0
        assert "timing_s/ref" in row and "timing_s/old_log_prob" in row


def test_kl_in_reward_on_agentic_grpo(tmp_path, tiny_model, ray_cluster):
    """The agentic recipe also needs the old log-probs then: its engines' own are rollout_log_probs."""
    overrides = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=0", "data.train_batch_size=2",
                 "data.arithmetic.n_train=8", "data.arithmetic.n_val=2", "rollout.n=2", "rollout.max_new_tokens=3",
                 "actor.ppo_micro_batch_size_per_gpu=4", "algorithm.use_kl_in_reward=true", "actor.use_kl_loss=false",
                 "env.max_total_tokens=32", "agentic.cpus_per_engine=1"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("agentic_grpo", overrides=overrides)
    rows = read_jsonl_metrics(recipes.agentic_grpo.train(cfg).dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["actor/reward_kl_penalty"]) and "timing_s/ref" in r for r in rows)
