"""ReMax (Li et al. 2023) through recipes/grpo.py with algorithm.adv_estimator=remax: each step also
generates one greedy response per prompt, scores it, and gives every sampled row its prompt's greedy
score as ``reward_baselines``; the advantage of a sampled row is its score minus that baseline."""

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.trainer.advantage import greedy_baselines, greedy_prompts
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.tracking import read_jsonl_metrics

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
TINY_DATA = ["data.train_batch_size=4", "data.arithmetic.n_train=16", "data.arithmetic.n_val=6"]


def test_greedy_baselines_by_hand():
    greedy = DataProto.from_dict({"reward_scores": torch.tensor([1.0, 0.0, 0.5])},
                                 {"uid": np.array(["a", "b", "c"], dtype=object)})
    sampled = DataProto.from_dict({"reward_scores": torch.zeros(5)},
                                  {"uid": np.array(["b", "a", "c", "a", "b"], dtype=object)})
    assert greedy_baselines(sampled, greedy).tolist() == [0.0, 1.0, 0.5, 1.0, 0.0]
    with pytest.raises(KeyError, match=r"no greedy response for prompt uid\(s\) \['z'\]"):
        greedy_baselines(DataProto.from_dict({"x": torch.zeros(1)}, {"uid": np.array(["z"], dtype=object)}), greedy)
    twice = DataProto.from_dict({"reward_scores": torch.zeros(2)}, {"uid": np.array(["a", "a"], dtype=object)})
    with pytest.raises(ValueError, match="one per prompt: 2 rows for 1 uids"):
        greedy_baselines(sampled, twice)


def test_greedy_prompts_decode_greedily_once():
    prompts = DataProto.from_dict({"input_ids": torch.ones(2, 3, dtype=torch.long)}, meta_info={"seed": 7})
    marked = greedy_prompts(prompts)
    settings = SamplingSettings.resolve(RolloutConfig(n=8, do_sample=True), marked.meta_info)
    assert (settings.do_sample, settings.n) == (False, 1)
    assert prompts.meta_info == {"seed": 7}  # the sampled call's prompts are left as they were


@pytest.mark.slow
def test_remax_run_uses_the_greedy_scores_as_baselines(tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    seen = {"greedy": [], "batches": []}
    real_baselines = recipes.grpo.greedy_baselines

    def recording_baselines(batch, greedy):
        seen["greedy"].append(greedy)
        return real_baselines(batch, greedy)

    real_end_step = TrainingRun.end_step

    def recording_end_step(self, step, metrics, batch=None):
        seen["batches"].append(batch)
        return real_end_step(self, step, metrics, batch)

    monkeypatch.setattr(recipes.grpo, "greedy_baselines", recording_baselines)
    monkeypatch.setattr(TrainingRun, "end_step", recording_end_step)
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.total_steps=2",
                 "trainer.val_freq=1", "trainer.backend=local", f"model.path={model}", *TINY_DATA,
                 "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=4", "rollout.max_new_tokens=4",
                 "algorithm.adv_estimator=remax"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("grpo", overrides=overrides)
    run = recipes.grpo.train(cfg)

    assert len(seen["greedy"]) == len(seen["batches"]) == 2
    for greedy, batch in zip(seen["greedy"], seen["batches"]):
        assert len(greedy) == 4 and len(batch) == 16  # one greedy response per prompt; only the samples train
        score_of = dict(zip(greedy.non_tensor_batch["uid"], greedy.batch["reward_scores"].tolist()))
        expected = torch.tensor([score_of[u] for u in batch.non_tensor_batch["uid"]])
        b = batch.batch
        assert torch.equal(b["reward_baselines"], expected)
        # rewards on the last token, gamma 1, no KL in the reward: every valid token's advantage is
        # the row's score minus its prompt's greedy score
        want = (b["reward_scores"] - expected)[:, None].expand_as(b["advantages"])
        mask = b["response_mask"].bool()
        torch.testing.assert_close(b["advantages"][mask], want[mask])
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("timing_s/gen_greedy" in r and np.isfinite(r["actor/grad_norm"]) for r in rows[1:])
