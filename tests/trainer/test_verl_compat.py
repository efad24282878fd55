"""verl's command-line keys: rewritten to rlcore's with a note, or refused naming what to set."""

from pathlib import Path

import pytest

import recipes.grpo
import recipes.ppo
from rlcore.trainer.config import ConfigError
from rlcore.trainer.verl_compat import translate_overrides

REPO = Path(recipes.grpo.__file__).resolve().parent.parent
GRPO = recipes.grpo.SECTIONS


def test_common_verl_keys_become_rlcore_keys():
    args, notes = translate_overrides([
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.rollout.n=4", "+actor_rollout_ref.model.path=/m",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.name=vllm",
        "trainer.total_training_steps=20", "trainer.n_gpus_per_node=8", "trainer.experiment_name=x",
        "data.max_response_length=256", "custom_reward_function.path=my_reward.py",
        "custom_reward_function.name=score_fn"], GRPO)
    assert args == ["actor.lr=1e-6", "rollout.n=4", "model.path=/m", "actor.ppo_mini_batch_size=8",
                    "rollout.backend=vllm", "trainer.total_steps=20", "trainer.procs_per_node=8",
                    "trainer.run_name=x", "rollout.max_new_tokens=256", "reward.reward_fn=my_reward.py:score_fn"]
    assert "verl key actor_rollout_ref.actor.optim.lr -> rlcore key actor.lr" in notes
    assert notes[-1] == "verl keys custom_reward_function.path/name -> rlcore key reward.reward_fn=my_reward.py:score_fn"


def test_shared_keys_and_non_verl_arguments_pass_unchanged():
    same = ["data.train_batch_size=16", "algorithm.adv_estimator=grpo", "actor.lr=1e-5", "--cfg", "job",
            "hydra.run.dir=/x", "+preset=smollm2", "trainer.save_freq=0"]
    assert translate_overrides(same, GRPO) == (same, [])
    args, _ = translate_overrides(["custom_reward_function.path=r.py"], GRPO)
    assert args == ["reward.reward_fn=r.py:compute_score"]  # verl's default function name


@pytest.mark.parametrize("arg, message", [
    ("trainer.total_epochs=2", "trainer.total_epochs is verl's key.*set trainer.total_steps"),
    ("actor_rollout_ref.actor.no_such_key=1", "actor_rollout_ref.actor.no_such_key is verl's key.*Coming from verl"),
    ("critic.optim.lr=1e-5", "critic.optim.lr is verl's name for critic.lr, which this recipe does not read"),
    ("custom_reward_function.name=f", "custom_reward_function.name needs custom_reward_function.path"),
    ("trainer.default_local_dir=/ckpt", "trainer.default_local_dir is verl's key.*trainer.output_dir"),
])
def test_verl_keys_without_a_counterpart_are_refused_by_name(arg, message):
    with pytest.raises(ConfigError, match=message):
        translate_overrides([arg], GRPO)


def test_critic_keys_map_in_a_recipe_with_a_critic():
    assert translate_overrides(["critic.optim.lr=1e-5"], recipes.ppo.SECTIONS)[0] == ["critic.lr=1e-5"]


def test_the_recipe_command_takes_verl_keys(preloaded_python):
    """Through the command line (``python -m recipes.grpo ARGS``, its argv, exit status and output; ``--cfg job``
    prints the composed config and runs nothing), each in a process of its own forked from an interpreter that
    imported torch & co. once (tests/preloaded_python.py)."""
    def run_recipe(*args):
        return preloaded_python.run("recipes.grpo", *args, cwd=REPO, timeout=120)

    proc = run_recipe("actor_rollout_ref.actor.optim.lr=3e-6", "trainer.total_training_steps=7", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "note: verl key actor_rollout_ref.actor.optim.lr -> rlcore key actor.lr" in proc.stderr
    assert "lr: 3.0e-06" in proc.stdout and "total_steps: 7" in proc.stdout
    refused = run_recipe("trainer.total_epochs=3", "--cfg", "job")
    assert refused.returncode == 2
    assert "error: trainer.total_epochs is verl's key" in refused.stderr and "append" not in refused.stderr


def test_validation_sampling_is_not_mistaken_for_training_sampling():
    assert translate_overrides(["algorithm.norm_adv_by_std_in_grpo=false"], GRPO)[0] == ["algorithm.norm_adv_by_std=false"]
    with pytest.raises(ConfigError, match="validation decodes greedily"):
        translate_overrides(["actor_rollout_ref.rollout.val_kwargs.temperature=0.6"], GRPO)
