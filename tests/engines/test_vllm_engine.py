"""vLLM engine against the HF engine and hand-computed log-probs (one fp32 engine, CPU), both in
the trainer's layout (the rollout worker with backend=vllm: tests/workers/test_rollout_vllm.py).

Tolerance: with an fp32 engine vLLM's log-probs agree with HF's / a hand log_softmax to within
1e-5 (measured: <= 5e-7 on the tiny model); greedy tokens agree exactly.
"""

import mmap

import pytest
import torch
from engine_fixtures import PROMPTS, generate, hand_log_probs, make_prompts, settings, unpadded

from rlcore.engines import RolloutConfig, SamplingSettings, build_engine
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW = 16
KV_TOKENS = 5000  # rollout.kv_cache_tokens: 156 whole blocks of 32 tokens (rlcore's CPU block size)
LOGPROB_TOL = 1e-5
LAYOUT_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids")


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    from rlcore.engines.vllm_engine import VLLMEngine

    # rollout.block_size left null: rlcore's CPU default of 32-token KV blocks (vLLM's own is 128), so the
    # prefix cache can share a short prompt's blocks (test_the_rows_of_a_prompt_share_its_prefill_through_the_prefix_cache)
    cfg = RolloutConfig(backend="vllm", dtype="float32", max_new_tokens=MAX_NEW, kv_cache_tokens=KV_TOKENS,
                        max_model_len=128)
    engine = build_engine(ModelConfig(path=model_dir), cfg)
    assert isinstance(engine, VLLMEngine)
    return engine


@pytest.fixture(scope="module")
def hf_engine(model_dir):
    return HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW))


GREEDY = settings(do_sample=False, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def hf_greedy(hf_engine, tok):
    return generate(hf_engine, make_prompts(tok), GREEDY)


def _stop_settings(kind: str, hf_greedy, tok) -> SamplingSettings:
    """Stop conditions taken from the greedy continuations themselves, so that they do fire."""
    responses = hf_greedy.batch["responses"]
    if kind == "greedy":
        return GREEDY
    if kind == "stop_token_ids":
        return settings(do_sample=False, max_new_tokens=MAX_NEW,
                        stop_token_ids=tuple(sorted({int(r[5]) for r in responses[:2]})))
    text = tok.decode(responses[1], skip_special_tokens=True)
    return settings(do_sample=False, max_new_tokens=MAX_NEW, stop=(text[3:5], "never"))  # spans two tokens


@pytest.mark.parametrize("kind", ["greedy", "stop_token_ids", "stop_string"])
def test_greedy_matches_hf_token_for_token(vllm_engine, hf_engine, hf_greedy, tok, kind):
    sampling = _stop_settings(kind, hf_greedy, tok)
    out_v = generate(vllm_engine, make_prompts(tok), sampling)
    out_h = generate(hf_engine, make_prompts(tok), sampling)
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


def test_its_norms_run_on_the_cpu_builds_fused_kernels(vllm_engine, hf_greedy, tok):
    """rlcore.engines.vllm_cpu_norm: every decoder layer's norms go through vLLM's compiled CPU kernels
    (seen as ops in the profile, none of the native math's ``pow``), and greedy output is HF's still."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = generate(vllm_engine, make_prompts(tok), GREEDY)
    ops = {event.key: event.count for event in prof.key_averages()}
    assert ops.get("_C::fused_add_rms_norm", 0) > 0 and ops.get("_C::rms_norm", 0) > 0
    assert "aten::pow" not in ops
    assert torch.equal(out.batch["responses"], hf_greedy.batch["responses"])


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5},
                                    {"temperature": 1.3, "top_p": 0.3}])
def test_sampled_log_probs_are_processed_log_probs(vllm_engine, tok, ref_model, params):
    """vLLM's reported log-prob of each sampled token = log_softmax(filter(logits / T)) by hand."""
    prompts = make_prompts(tok)
    out = generate(vllm_engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW, **params))
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        length = int(out.batch["response_mask"][row].sum())
        response = out.batch["responses"][row, :length].tolist()
        expected = hand_log_probs(ref_model, prompt, response, **params)
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, :length], expected, atol=LOGPROB_TOL, rtol=0)
        assert (out.batch["rollout_log_probs"][row, length:] == 0).all()


