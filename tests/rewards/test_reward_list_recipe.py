"""A GRPO run (the real recipe and YAML, tiny sizes, in-process backend) scored by a list of two reward
files, a TRL-style one and a verl-style one, given as Hydra list overrides: each function's mean lands in
metrics.jsonl as reward/<name>/mean, and the row's reward is their weighted sum."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.tracking import read_jsonl_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"

TRL_FILE = '''
def brevity(prompts, completions, ground_truth, **kwargs):
    """1 / (1 + characters): chat completions arrive as [{"role": "assistant", "content": ...}]."""
    assert len(prompts) == len(completions) == len(ground_truth) == len(kwargs["completion_ids"])
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 / (1 + len(t)) for t in texts]
'''
VERL_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(any(ch.isdigit() for ch in solution_str))
'''


def test_grpo_logs_each_reward_function_of_a_weighted_list(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    (tmp_path / "fmt.py").write_text(TRL_FILE)
    (tmp_path / "digits.py").write_text(VERL_FILE)
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.total_steps=2",
                 "trainer.val_freq=2", "data.train_batch_size=4", "data.arithmetic.n_train=16",
                 "data.arithmetic.n_val=4", "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=2",
                 "rollout.max_new_tokens=4", f"model.path={model}", "trainer.backend=local",
                 f"reward.reward_fn=[{tmp_path}/fmt.py:brevity, {tmp_path}/digits.py:compute_score]",
                 "reward.weights=[2.0, 0.5]"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=overrides)
    run = recipes.grpo.train(cfg)
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    trained = [r for r in rows if "reward/mean" in r]
    assert len(trained) == 2
    for r in trained:
        brevity, digits = r["reward/brevity/mean"], r["reward/compute_score/mean"]
        assert 0 < brevity <= 1 and 0 <= digits <= 1
        # every row is scored by both: the mean of the sums is the weighted sum of the means
        assert r["reward/mean"] == pytest.approx(2.0 * brevity + 0.5 * digits, rel=1e-5)
        # full score 2.0 + 0.5: brevity is 1 only for an empty completion, which has no digit
        assert r["reward/frac_correct"] == 0.0
