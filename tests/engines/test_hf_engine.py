"""HF engine against hand-computed references (tiny Llama model, CPU, fp32), in the trainer's layout."""

import pytest
import torch
from engine_fixtures import PROMPTS, generate, hand_greedy, hand_log_probs, make_prompts, settings, unpadded
from transformers import AutoModelForCausalLM

from rlcore.engines import RolloutConfig, build_engine
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig

MAX_NEW = 10


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW, seed=0))


def _check_layout(out, prompts, expected_lengths, pad_id, width=MAX_NEW):
    """Masks, positions and concatenation of a generation in the trainer's layout, row by row."""
    p_ids, p_mask, p_pos = (prompts.batch[k] for k in ("input_ids", "attention_mask", "position_ids"))
    t_p = p_ids.shape[1]
    assert torch.equal(out.batch["prompts"], p_ids)
    assert torch.equal(out.batch["input_ids"], torch.cat([p_ids, out.batch["responses"]], 1))
    for row, length in enumerate(expected_lengths):
        mask = torch.tensor([1] * length + [0] * (width - length))
        assert torch.equal(out.batch["response_mask"][row], mask)
        assert torch.equal(out.batch["attention_mask"][row], torch.cat([p_mask[row], mask]))
        assert (out.batch["responses"][row, length:] == pad_id).all()
        assert (out.batch["rollout_log_probs"][row, length:] == 0).all()
        last = int(p_pos[row, -1])
        assert last == int(p_mask[row].sum()) - 1  # the prompt's own last position
        assert out.batch["position_ids"][row, t_p:].tolist() == list(range(last + 1, last + 1 + width))


def test_greedy_equals_hand_argmax_loop_with_left_padding(engine, tok, ref_model):
    prompts = make_prompts(tok)
    out = generate(engine, make_prompts(tok), settings(do_sample=False, max_new_tokens=MAX_NEW))
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
    assert (engine.pad_token_id, engine.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)


def test_stop_token_ids_end_responses_and_layout(engine, tok, ref_model):
    """Stop on the token each row's greedy continuation emits at step 3: all rows end there or earlier."""
    prompts = make_prompts(tok)
    refs = [hand_greedy(ref_model, unpadded(prompts.batch["input_ids"][r], prompts.batch["attention_mask"][r]),
                        MAX_NEW, set()) for r in range(len(PROMPTS))]
    stop_ids = sorted({ref[3] for ref in refs} - {tok.pad_token_id})
    out = generate(engine, make_prompts(tok), settings(do_sample=False, max_new_tokens=MAX_NEW,
                                                       stop_token_ids=tuple(stop_ids)))
    stop_set = set(stop_ids) | {tok.eos_token_id}
    lengths = [next((i + 1 for i, t in enumerate(ref) if t in stop_set), MAX_NEW) for ref in refs]
    assert any(length < MAX_NEW for length in lengths)
    for row, (ref, length) in enumerate(zip(refs, lengths)):
        assert out.batch["responses"][row, :length].tolist() == ref[:length]
    _check_layout(out, prompts, lengths, tok.pad_token_id)


def test_stop_string_keeps_its_tokens_and_pads_after(engine, tok, ref_model):
    prompts = make_prompts(tok, ["12+3="])
    ref = hand_greedy(ref_model, tok("12+3=")["input_ids"], MAX_NEW, {tok.eos_token_id})
    text = tok.decode(ref)
    stop = text[2:4]  # two characters: a stop string spanning two tokens
    expected = len(tok(text[: text.index(stop) + 2])["input_ids"])  # char-level: one token per char
    out = generate(engine, make_prompts(tok, ["12+3="]), settings(do_sample=False, max_new_tokens=MAX_NEW, stop=(stop,)))
    assert out.batch["response_mask"][0].sum() == expected
    assert out.batch["responses"][0, :expected].tolist() == ref[:expected]
    _check_layout(out, prompts, [expected], tok.pad_token_id)


def test_sampled_log_probs_equal_model_log_softmax(engine, tok, ref_model):
    prompts = make_prompts(tok)
    out = generate(engine, make_prompts(tok), settings(temperature=1.0, max_new_tokens=MAX_NEW))
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        length = int(out.batch["response_mask"][row].sum())
        response = out.batch["responses"][row, :length].tolist()
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, :length],
                                   hand_log_probs(ref_model, prompt, response), atol=1e-5, rtol=0)


