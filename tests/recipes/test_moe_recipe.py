"""GRPO on a tiny Qwen3-MoE policy warm-started by the SFT recipe (``warmstart.arch=qwen3_moe``), with
the load-balancing and z-loss terms and router replay of the HF engine's recorded routing."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipes.grpo  # noqa: E402
from test_recipes import COMMON_RL, RL_KEYS, check_metrics, config  # noqa: E402

pytestmark = pytest.mark.slow

MOE = ["warmstart.arch=qwen3_moe", "actor.router_replay=true", "rollout.record_routing=true",
       "actor.moe_aux_loss_coef=0.01", "actor.moe_z_loss_coef=0.001", "actor.ppo_epochs=2"]


def test_grpo_on_moe_with_aux_loss_and_router_replay(tmp_path):
    cfg = config("grpo", tmp_path, "trainer.backend=local", f"warmstart.dir={tmp_path}/warm", "warmstart.steps=2",
                 *COMMON_RL, *MOE)
    run = recipes.grpo.train(cfg)
    rows = check_metrics(run, 2, RL_KEYS | {"actor/moe_aux_loss", "actor/moe_z_loss", "timing_s/old_log_prob"})
    assert all(r["actor/moe_aux_loss"] >= 2.0 - 1e-6 for r in rows[1:])  # k=2 is the perfectly balanced value
    assert all(r["actor/moe_z_loss"] > 0 for r in rows[1:])
    [marker] = (tmp_path / "warm").glob("*/warmstart.json")
    assert '"model_type": "qwen3_moe"' in (marker.parent / "sft" / "run" / "hf" / "config.json").read_text()
