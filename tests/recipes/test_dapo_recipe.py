"""recipes/dapo.py end to end at a tiny size: the real YAML composed by Hydra with overrides, on the
in-process backend. A reward that ties every group of an even-answer prompt makes dynamic sampling
drop groups and draw more prompts; the counts it logs must add up to the loader's own position in
the checkpoint, and a run stopped at its step-2 checkpoint and resumed must log the uninterrupted
run's step 3 (the extra draws included)."""

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.dapo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.run_checkpoint import load_run_state
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.jsonl_rows import without_machine_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.dapo.__file__).parent / "config"
REWARD = Path(__file__).with_name("dapo_reward.py")
PROMPTS = 4  # data.train_batch_size
CAP = 4  # algorithm.filter_groups.max_num_gen_batches (dapo.yaml)


def config(tmp_path: Path, *overrides: str):
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    digits = list(range(4, 14))  # the digit tokens also end a response: a random model then stops before the limit often
    base = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.val_freq=3", "trainer.backend=local",
            f"model.path={model}", f"data.train_batch_size={PROMPTS}", "data.arithmetic.n_train=16",
            "data.arithmetic.n_val=6", "actor.ppo_micro_batch_size_per_gpu=8", "actor.lr=5e-2", "rollout.n=2",
            "rollout.max_new_tokens=4", f"rollout.stop_token_ids={digits}", "algorithm.overlong_buffer.len=2",
            f"reward.reward_fn={REWARD}:even_answers_tie", "trainer.save_freq=2"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("dapo", overrides=[*base, *overrides])


def test_dapo_draws_prompts_until_groups_with_signal_fill_the_batch_and_resumes_exactly(tmp_path):
    whole = recipes.dapo.train(config(tmp_path, "trainer.run_name=whole", "trainer.total_steps=3"))
    rows = read_jsonl_metrics(whole.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "val/reward_mean" in rows[3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values()), row
    steps = rows[1:]
    for r in steps:
        rounds, drawn = r["dynamic_sampling/gen_rounds"], r["dynamic_sampling/prompts_drawn"]
        assert drawn == rounds * PROMPTS
        kept = round(r["dynamic_sampling/groups_kept_frac"] * drawn)
        assert kept >= PROMPTS or rounds == CAP  # DAPO's stopping rule
        assert r["dynamic_sampling/topped_up_groups"] == max(0, PROMPTS - kept)
        assert r["dynamic_sampling/surplus_groups"] == max(0, kept - PROMPTS)
        assert r["dynamic_sampling/groups_dropped_frac"] == pytest.approx(1 - kept / drawn)
        assert "actor/pg_loss" in r and 0.0 <= r["dapo/overlong_masked_frac"] < 1.0
        assert -1.0 <= r["dapo/overlong_penalty_mean"] <= 0.0
    assert sum(r["dynamic_sampling/groups_dropped_frac"] > 0 for r in steps) >= 2  # even answers were dropped ...
    assert max(r["dynamic_sampling/gen_rounds"] for r in steps) > 1  # ... and made the step draw more prompts
    assert any(r["dapo/overlong_masked_frac"] > 0 for r in steps)  # some responses ran to the limit

    # every round drew one loader batch: the checkpointed loader position counts them all
    state = load_run_state(whole.ckpt_dir / "global_step_2")["loader"]
    batches_per_epoch = 16 // PROMPTS
    assert state["epoch"] * batches_per_epoch + state["position"] == sum(r["dynamic_sampling/gen_rounds"] for r in steps[:2])

    recipes.dapo.train(config(tmp_path, "trainer.run_name=split", "trainer.total_steps=2"))
    resumed = recipes.dapo.train(config(tmp_path, "trainer.run_name=split", "trainer.total_steps=3",
                                        "trainer.resume=auto"))
    assert resumed.start_step == 2
    got = read_jsonl_metrics(resumed.dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    want, have = without_machine_metrics([rows[3], got[3]])
    for row in (want, have):  # the split run also validated at its last step (2), which the whole run did not:
        del row["val/best"], row["val/best_step"]  # its best may come from there
    assert have == want, {k: (want[k], have.get(k)) for k in want if have.get(k) != want[k]}
