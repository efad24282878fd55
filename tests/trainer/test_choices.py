"""The run's open choices (``trainer.device: auto``, ``model.mixed_precision: auto``, a vLLM rollout's
``rollout.dtype: null``) are made by rule on the driver before any worker starts, written into the
config as concrete values with their reasons under ``resolved``, and saved in ``<run>/config.yaml``:
the same command on the same machine chooses the same, and says so."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import recipes.grpo
from rlcore.engines import dtype_choice
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.choices import resolve_choices

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"


@pytest.fixture(scope="module")
def narrow_and_wide(tmp_path_factory):
    """Model directories 128 and 512 wide (the rule's two sides; only config.json is read)."""
    root = tmp_path_factory.mktemp("choice_models")
    return (build_tiny_model(root / "narrow", hidden_size=128, num_layers=1),
            build_tiny_model(root / "wide", hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64, num_layers=1))


def grpo_config(tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose("grpo", overrides=[f"trainer.output_dir={tmp_path}", "trainer.device=auto", *overrides])


@pytest.fixture
def amx_cpu(monkeypatch):
    monkeypatch.setattr(dtype_choice, "native_bf16", lambda device: (True, "AMX tiles"))


def test_width_decides_bf16_on_a_native_bf16_cpu(tmp_path, amx_cpu, narrow_and_wide):
    narrow, wide = narrow_and_wide
    cfg = grpo_config(tmp_path, f"model.path={narrow}", "rollout.backend=vllm")
    record = resolve_choices(cfg)
    # the engine follows the trainer (tests/trainer/test_check_bands.py): fp32 on both sides
    assert cfg.trainer.device == "cpu" and cfg.model.mixed_precision is None and cfg.rollout.dtype == "float32"
    assert record["model.mixed_precision"]["value"] == "float32"
    assert "hidden size 128 < 512" in record["model.mixed_precision"]["why"]
    assert record["rollout.dtype"] == {"value": "float32", "why": "null with vllm: the trainer's compute dtype "
                                       "(float32), so both sides compute alike (AMX tiles)"}
    assert record["trainer.device"]["value"] == "cpu"
    cfg = grpo_config(tmp_path, f"model.path={wide}")
    record = resolve_choices(cfg)
    assert cfg.model.mixed_precision == "bfloat16" and "hidden size 512 >= 512" in record["model.mixed_precision"]["why"]
    assert cfg.rollout.dtype == "bfloat16" and "both sides compute alike" in record["rollout.dtype"]["why"]


def test_no_native_bf16_means_fp32_whatever_the_width(tmp_path, monkeypatch, narrow_and_wide):
    monkeypatch.setattr(dtype_choice, "native_bf16", lambda device: (False, "CPU capability AVX2 (no AVX512-BF16, no AMX)"))
    cfg = grpo_config(tmp_path, f"model.path={narrow_and_wide[1]}", "rollout.backend=vllm")
    record = resolve_choices(cfg)
    assert cfg.model.mixed_precision is None and cfg.rollout.dtype == "float32"
    assert record["model.mixed_precision"]["why"] == "auto: CPU capability AVX2 (no AVX512-BF16, no AMX)"


def test_given_values_are_kept_and_a_second_call_changes_nothing(tmp_path, amx_cpu, narrow_and_wide):
    cfg = grpo_config(tmp_path, f"model.path={narrow_and_wide[1]}", "model.mixed_precision=null",
                      "rollout.backend=vllm", "rollout.dtype=float32", "trainer.device=cpu")
    assert resolve_choices(cfg) == {} and cfg.model.mixed_precision is None and cfg.rollout.dtype == "float32"
    cfg = grpo_config(tmp_path, f"model.path={narrow_and_wide[1]}")
    first = resolve_choices(cfg)
    assert resolve_choices(cfg) == first and OmegaConf.to_container(cfg.resolved) == first


@pytest.mark.slow
def test_two_runs_of_one_command_choose_the_same_and_record_it(tmp_path, monkeypatch, narrow_and_wide):
    """Two GRPO runs of the same overrides on this machine: the same choices in both run folders'
    config.yaml, and the actor really trains in the recorded one."""
    monkeypatch.setattr(dtype_choice, "BF16_MIN_HIDDEN", 128)  # so a narrow model's side depends on this CPU's bf16
    saved = []
    for name in ("first", "second"):
        cfg = grpo_config(tmp_path, f"model.path={narrow_and_wide[0]}", f"trainer.run_name={name}",
                          "trainer.backend=local", "trainer.total_steps=1", "trainer.val_freq=0",
                          "trainer.loggers=[jsonl]", "trainer.export_hf=false", "data.train_batch_size=2",
                          "data.arithmetic.n_train=8", "data.arithmetic.n_val=2", "rollout.n=2",
                          "rollout.max_new_tokens=4", "actor.ppo_micro_batch_size_per_gpu=4")
        run = recipes.grpo.train(cfg)
        saved.append(OmegaConf.to_container(OmegaConf.load(run.dir / "config.yaml")))
        chosen = saved[-1]["resolved"]["model.mixed_precision"]["value"]
        assert (run.workers.actor.worker().compute_dtype or "float32") == chosen
        native = dtype_choice.native_bf16("cpu")[0]
        assert chosen == ("bfloat16" if native else "float32")
    assert saved[0]["resolved"] == saved[1]["resolved"]
    assert saved[0]["model"]["mixed_precision"] == saved[1]["model"]["mixed_precision"]
    assert saved[0]["trainer"]["device"] == "cpu"
