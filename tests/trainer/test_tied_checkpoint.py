"""A model with a tied LM head (SmolLM2's) stores the tied tensor once, in checkpoints and HF exports
(torch.distributed.checkpoint and save_pretrained of gathered copies would write it twice: 113 MB of
each SmolLM2-135M checkpoint and export), and loads back tied: resumed, exported by the command, and
from_pretrained."""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import recipes.grpo
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer import export

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
LENGTH_REWARD = Path(__file__).parent.parent / "recipes" / "length_reward.py"  # a random model's samples score apart


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tied")
    untied = build_tiny_model(folder / "untied", hidden_size=64, num_heads=2, num_kv_heads=1)
    config = AutoConfig.from_pretrained(untied)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(folder / "model")
    for f in Path(untied).iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, folder / "model" / f.name)
    return str(folder / "model")


def grpo(out: Path, model: str, *overrides: str):
    base = [f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", "trainer.val_freq=0", f"model.path={model}",
            "trainer.backend=local", "trainer.total_steps=2", "trainer.save_freq=1", "data.train_batch_size=4",
            "data.arithmetic.n_train=16", "data.arithmetic.n_val=4", "actor.ppo_micro_batch_size_per_gpu=8",
            "rollout.n=2", "rollout.max_new_tokens=4", "actor.lr=1e-2",
            f"reward.reward_fn={LENGTH_REWARD}:reward_by_length"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return recipes.grpo.train(compose("grpo", overrides=[*base, *overrides]))


@pytest.mark.slow
def test_a_tied_head_is_stored_once_and_loads_back_tied(tmp_path, tied_model):
    run = grpo(tmp_path, tied_model)
    ckpt = run.ckpt_dir / "global_step_2"
    saved = dcp.FileSystemReader(str(ckpt / "actor")).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in saved and "model.lm_head.weight" not in saved
    exported = load_file(ckpt / "hf" / "model.safetensors")
    assert "lm_head.weight" not in exported and "model.embed_tokens.weight" in exported
    start = load_file(Path(tied_model) / "model.safetensors")
    assert not torch.equal(exported["model.embed_tokens.weight"], start["model.embed_tokens.weight"])  # trained
    loaded = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    assert torch.equal(loaded.lm_head.weight, exported["model.embed_tokens.weight"])  # tied again on load
    # the command rebuilds step 1's export from its shards, bit for bit (load_checkpoint without the alias)
    export.main([str(run.ckpt_dir / "global_step_1"), "--out", str(tmp_path / "cli")])
    ours, cli = load_file(run.ckpt_dir / "global_step_1" / "hf" / "model.safetensors"), load_file(
        tmp_path / "cli" / "model.safetensors")
    assert ours.keys() == cli.keys() and all(torch.equal(ours[k], cli[k]) for k in ours)
    resumed = grpo(tmp_path, tied_model, "trainer.total_steps=3", "trainer.resume=auto")  # weights + optimizer
    assert resumed.start_step == 2