def test_repeated_prompts_get_distinct_samples(vllm_engine, tok):
    out = generate(vllm_engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW), repeat=4)
    assert len(out) == 4 * len(PROMPTS)
    responses = out.batch["responses"].view(len(PROMPTS), 4, MAX_NEW)
    for group in responses:  # 4 samples of 16 tokens from a near-uniform model: all different
        assert len({tuple(r.tolist()) for r in group}) == 4
    assert out.meta_info["rollout/tokens_per_s"] > 0


def test_a_seeded_call_samples_the_same_whatever_came_before(vllm_engine, tok):
    """settings.seed: each row's request gets a seed from (seed, rank, repeat count, row), so a call
    repeats exactly after unseeded and other-seeded calls, while rows (the n samples of a prompt too)
    and seeds differ."""

    def responses(seed):
        sample = settings(max_new_tokens=MAX_NEW, seed=seed)
        return generate(vllm_engine, make_prompts(tok), sample, repeat=2).batch["responses"]

    first = responses(11)
    responses(None)
    other = responses(12)
    assert torch.equal(responses(11), first)
    assert not torch.equal(other, first)
    assert not torch.equal(first[0::2], first[1::2])
    assert not torch.equal(responses(11), first)  # the same seed twice in a row: the next turn, drawn anew


def test_ignore_eos_gives_full_length_responses(vllm_engine, tok):
    stopped = generate(vllm_engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW), repeat=8)
    lengths = stopped.batch["response_mask"].sum(1)
    ends = stopped.batch["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert (lengths < MAX_NEW).any() and (ends[lengths < MAX_NEW] == tok.eos_token_id).all()

    full = generate(vllm_engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW, ignore_eos=True), repeat=8)
    assert (full.batch["response_mask"] == 1).all()
    assert (full.batch["responses"][:, :-1] == tok.eos_token_id).any()  # eos inside a response, which went on


def test_ids_and_partial_weight_updates_are_refused(vllm_engine, hf_engine, ref_model):
    assert (vllm_engine.pad_token_id, vllm_engine.eos_token_id) == (hf_engine.pad_token_id, hf_engine.eos_token_id)
    state = ref_model.state_dict()
    assert vllm_engine.weight_names == set(state)
    with pytest.raises(KeyError, match="1 missing"):
        vllm_engine.load_weights({k: v for k, v in state.items() if "lm_head" not in k})
    with pytest.raises(KeyError, match="1 unexpected"):
        vllm_engine.load_weights({**state, "extra.weight": torch.zeros(1)})


def test_kv_cache_tokens_sizes_the_cache_in_tokens(vllm_engine, model_dir):
    """The engine's cache holds rollout.kv_cache_tokens, rounded down to whole blocks: the bytes per token
    rlcore computes from the model's shape are the ones vLLM allocates."""
    from transformers import AutoConfig

    from rlcore.engines.kv_cache_size import kv_cache_bytes

    cache = vllm_engine.llm.llm_engine.vllm_config.cache_config
    assert cache.num_gpu_blocks == KV_TOKENS // cache.block_size
    per_token = kv_cache_bytes(AutoConfig.from_pretrained(model_dir), torch.float32)
    assert cache.kv_cache_memory_bytes == KV_TOKENS * per_token


LONG_PROMPTS = ["12+3=" * 9, "7*8=" * 10, "100-99=" * 6]  # 45, 40, 42 characters: one full 32-token block each


