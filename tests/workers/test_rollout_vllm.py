"""vLLM rollout backend against the HF backend and hand-computed log-probs (one fp32 engine, CPU).

Tolerance: with an fp32 engine vLLM's log-probs agree with HF's / a hand log_softmax to within
1e-5 (measured: <= 5e-7 on the tiny model); greedy tokens agree exactly.
"""

import pytest
import torch
from rollout_fixtures import PROMPTS, hand_log_probs, local_rollout, make_prompts, unpadded
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.models.tiny import build_tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW = 16
LOGPROB_TOL = 1e-5
LAYOUT_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def vllm_wg(model_dir):
    return local_rollout(model_dir, backend="vllm", dtype="float32", max_new_tokens=MAX_NEW,
                         kv_cache_memory_bytes=1 << 28, max_model_len=128)


@pytest.fixture(scope="module")
def hf_wg(model_dir):
    return local_rollout(model_dir, backend="hf", max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def hf_greedy(hf_wg, tok):
    return hf_wg.generate_sequences(make_prompts(tok, meta_info={"validate": True}))


def _stop_meta(kind: str, hf_greedy, tok) -> dict:
    """Stop conditions taken from the greedy continuations themselves, so that they do fire."""
    responses = hf_greedy.batch["responses"]
    if kind == "greedy":
        return {"validate": True}
    if kind == "stop_token_ids":
        return {"do_sample": False, "stop_token_ids": sorted({int(r[5]) for r in responses[:2]})}
    text = tok.decode(responses[1], skip_special_tokens=True)
    return {"do_sample": False, "stop": [text[3:5], "never"]}  # a stop string spanning two tokens


@pytest.mark.parametrize("kind", ["greedy", "stop_token_ids", "stop_string"])
def test_greedy_matches_hf_token_for_token(vllm_wg, hf_wg, hf_greedy, tok, kind):
    meta = _stop_meta(kind, hf_greedy, tok)
    out_v = vllm_wg.generate_sequences(make_prompts(tok, meta_info=meta))
    out_h = hf_wg.generate_sequences(make_prompts(tok, meta_info=meta))
    for key in LAYOUT_KEYS:
        assert torch.equal(out_v.batch[key], out_h.batch[key]), key
    torch.testing.assert_close(out_v.batch["rollout_log_probs"], out_h.batch["rollout_log_probs"],
                               atol=LOGPROB_TOL, rtol=0)
    assert list(out_v.non_tensor_batch["uid"]) == list(out_h.non_tensor_batch["uid"])
    lengths = out_v.batch["response_mask"].sum(1)
    if kind == "greedy":
        assert torch.equal(out_v.batch["responses"], hf_greedy.batch["responses"])
    else:
        assert lengths[1] <= 6 and (lengths[1:] < MAX_NEW).any()  # the stop condition fired, identically


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5},
                                    {"temperature": 1.3, "top_p": 0.3}])
def test_sampled_log_probs_are_processed_log_probs(vllm_wg, tok, ref_model, params):
    """vLLM's reported log-prob of each sampled token = log_softmax(filter(logits / T)) by hand."""
    prompts = make_prompts(tok)
    out = vllm_wg.generate_sequences(make_prompts(tok, meta_info=params))
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        length = int(out.batch["response_mask"][row].sum())
        response = out.batch["responses"][row, :length].tolist()
        expected = hand_log_probs(ref_model, prompt, response, **params)
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, :length], expected, atol=LOGPROB_TOL, rtol=0)
        assert (out.batch["rollout_log_probs"][row, length:] == 0).all()


def test_n_samples_adjacent_and_distinct(vllm_wg, tok):
    out = vllm_wg.generate_sequences(make_prompts(tok, meta_info={"n": 4}))
    assert len(out) == 4 * len(PROMPTS)
    assert list(out.non_tensor_batch["uid"]) == [f"p{i}" for i in range(len(PROMPTS)) for _ in range(4)]
    assert torch.equal(out.batch["prompts"], make_prompts(tok).batch["input_ids"].repeat_interleave(4, dim=0))
    responses = out.batch["responses"].view(len(PROMPTS), 4, MAX_NEW)
    for group in responses:  # 4 samples of 16 tokens from a near-uniform model: all different
        assert len({tuple(r.tolist()) for r in group}) == 4
    assert out.meta_info["rollout/tokens_per_s"] > 0


def test_ignore_eos_gives_full_length_responses(vllm_wg, tok):
    stopped = vllm_wg.generate_sequences(make_prompts(tok, meta_info={"n": 8}))
    lengths = stopped.batch["response_mask"].sum(1)
    ends = stopped.batch["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert (lengths < MAX_NEW).any() and (ends[lengths < MAX_NEW] == tok.eos_token_id).all()

    full = vllm_wg.generate_sequences(make_prompts(tok, meta_info={"n": 8, "ignore_eos": True}))
    assert (full.batch["response_mask"] == 1).all()
    assert (full.batch["responses"][:, :-1] == tok.eos_token_id).any()  # eos inside a response, which went on
