"""GRPO trained from prompt sources (rlcore.data.sources) on the tiny model: reasoning-gym's chain_sum
with its own score_answer, and a verifiers environment with its rubric, a few steps each; and a run
stopped at its step-2 checkpoint and resumed draws the rows (and logs the metrics) of the uninterrupted
run."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.jsonl_rows import without_machine_metrics

pytestmark = pytest.mark.slow
pytest.importorskip("reasoning_gym")
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
FIXTURES = Path(__file__).parents[1] / "data" / "source_fixtures.py"
TINY = ["trainer.backend=local", "trainer.loggers=[jsonl]", "trainer.val_freq=1", "data.train_batch_size=2",
        "data.source_val_size=4", "data.max_prompt_length=128", "actor.ppo_micro_batch_size_per_gpu=8",
        "rollout.n=2", "rollout.max_new_tokens=4", "rollout.do_sample=true", "actor.ppo_mini_batch_size=2"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("source_model"), hidden_size=64, num_heads=2, num_kv_heads=1)


def grpo(tmp_path, tiny_model, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=[f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", *TINY,
                                         *overrides])
    return recipes.grpo.train(cfg)


def rows(run):
    return without_machine_metrics(read_jsonl_metrics(run.dir / "metrics.jsonl"))


def test_reasoning_gym_trains_and_resumes_to_the_same_rows(tmp_path, tiny_model):
    source = ["data.source=reasoning_gym:chain_sum", "+data.source_kwargs.size=100", "+data.source_kwargs.max_terms=2",
              "trainer.save_freq=2"]
    whole = grpo(tmp_path, tiny_model, *source, "trainer.run_name=whole", "trainer.total_steps=3")
    logged = rows(whole)
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    assert {"reward/reasoning_gym/chain_sum/mean", "val/reward_mean", "actor/pg_loss"} <= logged[1].keys()
    grpo(tmp_path, tiny_model, *source, "trainer.run_name=split", "trainer.total_steps=2")
    resumed = grpo(tmp_path, tiny_model, *source, "trainer.run_name=split", "trainer.total_steps=3",
                   "trainer.resume=auto")
    assert resumed.start_step == 2
    assert resumed.loader.state_dict() == whole.loader.state_dict()  # the same rows drawn, to the same place
    assert rows(resumed)[3] == logged[3]


def test_a_verifiers_environment_trains_with_its_rubric(tmp_path, tiny_model):
    pytest.importorskip("verifiers")
    run = grpo(tmp_path, tiny_model, f"data.source=verifiers:{FIXTURES}:arithmetic_env", "trainer.total_steps=2",
               "data.apply_chat_template=false")
    logged = rows(run)
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert {"reward/verifiers/arithmetic_env/mean", "reward/extra/correct/mean", "reward/extra/tagged/mean"} \
        <= logged[1].keys()


def test_a_multi_turn_verifiers_environment_trains_through_the_env_api(tmp_path, tiny_model):
    """multi_turn_grpo: the environment's rows as the data, its episodes played by
    rlcore.agentic.verifiers_env (env_response between the policy's turns), its rubric as the reward."""
    pytest.importorskip("verifiers")
    import recipes.multi_turn_grpo
    env = f"{FIXTURES}:retry_env"
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("multi_turn_grpo", overrides=[
            f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", *TINY, "trainer.total_steps=2",
            f"data.source=verifiers:{env}", "+data.source_kwargs.multi_turn=true", "data.apply_chat_template=true",
            "env.name=rlcore.agentic.verifiers_env:VerifiersEnv", f"+env.kwargs.environment={env}",
            "+env.kwargs.env_args={max_turns: 2}",
            "env.max_turns=2", "env.max_total_tokens=128"])
    run = recipes.multi_turn_grpo.train(cfg)
    logged = rows(run)
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert {"val/reward_mean", "actor/pg_loss"} <= logged[1].keys()
    # 4 tokens a turn never hold "<answer>x</answer>": every episode is unsolved after the environment's
    # reply, so it takes both turns and its rubric scores 0
    assert logged[1]["episode/turns_mean"] == 2.0 and logged[1]["episode/reward_mean"] == 0.0
