"""The consistency check inside real recipe runs: the clean GRPO run (defaults, trainer in fp32)
stays inside every band (weights compared at step 1 and every trainer.check.weight_checksum_freq
steps, no warning); an engine silently in bf16 (the config: fp32) is named at step 1, a warning by
default, a stop with strict; agentic and async GRPO report tokens by version lag."""

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import recipes.agentic_grpo
import recipes.async_grpo
import recipes.grpo
import rlcore.engines.hf_engine
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.check_bands import FP32
from rlcore.trainer.consistency import ConsistencyError
from rlcore.trainer.tracking import read_jsonl_metrics

pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
# The trainer in fp32 like the engine, whatever this CPU's bf16 (the bf16 pairs: tests/trainer/test_check_bands.py).
FP32_TRAINER = "model.mixed_precision=null"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("check_model"), hidden_size=32, num_heads=2, num_kv_heads=1)


def grpo(tmp_path, tiny_model, *extra):
    overrides = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", FP32_TRAINER, "trainer.total_steps=3", "trainer.val_freq=0", "trainer.save_freq=0",
                 "trainer.export_hf=false", "data.train_batch_size=4", "data.arithmetic.n_train=8",
                 "data.arithmetic.n_val=2", "rollout.n=4", "rollout.max_new_tokens=4",
                 "actor.ppo_micro_batch_size_per_gpu=8", "trainer.check.weight_checksum_freq=2", *extra]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return recipes.grpo.train(compose("grpo", overrides=overrides))


def test_clean_default_run_stays_inside_every_band(tmp_path, tiny_model, capfd):
    rows = read_jsonl_metrics(grpo(tmp_path, tiny_model).dir / "metrics.jsonl")
    band = FP32
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["check/tokens"] > 0 and row["check/nan_rewards"] == 0
        assert row["check/logprob_abs_diff_mean"] <= band.abs_diff_mean
        assert row["check/ratio_out_of_band"] <= band.out_of_band
        assert math.isfinite(row["check/logprob_abs_diff_max"]) and "timing_s/check" in row
    # compared at step 1 and step 2 (freq 2), every tensor equal; not at step 3
    assert [r.get("check/weights_mismatch") for r in rows] == [0.0, 0.0, None]
    assert rows[0]["check/weights_checked"] > 10
    assert "consistency check" not in capfd.readouterr().err


@pytest.fixture
def silently_bf16_engine(monkeypatch):
    """The HF engine loads bf16 whatever rollout.dtype says (the config: fp32 on both sides)."""
    monkeypatch.setattr(rlcore.engines.hf_engine, "torch_dtype", lambda name, what="dtype": torch.bfloat16)


def test_bf16_engine_is_named_at_step_1_and_strict_stops(tmp_path, tiny_model, capfd, silently_bf16_engine):
    rows = read_jsonl_metrics(grpo(tmp_path / "warn", tiny_model).dir / "metrics.jsonl")
    assert len(rows) == 3 and rows[0]["check/logprob_abs_diff_mean"] > FP32.abs_diff_mean
    err = capfd.readouterr().err
    assert err.count("WARNING consistency check") == 1  # once per cause, not every step
    assert "step 1:" in err and "dtype differs from the configuration (engine bfloat16, trainer float32" in err
    with pytest.raises(ConsistencyError, match=r"step 1: .*dtype differs.*strict=true"):
        grpo(tmp_path / "strict", tiny_model, "trainer.check.strict=true")


def test_agentic_run_checks_engine_servers_and_reports_lags(tmp_path, tiny_model, ray_cluster, capfd):
    """Engine servers (Ray actors) report checksums of their weights after each bucketed push, and
    tokens carry policy versions: the bands judge the current version's tokens, stale ones are by lag."""
    overrides = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", FP32_TRAINER, "trainer.total_steps=3", "trainer.val_freq=0", "data.train_batch_size=2",
                 "data.arithmetic.n_train=8", "data.arithmetic.n_val=2", "rollout.n=2", "rollout.max_new_tokens=3",
                 "actor.ppo_micro_batch_size_per_gpu=4", "env.max_total_tokens=32", "agentic.cpus_per_engine=1",
                 "trainer.check.weight_checksum_freq=2", "trainer.export_hf=false"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("agentic_grpo", overrides=overrides)
    rows = read_jsonl_metrics(recipes.agentic_grpo.train(cfg).dir / "metrics.jsonl")
    assert [r.get("check/weights_mismatch") for r in rows] == [0.0, 0.0, None]
    for row in rows:
        lags = sum(v for k, v in row.items() if k.startswith("check/tokens/lag_"))
        assert lags == row["check/tokens"] and row["check/tokens/lag_0"] > 0
        assert row["check/logprob_abs_diff_mean/lag_0"] <= FP32.abs_diff_mean
    assert "consistency check" not in capfd.readouterr().err


def test_async_grpo_judges_current_version_rows_only(tmp_path, tiny_model, capfd):
    """The recipe stamps each row's version on its tokens: the check reports them by lag (the lag
    rule itself: tests/trainer/test_consistency_faults.py)."""
    overrides = [f"model.path={tiny_model}", f"trainer.output_dir={tmp_path}", "trainer.backend=local",
                 "trainer.loggers=[jsonl]", FP32_TRAINER, "trainer.total_steps=3", "trainer.val_freq=0", "trainer.export_hf=false",
                 "data.train_batch_size=2", "data.arithmetic.n_train=8", "data.arithmetic.n_val=2", "rollout.n=2",
                 "rollout.max_new_tokens=3", "actor.ppo_micro_batch_size_per_gpu=4", "actor.lr=0.05"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("async_grpo", overrides=overrides)
    rows = read_jsonl_metrics(recipes.async_grpo.train(cfg).dir / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        lags = {k: v for k, v in row.items() if k.startswith("check/tokens/lag_")}
        assert sum(lags.values()) == row["check/tokens"] and set(lags) <= {"check/tokens/lag_0", "check/tokens/lag_1"}
        if "check/tokens/lag_0" in row:
            assert row["check/logprob_abs_diff_mean/lag_0"] <= FP32.abs_diff_mean
    assert "consistency check" not in capfd.readouterr().err