def test_the_rows_of_a_prompt_share_its_prefill_through_the_prefix_cache(vllm_engine, hf_engine, tok, ref_model):
    """rollout.block_size null (the fixture's): 32-token KV blocks on CPU, so a group's rows find the first row's
    prompt block in the prefix cache (in the same step) instead of computing it again; what they sample
    is unchanged: greedy = the HF engine's, sampled log-probs = the teacher-forced ones."""
    from rlcore.engines.shared_prompt import SHARED_BLOCK_SIZE

    assert vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size == SHARED_BLOCK_SIZE
    kept = []
    generate_requests = vllm_engine.llm.generate

    def keep(*args, **kwargs):  # the call's RequestOutputs, for their num_cached_tokens
        kept.append(generate_requests(*args, **kwargs))
        return kept[-1]

    prompts, n = make_prompts(tok, LONG_PROMPTS), 4
    vllm_engine.llm.generate = keep
    try:
        vllm_engine.llm.reset_prefix_cache()  # as after a weight sync
        out_v = generate(vllm_engine, prompts, GREEDY, repeat=n)
        cached = [o.num_cached_tokens for o in kept[-1]]
        vllm_engine.llm.reset_prefix_cache()
        sampled = generate(vllm_engine, prompts, settings(max_new_tokens=MAX_NEW, temperature=0.7, seed=3), repeat=n)
    finally:
        del vllm_engine.llm.generate
    # each prompt computed once: its first row misses, the other n - 1 find its one full block
    assert cached == [0] + [SHARED_BLOCK_SIZE] * (n - 1) + [0] + [SHARED_BLOCK_SIZE] * (n - 1) \
        + [0] + [SHARED_BLOCK_SIZE] * (n - 1)
    out_h = generate(hf_engine, prompts, GREEDY, repeat=n)
    for key in LAYOUT_KEYS:
        assert torch.equal(out_v.batch[key], out_h.batch[key]), key
    torch.testing.assert_close(out_v.batch["rollout_log_probs"], out_h.batch["rollout_log_probs"], atol=LOGPROB_TOL, rtol=0)
    for row in range(len(LONG_PROMPTS) * n):
        prompt = unpadded(prompts.batch["input_ids"][row // n], prompts.batch["attention_mask"][row // n])
        length = int(sampled.batch["response_mask"][row].sum())
        response = sampled.batch["responses"][row, :length].tolist()
        expected = hand_log_probs(ref_model, prompt, response, temperature=0.7)
        torch.testing.assert_close(sampled.batch["rollout_log_probs"][row, :length], expected, atol=LOGPROB_TOL, rtol=0)


def test_the_idle_kv_cache_is_given_back_and_the_next_generation_is_unchanged(vllm_engine, tok):
    """release_idle_memory (trainer.release_memory, between a step's generation and its update): the
    cache's pages go back to the machine (they read as zeros, as at start-up) and the prefix cache is
    reset with them, so rows whose prompt block was cached before sample exactly as before."""
    cache = vllm_engine.llm.collective_rpc(lambda worker: worker.model_runner.kv_caches[0])[0]  # in this process
    whole = torch.empty(0, dtype=torch.uint8).set_(cache.untyped_storage())  # every layer's blocks, one allocation
    prompts = make_prompts(tok, LONG_PROMPTS)  # one full 32-token block each: in the prefix cache after a call
    vllm_engine.llm.reset_prefix_cache()
    first = generate(vllm_engine, prompts, GREEDY, repeat=2)
    assert bool(whole.any())  # the call wrote its blocks
    released = vllm_engine.release_idle_memory()
    assert whole.numel() - 2 * mmap.PAGESIZE <= released <= whole.numel()
    start = -whole.data_ptr() % mmap.PAGESIZE  # whole pages only: a partial first or last page keeps its bytes
    assert not bool(whole[start:start + released].any())
    again = generate(vllm_engine, prompts, GREEDY, repeat=2)
    for key in LAYOUT_KEYS + ("rollout_log_probs",):
        assert torch.equal(again.batch[key], first.batch[key]), key
