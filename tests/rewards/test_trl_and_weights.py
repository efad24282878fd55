"""TRL-style batched reward functions, weighted lists of functions (mixed forms), None ("not
applicable"), per-function metrics and columns, frac_correct at the row's full score, and the errors
at load time and on a bad return: every number below is worked out by hand in the comments."""

import math
import time

import numpy as np
import pytest
import torch

from rlcore.models.tiny import build_char_tokenizer
from rlcore.protocol import DataProto
from rlcore.rewards import RewardConfig, RewardError, RuleRewardManager, reward_metrics
from rlcore.typed_config import ConfigError, read_section

TOK = build_char_tokenizer()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id


def ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def batch(responses, truths, sources, **non_tensors) -> DataProto:
    """Right-padded responses (every token valid), with raw prompts "p0", "p1", ..."""
    rows = [ids(r) + [EOS] for r in responses]
    width = max(map(len, rows))
    tensors = {"responses": torch.tensor([r + [PAD] * (width - len(r)) for r in rows]),
               "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])}
    cols = {"ground_truth": list(truths), "data_source": list(sources),
            "raw_prompt": [f"p{i}" for i in range(len(rows))], **non_tensors}
    return DataProto.from_dict(tensors, cols)


class Recorder:
    """A TRL-style function that keeps what each call got: exact match of the completion with the
    answer column, 1.0 or 0.0."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, answer, **kwargs):
        self.calls.append({"prompts": prompts, "completions": completions, "answer": answer, **kwargs})
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(t == a) for t, a in zip(texts, answer)]


DATA = (["15", "16", "7", "8"], ["15", "15", "7", "9"], ["a", "a", "b", "b"])  # rows 0 and 2 right


def test_a_trl_function_is_called_once_per_batch_with_the_columns_as_lists():
    fn = Recorder()
    data = batch(*DATA, level=[1, 2, 3, 4])
    manager = RuleRewardManager(TOK, fn, num_workers=0, extra_keys=["level"], reward_kwargs={"tol": 0.5},
                                answer_key="answer")
    out = manager(data)
    assert out.batch["reward_scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert len(fn.calls) == 1  # one call for the batch, not one per row
    call = fn.calls[0]
    assert call["prompts"] == ["p0", "p1", "p2", "p3"] and call["completions"] == ["15", "16", "7", "8"]
    assert call["answer"] == call["ground_truth"] == ["15", "15", "7", "9"]
    assert call["data_source"] == ["a", "a", "b", "b"] and call["level"] == [1, 2, 3, 4]
    assert call["extra_info"] == [None] * 4 and call["tol"] == 0.5  # reward_kwargs: plain values
    assert call["completion_ids"] == [ids("15") + [EOS], ids("16") + [EOS], ids("7") + [EOS], ids("8") + [EOS]]
    assert list(out.non_tensor_batch["reward_components"]) == [{"Recorder": s} for s in (1.0, 0.0, 1.0, 0.0)]
    assert out.meta_info["reward/frac_correct"] == 0.5


def test_chat_data_gets_messages_and_assistant_turns():
    fn = Recorder()
    chats = [[{"role": "system", "content": "be terse"}, {"role": "user", "content": f"q{i}"}] for i in range(4)]
    data = batch(*DATA, messages=chats)
    out = RuleRewardManager(TOK, fn, num_workers=0, answer_key="answer")(data)
    assert out.batch["reward_scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert fn.calls[0]["prompts"] == chats
    assert fn.calls[0]["completions"] == [[{"role": "assistant", "content": t}] for t in DATA[0]]
    RuleRewardManager(TOK, fn, num_workers=0, answer_key="answer", conversational=False)(data)
    assert fn.calls[1]["prompts"] == ["p0", "p1", "p2", "p3"] and fn.calls[1]["completions"] == list(DATA[0])
    RuleRewardManager(TOK, fn, num_workers=0, answer_key="answer", conversational=True)(batch(*DATA))
    assert fn.calls[2]["prompts"][1] == [{"role": "user", "content": "p1"}]  # no messages column: the raw prompt
    assert fn.calls[2]["completions"][1] == [{"role": "assistant", "content": "16"}]


def only_a(completions, data_source, **kwargs):
    """TRL's own shape (no prompts parameter): 0.25 per character on source "a" rows, None elsewhere."""
    return [0.25 * len(c) if s == "a" else None for c, s in zip(completions, data_source)]


def verl_b(data_source, solution_str, ground_truth, extra_info=None):
    """verl's form, one row at a time: 1.0 for the right answer on source "b" rows, None elsewhere."""
    return None if data_source != "b" else float(solution_str == ground_truth)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_weighted_list_of_mixed_forms_sums_what_applies(num_workers):
    # rows: "15" a right, "16" a wrong, "7" b right, "8" b wrong; weights only_a 2.0, verl_b 0.5, arithmetic 1.0
    manager = RuleRewardManager(TOK, [only_a, verl_b, "arithmetic"], weights=[2.0, 0.5, 1.0], num_workers=num_workers)
    out = manager(batch(*DATA))
    # row 0: 2*0.5 + 1*1 = 2.0; row 1: 2*0.5 + 0 = 1.0; row 2: 0.5*1 + 1 = 1.5; row 3: 0.5*0 + 0 = 0.0
    assert out.batch["reward_scores"].tolist() == [2.0, 1.0, 1.5, 0.0]
    # full score: the weights of the functions that scored the row (each gives at most 1.0): 3.0 on a, 1.5 on b
    assert out.batch["reward_full_score"].tolist() == [3.0, 3.0, 1.5, 1.5]
    assert list(out.non_tensor_batch["reward_components"]) == [
        {"only_a": 0.5, "verl_b": None, "arithmetic": 1.0}, {"only_a": 0.5, "verl_b": None, "arithmetic": 0.0},
        {"only_a": None, "verl_b": 1.0, "arithmetic": 1.0}, {"only_a": None, "verl_b": 0.0, "arithmetic": 0.0}]
    m = out.meta_info
    assert m["reward/mean"] == pytest.approx(4.5 / 4)
    assert m["reward/frac_correct"] == 0.25  # row 2 only: row 0 earns 2.0 of 3.0 (only_a gives partial credit)
    # each function's own unweighted mean over the rows it scored
    assert (m["reward/only_a/mean"], m["reward/verl_b/mean"], m["reward/arithmetic/mean"]) == (0.5, 0.5, 0.5)
    assert (m["reward/a/mean"], m["reward/b/mean"]) == (1.5, 0.75)  # per data source, as before


def test_full_score_setting_and_a_functions_own_full_score():
    def fraction(response, ground_truth, **extra):  # partial credit, as the code reward's fraction of tests
        return {"15": 1.0, "16": 0.5, "7": 0.0, "8": 0.25}[response]

    out = RuleRewardManager(TOK, fraction, num_workers=0)(batch(*DATA))
    assert out.meta_info["reward/frac_correct"] == 0.25  # only the 1.0 (once, a score > 0 counted 3 of 4)
    out = RuleRewardManager(TOK, fraction, num_workers=0, full_score=0.5)(batch(*DATA))
    assert out.meta_info["reward/frac_correct"] == 0.5 and out.batch["reward_full_score"].tolist() == [0.5] * 4

    def stars(completions, **kwargs):  # scores in [0, 2]
        return [2.0 if c == "15" else 1.0 for c in completions]
    stars.full_score = 2.0
    out = RuleRewardManager(TOK, [stars, "arithmetic"], weights=[0.5, 1.0], num_workers=0)(batch(*DATA))
    # full: 0.5 * 2.0 + 1.0 * 1.0 = 2.0; scores: 1+1, 0.5+0, 0.5+1, 0.5+0
    assert out.batch["reward_scores"].tolist() == [2.0, 0.5, 1.5, 0.5]
    assert out.batch["reward_full_score"].tolist() == [2.0] * 4 and out.meta_info["reward/frac_correct"] == 0.25
    # floats that add up to the full score within rounding count
    assert reward_metrics(torch.tensor([0.1 + 0.2 + 0.7, 0.99]), full_scores=torch.tensor([1.0, 1.0]))[
        "reward/frac_correct"] == 0.5


def test_a_row_no_function_scores_is_an_error_naming_it():
    manager = RuleRewardManager(TOK, [only_a, verl_b], num_workers=0)
    data = batch(["15", "7", "9"], ["15", "7", "9"], ["a", "b", "c"])
    with pytest.raises(RewardError, match=r"every reward function of sample 2 \(data_source='c': \['only_a', "
                                          r"'verl_b'\]\) returned None .* 1 such rows"):
        manager(data)
    with pytest.raises(RewardError, match=r"sample 1 .*returned None"):  # one function alone: the same rule
        RuleRewardManager(TOK, only_a, num_workers=0)(data)


def test_names_are_made_distinct_and_kept_apart_from_data_sources(tmp_path):
    for stem in ("fmt", "acc"):
        (tmp_path / f"{stem}.py").write_text("def score(completions, **kw):\n    return [1.0] * len(completions)\n")
    a, b = f"{tmp_path}/fmt.py:score", f"{tmp_path}/acc.py:score"
    out = RuleRewardManager(TOK, [a, b, "arithmetic"], num_workers=0)(batch(*DATA[:2], ["arithmetic"] * 4))
    assert set(out.non_tensor_batch["reward_components"][0]) == {"fmt.score", "acc.score", "arithmetic"}
    m = out.meta_info
    assert m["reward/fmt.score/mean"] == m["reward/acc.score/mean"] == 1.0
    assert m["reward/arithmetic/mean"] == 2.5  # the data source's mean of the totals: 1 + 1 + (1, 0, 1, 0)
    assert m["reward/arithmetic_fn/mean"] == 0.5  # the function's own mean, renamed


def test_bad_returns_name_the_function_and_the_row():
    data = batch(*DATA)
    cases = [
        (lambda completions, **kw: [1.0] * 3, r"<lambda>' returned 3 scores for 4 completions "
                                               r"in its call for 4 samples \(from sample 0\)"),
        (lambda completions, **kw: 1.0, r"returned float, expected a list of 4 scores"),
        (lambda completions, **kw: [1.0, 1.0, "x", 0.0], r"returned 'x' \(str\).* for sample 2 \(completion 2 "),
        (lambda completions, **kw: [1.0, math.nan, 0.0, 0.0], r"returned nan, expected a finite number for sample 1"),
    ]
    for num_workers in (0, 1):
        for fn, message in cases:
            with pytest.raises(RewardError, match=message) as info:
                RuleRewardManager(TOK, fn, num_workers=num_workers)(data)
        assert info.value.index == 1  # the row of the last case


def needs_a_solution_column(prompts, completions, solution):
    return [1.0] * len(completions)


def test_load_time_errors_name_the_function_and_the_forms():
    with pytest.raises(TypeError, match=r"needs_a_solution_column has signature .* the way TRL's functions are.*"
                                        r"'solution'.*rlcore's .* verl's .* or TRL's"):
        RuleRewardManager(TOK, needs_a_solution_column)
    assert RuleRewardManager(TOK, needs_a_solution_column, answer_key="solution")  # the answer column's name
    with pytest.raises(ValueError, match=r"reward.weights has 1 entries but reward.reward_fn lists 2 functions"):
        RuleRewardManager(TOK, ["arithmetic", only_a], weights=[1.0])
    with pytest.raises(ConfigError, match=r"reward.weights has 3 entries but reward.reward_fn lists 2"):
        read_section({"reward": {"reward_fn": ["a.py:f", "gsm8k"], "weights": [1, 2, 3]}}, "reward", RewardConfig)
    with pytest.raises(ConfigError, match=r"reward.weights is set but reward.reward_fn is not"):
        read_section({"reward": {"weights": [1.0]}}, "reward", RewardConfig)
    with pytest.raises(ConfigError, match=r"reward.reward_fn must be .* a non-empty list"):
        read_section({"reward": {"reward_fn": []}}, "reward", RewardConfig)
    cfg = read_section({"reward": {"reward_fn": ["a.py:f", "gsm8k"], "weights": [1, 0.5], "full_score": 1.5}},
                       "reward", RewardConfig)
    assert (cfg.reward_fn, cfg.weights, cfg.full_score) == (["a.py:f", "gsm8k"], [1.0, 0.5], 1.5)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_hung_batched_call_fails_naming_the_function(num_workers):
    def slow_judge(prompts, completions, **kwargs):
        time.sleep(60)

    with pytest.raises(RewardError, match=r"'test_a_hung_batched_call_fails_naming_the_function.<locals>.slow_judge' "
                                          r"did not return within timeout_s=1s .*in its call for 4 samples"):
        RuleRewardManager(TOK, slow_judge, num_workers=num_workers, timeout_s=1)(batch(*DATA))


def test_reward_fn_by_source_wins_over_the_list_for_its_rows():
    manager = RuleRewardManager(TOK, [only_a, "arithmetic"], reward_fn_by_source={"b": verl_b}, num_workers=0)
    out = manager(batch(*DATA))
    # a rows: the list (0.5 + 1, 0.5 + 0); b rows: verl_b alone (1, 0)
    assert out.batch["reward_scores"].tolist() == [1.5, 0.5, 1.0, 0.0]
    assert out.batch["reward_full_score"].tolist() == [2.0, 2.0, 1.0, 1.0]
    assert [set(c) for c in out.non_tensor_batch["reward_components"]] == [{"only_a", "arithmetic"}] * 2 + [{"verl_b"}] * 2
    assert isinstance(out.non_tensor_batch["reward_components"], np.ndarray)