@pytest.mark.parametrize("params", [{"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.3}])
def test_log_probs_are_those_of_the_processed_distribution(engine, tok, ref_model, params):
    """Log-probs of softmax(filter(logits / T)), the distribution sampled from, not of the raw logits."""
    prompts = make_prompts(tok)
    out = generate(engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW, **params))
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        length = int(out.batch["response_mask"][row].sum())
        response = out.batch["responses"][row, :length].tolist()
        expected = hand_log_probs(ref_model, prompt, response, **params)
        assert torch.isfinite(expected).all()  # every sampled token survived the filter
        torch.testing.assert_close(out.batch["rollout_log_probs"][row, :length], expected, atol=1e-5, rtol=0)
        raw = hand_log_probs(ref_model, prompt, response)
        assert not torch.allclose(raw, expected, atol=1e-3)


def test_sampling_is_seeded_per_rank_and_leaves_global_rng_alone(model_dir, tok):
    cfg = RolloutConfig(max_new_tokens=MAX_NEW, seed=7)
    a = HFEngine(ModelConfig(path=model_dir), cfg)
    b = HFEngine(ModelConfig(path=model_dir), cfg)
    rank_one = HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW, seed=6), rank=1)
    sample = settings(max_new_tokens=MAX_NEW)
    state = torch.get_rng_state()
    out_a = generate(a, make_prompts(tok), sample)
    assert torch.equal(torch.get_rng_state(), state)
    out_b = generate(b, make_prompts(tok), sample)
    assert torch.equal(out_a.batch["responses"], out_b.batch["responses"])
    # Rank r samples with seed + r.
    assert torch.equal(generate(rank_one, make_prompts(tok), sample).batch["responses"], out_a.batch["responses"])
    again = generate(a, make_prompts(tok), sample)  # the stream moves on: a new draw
    assert not torch.equal(again.batch["responses"], out_a.batch["responses"])


def test_a_seeded_call_samples_the_same_whatever_came_before(model_dir, tok):
    """settings.seed: the samples depend on (seed, rank, repeat count) only, not on the stream, the
    engine's rollout.seed or earlier calls; a second call in a row with one seed (a multi-turn
    rollout's next turn) draws anew, and a fresh engine repeats the whole sequence."""
    fresh, used = (HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW, seed=s)) for s in (0, 5))
    rank_one = HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW), rank=1)

    def responses(engine, seed):
        sample = settings(max_new_tokens=MAX_NEW, seed=seed)
        return generate(engine, make_prompts(tok), sample, repeat=2).batch["responses"]

    for seed in (None, None, 3):  # the stream moves on, and seed 3's call is not the one below
        responses(used, seed)
    state = torch.get_rng_state()
    first = responses(fresh, 11)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(responses(used, 11), first)
    second = responses(fresh, 11)
    assert not torch.equal(second, first) and torch.equal(responses(used, 11), second)
    assert not torch.equal(responses(fresh, 12), first)
    assert not torch.equal(responses(rank_one, 11), first)
    assert not torch.equal(first[0::2], first[1::2])  # the two samples of each prompt differ


def test_ignore_eos_gives_full_length_responses(engine, tok):
    """32 samples x 10 tokens from a near-uniform 66-token model: eos gets sampled, and ends a row
    only without ignore_eos."""
    stopped = generate(engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW), repeat=8)
    lengths = stopped.batch["response_mask"].sum(1)
    ends = stopped.batch["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    assert (lengths < MAX_NEW).any() and (ends[lengths < MAX_NEW] == tok.eos_token_id).all()

    full = generate(engine, make_prompts(tok), settings(max_new_tokens=MAX_NEW, ignore_eos=True), repeat=8)
    assert (full.batch["response_mask"] == 1).all()
    assert (full.batch["responses"][:, :-1] == tok.eos_token_id).any()  # eos inside a response, which went on


def test_load_weights_changes_generation_and_refuses_a_partial_state_dict(model_dir, tok, ref_model):
    engine = HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=MAX_NEW))
    greedy = settings(do_sample=False, max_new_tokens=MAX_NEW)
    before = generate(engine, make_prompts(tok), greedy)
    generator = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in ref_model.state_dict().items()}
    with pytest.raises(KeyError, match="missing"):
        engine.load_weights({k: v for k, v in state.items() if "lm_head" not in k})
    with pytest.raises(KeyError, match="unexpected"):
        engine.load_weights({**state, "extra.weight": torch.zeros(1)})
    assert torch.equal(generate(engine, make_prompts(tok), greedy).batch["responses"], before.batch["responses"])
    engine.load_weights(state)
    after = generate(engine, make_prompts(tok), greedy)
    assert not torch.equal(before.batch["responses"], after.batch["responses"])
    new_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new_model.load_state_dict(state)
    prompts = make_prompts(tok)
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        expected = hand_greedy(new_model, prompt, MAX_NEW, {tok.eos_token_id})
        assert after.batch["responses"][row, : len(expected)].tolist() == expected


def test_build_engine_picks_the_backend_and_needs_a_path(model_dir):
    assert isinstance(build_engine(ModelConfig(path=model_dir), RolloutConfig(backend="hf")), HFEngine)
    with pytest.raises(ValueError, match="model.path is required"):
        HFEngine(ModelConfig(), RolloutConfig())
