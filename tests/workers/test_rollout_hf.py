"""RolloutWorker with the HF engine: sampling settings from config and meta_info, n samples, DP
dispatch over ranks, weight updates and errors (the engine itself: tests/engines/test_hf_engine.py)."""

import pytest
import torch
from rollout_fixtures import PROMPTS, generate, hand_greedy, local_rollout, make_prompts, unpadded
from transformers import AutoModelForCausalLM

from rlcore.engines import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.rollout import RolloutWorker

MAX_NEW = 10


@pytest.fixture(scope="module")
def rollout(model_dir):
    return local_rollout(model_dir, max_new_tokens=MAX_NEW, seed=0)


def test_generate_sequences_is_the_engines_generation_in_the_trainers_layout(rollout, model_dir, tok):
    """Greedy through the worker = a bare HF engine's greedy rows through the layout, plus the metrics."""
    assert isinstance(rollout.worker(0).engine, HFEngine)
    out = rollout.generate_sequences(make_prompts(tok, meta_info={"do_sample": False}))
    engine = HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW),
                      device=rollout.worker(0).engine.device)  # the same kernels: bitwise equal
    ref = generate(engine, make_prompts(tok), SamplingSettings.resolve(RolloutConfig(max_new_tokens=MAX_NEW),
                                                                      {"do_sample": False}))
    assert set(out.batch.keys()) == set(ref.batch.keys())
    for key in ref.batch.keys():
        assert torch.equal(out.batch[key], ref.batch[key]), key
    assert list(out.non_tensor_batch["uid"]) == ["p0", "p1", "p2", "p3"]
    assert list(out.non_tensor_batch["raw_prompt"]) == PROMPTS
    assert out.meta_info["rollout/num_generated_tokens"] == int(out.batch["response_mask"].sum())
    assert out.meta_info["rollout/gen_time_s"] > 0 and out.meta_info["rollout/tokens_per_s"] > 0
    assert out.meta_info["temperature"] == 1.0


def test_n_samples_are_adjacent_repeats(rollout, tok):
    prompts = make_prompts(tok)
    out = rollout.generate_sequences(make_prompts(tok, meta_info={"n": 3}))
    assert len(out) == 3 * len(PROMPTS)
    assert list(out.non_tensor_batch["uid"]) == [f"p{i}" for i in range(len(PROMPTS)) for _ in range(3)]
    assert list(out.non_tensor_batch["raw_prompt"]) == [p for p in PROMPTS for _ in range(3)]
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    # Independent samples: the 3 responses of a prompt are not all the same.
    responses = out.batch["responses"].view(len(PROMPTS), 3, MAX_NEW)
    assert not all(torch.equal(r[0], r[1]) and torch.equal(r[1], r[2]) for r in responses)


def test_validate_is_greedy_single_sample_and_overrides_length(rollout, tok):
    greedy = rollout.generate_sequences(make_prompts(tok, meta_info={"do_sample": False}))
    val = rollout.generate_sequences(make_prompts(tok, meta_info={"validate": True, "max_new_tokens": 4}))
    assert val.batch["responses"].shape == (len(PROMPTS), 4)
    assert torch.equal(val.batch["responses"], greedy.batch["responses"][:, :4])
    assert val.meta_info["validate"] is True  # the input's meta_info travels on
    assert val.meta_info["temperature"] == 1.0  # greedy log-probs are those of the plain softmax
    # validate with an explicit n / do_sample: pass@k sampling, n adjacent rows per prompt.
    sampled = rollout.generate_sequences(make_prompts(tok, meta_info={"validate": True, "do_sample": True, "n": 2}))
    assert len(sampled) == 2 * len(PROMPTS)


def test_output_records_the_sampling_temperature(model_dir, tok):
    wg = local_rollout(model_dir, max_new_tokens=MAX_NEW, temperature=0.7)
    assert wg.generate_sequences(make_prompts(tok)).meta_info["temperature"] == 0.7
    assert wg.generate_sequences(make_prompts(tok, meta_info={"temperature": 1.2})).meta_info["temperature"] == 1.2


def test_sampling_is_seeded_and_leaves_global_rng_alone(model_dir, tok):
    a = local_rollout(model_dir, max_new_tokens=MAX_NEW, seed=7)
    b = local_rollout(model_dir, max_new_tokens=MAX_NEW, seed=7)
    state = torch.get_rng_state()
    out_a = a.generate_sequences(make_prompts(tok))
    assert torch.equal(torch.get_rng_state(), state)
    out_b = b.generate_sequences(make_prompts(tok))
    assert torch.equal(out_a.batch["responses"], out_b.batch["responses"])
    again = a.generate_sequences(make_prompts(tok))  # the stream moves on: a new draw
    assert not torch.equal(again.batch["responses"], out_a.batch["responses"])


