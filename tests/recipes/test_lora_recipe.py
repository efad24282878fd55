"""GRPO with a LoRA actor (actor.lora.rank=8), end to end at a tiny size on the in-process backend.

The actor is its own reference (adapters off), so no ref worker is built; at the first update the
adapters are still zero (B = 0), so the KL to the reference is exactly 0 (one optimizer step per
batch: the whole update sees the starting weights), and it is positive once they train. A run
stopped at its step-2 checkpoint (adapters + their Adam state) and resumed logs the uninterrupted
run's metrics at steps 3-4 exactly.
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.builder import build_workers
from rlcore.trainer.config import load_config
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.jsonl_rows import without_machine_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
LENGTH_REWARD = Path(__file__).with_name("length_reward.py")  # random-model samples must score apart
LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "actor.lr=5e-2"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("lora_recipe_model"), hidden_size=64, num_heads=2, num_kv_heads=1)


def grpo_config(tmp_path, model, *overrides):
    base = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.val_freq=1", f"model.path={model}",
            "trainer.backend=local", "data.train_batch_size=4", "data.arithmetic.n_train=16", "data.arithmetic.n_val=6",
            "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=2", "rollout.max_new_tokens=4", "rollout.do_sample=true",
            f"reward.reward_fn={LENGTH_REWARD}:reward_by_length", *LORA]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("grpo", overrides=[*base, *overrides])


def test_a_lora_actor_is_its_own_reference(tmp_path, tiny_model):
    cfg = load_config(grpo_config(tmp_path, tiny_model), recipes.grpo.SECTIONS)
    workers = build_workers(cfg, ["actor", "rollout", "ref"])
    try:
        assert workers.ref is workers.actor and workers.roles == ["actor", "rollout"]
        assert workers.group.worker(0, "actor").lora
    finally:
        workers.shutdown()


def test_grpo_with_lora_trains_and_resumes_to_the_same_metrics(tmp_path, tiny_model):
    whole = recipes.grpo.train(grpo_config(tmp_path, tiny_model, "trainer.run_name=whole", "trainer.total_steps=4"))
    split = ["trainer.run_name=split", "trainer.save_freq=2"]
    recipes.grpo.train(grpo_config(tmp_path, tiny_model, *split, "trainer.total_steps=2"))
    resumed = recipes.grpo.train(grpo_config(tmp_path, tiny_model, *split, "trainer.total_steps=4",
                                             "trainer.resume=auto"))
    assert resumed.start_step == 2

    def comparable(run):
        rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
        return without_machine_metrics(rows)

    expected, got = comparable(whole), comparable(resumed)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
    for want, have in zip(expected[3:], got[3:]):
        assert have == want, {k: (want[k], have.get(k)) for k in want if have.get(k) != want[k]}
    kl = [r["actor/kl_loss"] for r in expected[1:]]
    assert kl[0] == 0.0 and all(k > 0 for k in kl[1:]), kl  # zero adapters at step 1, then the policy moves
    assert all(r["actor/grad_norm"] > 0 for r in expected[1:])
