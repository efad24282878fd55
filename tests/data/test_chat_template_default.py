"""Plain-string prompts and the chat template: ``data.apply_chat_template=auto`` (the smollm2 preset's)
templates them when the tokenizer has a template, and the run says at load which it does."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
from rlcore.data.dataset import PromptDataset
from rlcore.trainer.builder import build_data
from rlcore.trainer.config import ConfigError, load_config

CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"


@pytest.fixture
def plain_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "3", "data_source": "arithmetic"}) + "\n"
                            for p in ("1+2=", "2+1=")))
    return str(path)


def test_auto_templates_plain_strings_when_the_tokenizer_has_a_template(plain_file, tok):
    assert tok.chat_template  # the tiny model's tokenizer brings one
    chat = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    auto = PromptDataset(plain_file, tok, apply_chat_template="auto")
    assert auto[0]["raw_prompt"] == chat != "1+2="
    assert auto[0]["input_ids"].tolist() == tok(chat, add_special_tokens=False)["input_ids"]
    assert auto.describe() == "2 prompts (2 plain-string prompts through the tokenizer's chat template)"
    off = PromptDataset(plain_file, tok, apply_chat_template=False)
    assert off[0]["raw_prompt"] == "1+2="
    assert off.describe() == "2 prompts (2 plain-string prompts as plain text, no chat template)"
    tok_without = type(tok).from_pretrained(tok.name_or_path)
    tok_without.chat_template = None
    assert PromptDataset(plain_file, tok_without, apply_chat_template="auto")[0]["raw_prompt"] == "1+2="
    with pytest.raises(ValueError, match="apply_chat_template must be true, false, null or 'auto', got 'yes'"):
        PromptDataset(plain_file, tok, apply_chat_template="yes")


def test_the_smollm2_preset_templates_plain_strings_and_the_default_does_not():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        preset = compose("grpo", overrides=["+preset=smollm2"])
        default = compose("grpo")
    assert preset.data.apply_chat_template == "auto"
    assert default.data.apply_chat_template is False  # the tiny model learns raw "a+b=" text
    assert load_config({"data": {"apply_chat_template": "auto"}}, ["data"]).data.apply_chat_template == "auto"
    with pytest.raises(ConfigError, match="data.apply_chat_template must be true, false, null or auto, got 'sometimes'"):
        load_config({"data": {"apply_chat_template": "sometimes"}}, ["data"])


def test_the_run_says_at_load_what_it_feeds_the_model(plain_file, tok, tmp_path, capsys):
    cfg = load_config({"data": {"train_files": plain_file, "val_files": plain_file, "apply_chat_template": "auto",
                                "train_batch_size": 2},
                       "trainer": {"output_dir": str(tmp_path)}}, ["data", "trainer"])
    build_data(cfg, tok)
    out = capsys.readouterr().out
    assert "loading data (data.apply_chat_template=auto)" in out
    assert ("data: train 2 prompts (2 plain-string prompts through the tokenizer's chat template); "
            "validation 2 prompts (2 plain-string prompts through the tokenizer's chat template)") in out