def test_two_ranks_with_padding_match_one_rank(model_dir, tok, rollout):
    """DP dispatch: 3 prompts x n=2 over 2 ranks (padded to 4 prompts) give one rank's greedy rows."""
    texts = PROMPTS[:3]
    meta = {"do_sample": False, "n": 2}
    one = rollout.generate_sequences(make_prompts(tok, texts, meta))
    two_ranks = local_rollout(model_dir, world_size=2, max_new_tokens=MAX_NEW)
    two = two_ranks.generate_sequences.options(pad=True)(make_prompts(tok, texts, meta))
    assert len(two) == 6
    assert list(two.non_tensor_batch["uid"]) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    for key in ("input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(one.batch[key], two.batch[key]), key
    # The group's metrics: tokens of the real rows (not the padding), the slowest rank's time.
    meta = two.meta_info
    assert meta["rollout/num_generated_tokens"] == int(one.batch["response_mask"].sum())
    assert meta["rollout/gen_time_s"] >= meta["rollout/gen_time_s_min"] > 0
    assert meta["rollout/tokens_per_s"] == pytest.approx(meta["rollout/num_generated_tokens"] / meta["rollout/gen_time_s"])


def test_config_errors_name_the_problem(model_dir, tok):
    """The worker reads its sections with read_section (tests/engines/test_rollout_config.py has them
    key by key): a bad key or value fails at construction, naming it; so do a missing path and bad
    per-call overrides."""
    with pytest.raises(Exception, match=r"rollout\.temprature"):
        LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir}, "rollout": {"temprature": 1.0}}))
    with pytest.raises(Exception, match=r"model\.dtype must be one of"):
        LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir, "dtype": "float8"}}))
    with pytest.raises(Exception, match=r"rollout\.backend must be one of"):
        LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir}, "rollout": {"backend": "sglang"}}))
    with pytest.raises(Exception, match=r"model\.path is required"):
        LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {}, "rollout": {}}))
    with pytest.raises(Exception, match="trainer.device must be"):
        LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir}, "trainer": {"device": "tpu"}}))
    wg = local_rollout(model_dir, max_new_tokens=MAX_NEW, top_p=0.5, stop=["\n"])
    assert wg.worker(0).config == RolloutConfig(max_new_tokens=MAX_NEW, top_p=0.5, stop=["\n"])
    with pytest.raises(Exception, match="n must be positive"):
        wg.generate_sequences(make_prompts(tok, meta_info={"n": 0}))
    with pytest.raises(Exception, match="top_p must be in"):
        wg.generate_sequences(make_prompts(tok, meta_info={"top_p": 0.0}))


def test_bad_prompts_and_order_errors(model_dir, tok, rollout):
    wg = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, {"model": {"path": model_dir}, "rollout": {}}))
    with pytest.raises(Exception, match="init_model"):
        wg.generate_sequences(make_prompts(tok))
    right_padded = make_prompts(tok)
    right_padded.batch["attention_mask"] = right_padded.batch["attention_mask"].flip(1)
    with pytest.raises(Exception, match="left-padded"):
        rollout.generate_sequences(right_padded)
    with pytest.raises(Exception, match="position_ids"):
        rollout.generate_sequences(make_prompts(tok).select(batch_keys=["input_ids", "attention_mask"]))
    with pytest.raises(Exception, match="colocated"):
        rollout.sync_weights()
    with pytest.raises(Exception, match="non-empty state dict"):
        rollout.update_weights({})


def test_update_weights_changes_generation(model_dir, tok, ref_model):
    wg = local_rollout(model_dir, max_new_tokens=MAX_NEW)
    before = wg.generate_sequences(make_prompts(tok, meta_info={"validate": True}))
    generator = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in ref_model.state_dict().items()}
    [metrics] = wg.update_weights(state)
    assert metrics["rollout/weight_sync_s"] >= 0
    after = wg.generate_sequences(make_prompts(tok, meta_info={"validate": True}))
    assert not torch.equal(before.batch["responses"], after.batch["responses"])
    new_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new_model.load_state_dict(state)
    prompts = make_prompts(tok)
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        expected = hand_greedy(new_model, prompt, MAX_NEW, {tok.eos_token_id})
        assert after.batch["responses"][row, : len(expected)].tolist() == expected
    with pytest.raises(Exception, match="missing"):
        wg.update_weights({k: v for k, v in state.items() if "lm_head" not in k})


def test_ignore_eos_gives_full_length_responses(rollout, tok):
    """32 samples x 10 tokens from a near-uniform 66-token model: eos gets sampled, and ends a row
    only without ignore_eos (rollout.ignore_eos from meta_info; the engine test sets it directly)."""
    stopped = rollout.generate_sequences(make_prompts(tok, meta_info={"n": 8}))
    lengths = stopped.batch["response_mask"].sum(1)
    ends = stopped.batch["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert (lengths < MAX_NEW).any() and (ends[lengths < MAX_NEW] == tok.eos_token_id).all()

    full = rollout.generate_sequences(make_prompts(tok, meta_info={"n": 8, "ignore_eos": True}))
    assert (full.batch["response_mask"] == 1).all()
    assert (full.batch["responses"][:, :-1] == tok.eos_token_id).any()  # eos inside a response, which went on
