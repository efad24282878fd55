"""HF rollout backend against hand-computed references (tiny Llama model, CPU, fp32)."""

import pytest
import torch
from omegaconf import OmegaConf
from rollout_fixtures import PROMPTS, hand_greedy, hand_log_probs, local_rollout, make_prompts, unpadded
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.rollout import RolloutWorker
from rlcore.engines.base import SamplingSettings, parse_config

MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


@pytest.fixture(scope="module")
def rollout(model_dir):
    return local_rollout(model_dir, max_new_tokens=MAX_NEW, seed=0)


def _check_layout(out, prompts, expected_lengths, pad_id):
    """Masks, positions and concatenation of a generate_sequences output, row by row."""
    p_ids, p_mask, p_pos = (prompts.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    t_p = p_ids.shape[1]
    assert torch.equal(out.batch["prompts"], p_ids)
    assert torch.equal(out.batch["input_ids"], torch.cat([p_ids, out.batch["responses"]], 1))
    for row, length in enumerate(expected_lengths):
        mask = torch.tensor([1] * length + [0] * (MAX_NEW - length))
        assert torch.equal(out.batch["response_mask"][row], mask)
        assert torch.equal(out.batch["attention_mask"][row], torch.cat([p_mask[row], mask]))
        assert (out.batch["responses"][row, length:] == pad_id).all()
        assert (out.batch["rollout_log_probs"][row, length:] == 0).all()
        last = int(p_pos[row, -1])
        assert last == int(p_mask[row].sum()) - 1  # the prompt's own last position
        assert out.batch["position_ids"][row, t_p:].tolist() == list(range(last + 1, last + 1 + MAX_NEW))


def test_greedy_equals_hand_argmax_loop_with_left_padding(rollout, tok, ref_model):
    prompts = make_prompts(tok)
    out = rollout.generate_sequences(make_prompts(tok, meta_info={"do_sample": False}))
    assert out.batch["responses"].shape == (len(PROMPTS), MAX_NEW)
    lengths = []
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        expected = hand_greedy(ref_model, prompt, MAX_NEW, {tok.eos_token_id})
        assert out.batch["responses"][row, : len(expected)].tolist() == expected
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, : len(expected)],
                                   hand_log_probs(ref_model, prompt, expected), atol=1e-5, rtol=0)
        lengths.append(len(expected))
    _check_layout(out, prompts, lengths, tok.pad_token_id)
    assert list(out.non_tensor_batch["uid"]) == ["p0", "p1", "p2", "p3"]
    assert out.meta_info["rollout/num_generated_tokens"] == sum(lengths)
    assert out.meta_info["rollout/gen_time_s"] > 0 and out.meta_info["rollout/tokens_per_s"] > 0


def test_stop_token_ids_end_responses_and_layout(rollout, tok, ref_model):
    """Stop on the token each row's greedy continuation emits at step 3: all rows end there or earlier."""
    prompts = make_prompts(tok)
    refs = [hand_greedy(ref_model, unpadded(prompts.batch["input_ids"][r], prompts.batch["attention_mask"][r]),
                        MAX_NEW, set()) for r in range(len(PROMPTS))]
    stop_ids = sorted({ref[3] for ref in refs} - {tok.pad_token_id})
    out = rollout.generate_sequences(make_prompts(tok, meta_info={"validate": True, "stop_token_ids": stop_ids}))
    stop_set = set(stop_ids) | {tok.eos_token_id}
    lengths = [next((i + 1 for i, t in enumerate(ref) if t in stop_set), MAX_NEW) for ref in refs]
    assert any(length < MAX_NEW for length in lengths)
    for row, (ref, length) in enumerate(zip(refs, lengths)):
        assert out.batch["responses"][row, :length].tolist() == ref[:length]
    _check_layout(out, prompts, lengths, tok.pad_token_id)


