"""The 8 GB laptop preset is the SmolLM2 preset with gradient checkpointing and no logits kept for the backward,
and nothing else: both trade time for memory."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import recipes.grpo

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"


def _flat(cfg, prefix=""):
    out = {}
    for key, value in cfg.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_the_laptop_preset_is_the_smollm2_preset_with_gradient_checkpointing_and_no_kept_logits():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        laptop = compose("grpo", overrides=["+preset=smollm2_laptop"])
        preset = compose("grpo", overrides=["+preset=smollm2"])
        overridden = compose("grpo", overrides=["+preset=smollm2_laptop", "model.gradient_checkpointing=false"])
    a, b = _flat(OmegaConf.to_container(laptop)), _flat(OmegaConf.to_container(preset))
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {"model.gradient_checkpointing", "actor.keep_logits_mb"}
    assert a["actor.keep_logits_mb"] == 0  # the head recomputes its logits (actor.keep_logits_mb: 128 MiB kept by default)
    assert a["model.gradient_checkpointing"] is True and b["model.gradient_checkpointing"] is False
    assert a["trainer.release_memory"] is True  # the heap and the idle KV cache handed back: its peak counts on it
    assert a["trainer.trim_in_update"] is True  # and inside the update too (the SmolLM2 preset's own setting)
    assert overridden.model.gradient_checkpointing is False  # overrides after it still win
