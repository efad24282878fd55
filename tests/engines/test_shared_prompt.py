"""The n rows of one prompt share its prefill (rollout.share_prompt): the HF engine computes each distinct
prompt once, and what it samples is what the unshared path samples (tiny Llama model, CPU, fp32)."""

import pytest
import torch
from engine_fixtures import PROMPTS, generate, hand_greedy, hand_log_probs, make_prompts, settings, unpadded

from rlcore.engines import RolloutConfig
from rlcore.engines.hf_engine import HFEngine
from rlcore.engines.shared_prompt import distinct_rows
from rlcore.models.config import ModelConfig

N = 4  # samples per prompt


@pytest.fixture(scope="module")
def engines(model_dir):
    """(shared, unshared) engines on the same weights."""
    return tuple(HFEngine(ModelConfig(path=model_dir), RolloutConfig(max_new_tokens=10, share_prompt=share))
                 for share in (True, False))


def _prompt(prompts, row: int) -> list[int]:
    return unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])


class ForwardShapes:
    """The (rows, columns) of every forward's input ids, from a hook on the model's embedding."""

    def __init__(self, engine: HFEngine) -> None:
        self.shapes: list[tuple[int, int]] = []
        self.handle = engine.model.get_input_embeddings().register_forward_hook(
            lambda module, args, out: self.shapes.append(tuple(args[0].shape)))

    def __enter__(self) -> "ForwardShapes":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def test_distinct_rows_groups_equal_prompts():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 7, 8]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    first, inverse = distinct_rows(ids, mask)
    assert len(first) == 3
    assert inverse[0] == inverse[1] == inverse[3] and len({int(inverse[i]) for i in (0, 2, 4)}) == 3
    assert torch.equal(ids[first][inverse], ids) and torch.equal(mask[first][inverse], mask)
    assert sorted(first.tolist()) == [0, 2, 4]  # each prompt's first row
    # same ids, different padding: different prompts
    assert distinct_rows(ids[[0, 4]], torch.tensor([[0, 1, 1], [1, 1, 1]])) is None
    assert distinct_rows(ids[[0, 2]], mask[[0, 2]]) is None  # nothing repeats


def test_each_prompt_is_prefilled_once(engines, tok):
    shared, unshared = engines
    prompts = make_prompts(tok)
    width = prompts.batch["input_ids"].shape[1]
    with ForwardShapes(shared) as seen:
        generate(shared, prompts, settings(do_sample=False, ignore_eos=True, max_new_tokens=3), repeat=N)
    # one forward over the distinct prompts but their last column, then every row's last prompt column,
    # then one column per decoding step
    assert seen.shapes == [(len(PROMPTS), width - 1), (len(PROMPTS) * N, 1), (len(PROMPTS) * N, 1), (len(PROMPTS) * N, 1)]
    with ForwardShapes(unshared) as seen:
        generate(unshared, prompts, settings(do_sample=False, ignore_eos=True, max_new_tokens=3), repeat=N)
    assert seen.shapes == [(len(PROMPTS) * N, width), (len(PROMPTS) * N, 1), (len(PROMPTS) * N, 1)]
    with ForwardShapes(shared) as seen:  # no prompt repeats: nothing shared, the plain path
        generate(shared, prompts, settings(do_sample=False, ignore_eos=True, max_new_tokens=1))
    assert seen.shapes == [(len(PROMPTS), width)]


def test_greedy_is_token_for_token_the_unshared_and_hand_loop(engines, tok, ref_model):
    shared, unshared = engines
    prompts = make_prompts(tok)
    a, b = (generate(e, prompts, settings(do_sample=False), repeat=N) for e in engines)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.equal(a.batch["response_mask"], b.batch["response_mask"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    stop = set(shared.stop_token_ids(settings(do_sample=False)))
    for row in range(len(PROMPTS) * N):
        expected = hand_greedy(ref_model, _prompt(prompts, row // N), 10, stop)
        length = int(a.batch["response_mask"][row].sum())
        assert a.batch["responses"][row, :length].tolist() == expected


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.7, top_k=5)])
def test_seeded_samples_are_the_unshared_ones_with_the_trainers_log_probs(engines, tok, ref_model, params):
    prompts = make_prompts(tok)
    st = settings(seed=11, **params)
    a, b = (generate(e, prompts, st, repeat=N) for e in engines)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    # the group's rows are distinct samples, not one sample copied
    assert len({tuple(a.batch["responses"][r].tolist()) for r in range(N)}) > 1
    for row in range(len(PROMPTS) * N):
        length = int(a.batch["response_mask"][row].sum())
        response = a.batch["responses"][row, :length].tolist()
        expected = hand_log_probs(ref_model, _prompt(prompts, row // N), response,
                                  temperature=params.get("temperature", 1.0), top_k=params.get("top_k", 0))
        torch.testing.assert_close(a.batch["rollout_log_probs"][row, :length], expected, atol=1e-5, rtol=0)
