import gc
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.models.tiny import DEFAULT_CHARS, TINY_PRESETS, build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _char_ids(text: str) -> list[int]:
    return [4 + DEFAULT_CHARS.index(c) for c in text]  # specials take ids 0..3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tokenizer_round_trips_exactly_from_disk(tmp_path, arch):
    out = build_tiny_model(tmp_path, arch=arch, hidden_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.is_fast
    for text in ["12 + 3 = 15", "  a  b\n7-2=5 ", "(x)/y: 1.5%"]:
        ids = tok(text)["input_ids"]
        assert ids == _char_ids(text)
        assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.decode([5, 2, 0], skip_special_tokens=True) == "1"  # '1' is id 4 + 1


def test_unknown_character_maps_to_unk():
    tok = build_char_tokenizer("ab")
    assert tok("aXb")["input_ids"] == [4, 3, 5]


def test_repeated_characters_are_rejected():
    with pytest.raises(ValueError, match="repeat"):
        build_char_tokenizer("aba")


def test_chat_template_renders_role_prefixes(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "user: 2+2=\nassistant: "


def test_model_loads_and_gives_vocab_logits(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok("12+3=")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, len(tok))
    assert len(tok) == 4 + len(DEFAULT_CHARS)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (128, 2, 32)
    assert not cfg.tie_word_embeddings
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    gen = model.generation_config
    assert (gen.pad_token_id, gen.bos_token_id, gen.eos_token_id) == (0, 1, 2)
    # Hand count: embed + lm_head 2*V*128; per layer q,o 128*128, k,v 128*64, mlp 3*128*256,
    # two norms 2*128; final norm 128.
    vocab = len(tok)
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128
    assert sum(p.numel() for p in model.parameters()) == 2 * vocab * 128 + 2 * per_layer + 128


def test_same_seed_same_weights_other_seed_differs(tmp_path, model_dir):
    again = load_file(os.path.join(build_tiny_model(tmp_path / "a", seed=0), "model.safetensors"))
    other = load_file(os.path.join(build_tiny_model(tmp_path / "b", seed=1), "model.safetensors"))
    first = load_file(os.path.join(model_dir, "model.safetensors"))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_small_preset_is_about_25m_parameters():
    s = TINY_PRESETS["small"]
    attn = s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)
    mlp = 3 * s.hidden_size * s.intermediate_size
    assert 24e6 < s.num_layers * (attn + mlp) < 26e6


@pytest.mark.parametrize("bad, error", [
    (dict(head_dim=16), ValueError),
    (dict(num_heads=3, num_kv_heads=2), ValueError),
    (dict(preset="huge"), ValueError),
    (dict(arch="qwen2"), ValueError),
    (dict(hidden=64), TypeError),
])
def test_bad_arguments_raise(tmp_path, bad, error):
    with pytest.raises(error):
        build_tiny_model(tmp_path, **bad)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_greedy_matches_hf_generate(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams

    # An engine an earlier test in this process dropped without closing is shut down by vLLM's finalizer
    # whenever the collector reaches it, destroying the process's parallel groups, which this engine
    # reuses (tests/engines/test_vllm_engine_lifetime.py): let that happen now, before this one is built.
    gc.unfreeze()
    gc.collect()
    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              kv_cache_memory_bytes=256 << 20, seed=0)
    try:
        check_greedy(llm, model_dir, SamplingParams)
    finally:
        llm.llm_engine.engine_core.shutdown()  # now, not at a collection during a later test's engine


def check_greedy(llm, model_dir, SamplingParams) -> None:
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("12 + 3 = 15")) == "12 + 3 = 15"

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = ["12+3=", "7 - 5 = ", "user: hi\nassistant: "]
    outs = llm.generate([{"prompt_token_ids": tok(p)["input_ids"]} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8))
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        ref = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in ref:  # HF pads after eos; vLLM stops there
            ref = ref[: ref.index(tok.eos_token_id) + 1]
        assert list(out.outputs[0].token_ids) == ref
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