def test_stop_string_keeps_its_tokens_and_pads_after(rollout, tok, ref_model):
    prompts = make_prompts(tok, ["12+3="])
    ref = hand_greedy(ref_model, tok("12+3=")["input_ids"], MAX_NEW, {tok.eos_token_id})
    text = tok.decode(ref)
    stop = text[2:4]  # two characters: a stop string spanning two tokens
    expected = len(tok(text[: text.index(stop) + 2])["input_ids"])  # char-level: one token per char
    out = rollout.generate_sequences(make_prompts(tok, ["12+3="], {"do_sample": False, "stop": [stop]}))
    assert out.batch["response_mask"][0].sum() == expected
    assert out.batch["responses"][0, :expected].tolist() == ref[:expected]
    _check_layout(out, prompts, [expected], tok.pad_token_id)


def test_sampled_log_probs_equal_model_log_softmax(rollout, tok, ref_model):
    prompts = make_prompts(tok)
    out = rollout.generate_sequences(make_prompts(tok, meta_info={"temperature": 1.0}))
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        length = int(out.batch["response_mask"][row].sum())
        response = out.batch["responses"][row, :length].tolist()
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, :length],
                                   hand_log_probs(ref_model, prompt, response), atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", [{"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.3}])
def test_log_probs_are_those_of_the_processed_distribution(rollout, tok, ref_model, params):
    """Log-probs of softmax(filter(logits / T)), the distribution sampled from, not of the raw logits."""
    prompts = make_prompts(tok)
    out = rollout.generate_sequences(make_prompts(tok, meta_info=params))
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        length = int(out.batch["response_mask"][row].sum())
        response = out.batch["responses"][row, :length].tolist()
        expected = hand_log_probs(ref_model, prompt, response, **params)
        assert torch.isfinite(expected).all()  # every sampled token survived the filter
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, :length], expected, atol=1e-5, rtol=0)
        raw = hand_log_probs(ref_model, prompt, response)
        assert not torch.allclose(raw, expected, atol=1e-3)


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
    with pytest.raises(KeyError, match="temprature"):
        parse_config({"model": {"path": model_dir}, "rollout": {"temprature": 1.0}})
    with pytest.raises(KeyError, match="rollout"):
        parse_config({"model": {"path": model_dir}, "rolout": {}})
    with pytest.raises(KeyError, match="path"):
        parse_config({"model": {}, "rollout": {}})
    model, rollout = parse_config(OmegaConf.create({"model": {"path": model_dir, "dtype": "bfloat16"},
                                                    "rollout": {"n": 4, "stop": ["\n"]}, "actor": {"lr": 1.0}}))
    assert (model.dtype, rollout.n, rollout.stop, rollout.temperature) == ("bfloat16", 4, ("\n",), 1.0)
    with pytest.raises(ValueError, match="backend"):
        parse_config({"model": {"path": model_dir}, "rollout": {"backend": "sglang"}})
    with pytest.raises(ValueError, match="top_p"):
        parse_config({"model": {"path": model_dir}, "rollout": {"top_p": 0.0}})
    with pytest.raises(ValueError, match="model.dtype"):
        parse_config({"model": {"path": model_dir, "dtype": "float8"}, "rollout": {}})
    with pytest.raises(ValueError, match="n must be positive"):
        SamplingSettings.resolve(parse_config({"model": {"path": model_dir}, "rollout": {}})[1], {"n": 0})


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
    only without ignore_eos."""
    stopped = rollout.generate_sequences(make_prompts(tok, meta_info={"n": 8}))
    lengths = stopped.batch["response_mask"].sum(1)
    ends = stopped.batch["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert (lengths < MAX_NEW).any() and (ends[lengths < MAX_NEW] == tok.eos_token_id).all()

    full = rollout.generate_sequences(make_prompts(tok, meta_info={"n": 8, "ignore_eos": True}))
    assert (full.batch["response_mask"] == 1).all()
    assert (full.batch["responses"][:, :-1] == tok.eos_token_id).any()  # eos inside a response, which went on
