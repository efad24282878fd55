"""Online DPO end to end at tiny sizes: pairs are formed, the dpo loss trains, metrics are finite."""

from pathlib import Path

import pytest
from test_recipes import COMMON_RL, check_metrics, config, tiny_model  # noqa: F401  (fixture)

import recipes.online_dpo

pytestmark = pytest.mark.slow
LENGTH_REWARD = Path(__file__).with_name("length_reward.py")


def test_online_dpo_trains_on_pairs(tmp_path, tiny_model):
    # n=4 samples of a random tiny model: most prompts get a best/worst pair with different scores
    # only when some sample is right, so score with a reward that always separates samples.
    cfg = config("online_dpo", tmp_path, f"model.path={tiny_model}", "trainer.backend=local", *COMMON_RL,
                 "rollout.n=4", f"reward.reward_fn={LENGTH_REWARD}:reward_by_length")
    run = recipes.online_dpo.train(cfg)
    rows = check_metrics(run, 2, {"dpo/pairs", "actor/dpo/accuracy", "actor/loss", "val/reward_mean"})
    assert all(r["dpo/pairs"] >= 1 for r in rows[1:])


def test_online_dpo_refuses_shuffled_pairs(tmp_path, tiny_model):
    cfg = config("online_dpo", tmp_path, f"model.path={tiny_model}", "actor.shuffle=true")
    with pytest.raises(ValueError, match="keep actor.shuffle=false"):
        recipes.online_dpo.train(cfg)
