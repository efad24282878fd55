"""verl's reward side as it is: compute_score(data_source, solution_str, ground_truth, extra_info=None)
functions (float or dict returns), told apart from rlcore's by parameter names; verl's data sources
routed to the built-in checkers; verl's gsm8k data (the bare number after "####") scored right."""

import numpy as np
import pytest
import torch

from rlcore.models.tiny import build_char_tokenizer
from rlcore.protocol import DataProto
from rlcore.rewards import RewardError, RuleRewardManager, get_reward_fn
from rlcore.rewards.registry import gsm8k_reward, math_reward, reward_fn_for_source
from rlcore.rewards.signatures import reward_call

TOK = build_char_tokenizer()  # lower case only: upper-case letters would decode to nothing
INFOS = [{"index": 0, "split": "train"}, {"index": 1, "split": "test"}, {"index": 2, "split": "train"}]


def batch(responses, truths, sources, infos=None) -> DataProto:
    ids = [TOK(r)["input_ids"] for r in responses]
    width = max(len(i) for i in ids)
    cols = {"ground_truth": list(truths), "data_source": list(sources)}
    if infos is not None:
        cols["extra_info"] = np.array(infos, dtype=object)
    return DataProto.from_dict({"responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                                "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])},
                               cols)


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    """Every argument moves the score: 1 for a right "#### n", + 10 x index, + 100 for the test split."""
    right = solution_str.strip() == f"#### {ground_truth}"
    return float(right) + 10 * extra_info["index"] + (100 if extra_info["split"] == "test" else 0) + \
        (1000 if data_source == "openai/gsm8k" else 0)


def verl_dict_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's dict form: the score plus entries that become metrics (and one that is not a number)."""
    acc = float(solution_str.strip() == f"#### {ground_truth}")
    return {"score": acc * kwargs.get("scale", 1.0), "acc": acc, "pred": solution_str, "length": len(solution_str)}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_verl_signature_gets_its_arguments_by_name(num_workers):
    data = batch(["#### 5", "#### 7", "6"], ["5", "6", "6"], ["openai/gsm8k", "x", "x"], INFOS)
    out = RuleRewardManager(TOK, verl_score, num_workers=num_workers)(data)
    assert out.batch["reward_scores"].tolist() == [1001.0, 110.0, 20.0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_verl_dict_scores_and_their_extra_metrics(num_workers):
    data = batch(["#### 5", "#### 7", "#### 6"], ["5", "6", "6"], ["a", "a", "b"], INFOS)
    out = RuleRewardManager(TOK, verl_dict_score, reward_kwargs={"scale": 2.0}, num_workers=num_workers)(data)
    assert out.batch["reward_scores"].tolist() == [2.0, 0.0, 2.0]
    m = out.meta_info
    assert m["reward/extra/acc/mean"] == pytest.approx(2 / 3)
    assert m["reward/extra/length/mean"] == pytest.approx(6.0)
    assert "reward/extra/pred/mean" not in m and m["reward/mean"] == pytest.approx(4 / 3)


def test_a_verl_function_loaded_by_path(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return {'score': float(solution_str == ground_truth) + extra_info['index'], 'hit': 1}\n")
    manager = RuleRewardManager(TOK, f"{f}:compute_score", num_workers=0)
    out = manager(batch(["3", "4"], ["3", "3"], ["s", "s"], INFOS[:2]))
    assert out.batch["reward_scores"].tolist() == [1.0, 1.0] and out.meta_info["reward/extra/hit/mean"] == 1.0


def test_extra_info_reaches_only_functions_that_take_it():
    seen = []

    def old_style(response, ground_truth, prompt=None, data_source=None):  # written before verl data
        seen.append("old")
        return 1.0

    def wants_info(response, ground_truth, *, extra_info, **extra):
        seen.append(extra_info["split"])
        return 0.5

    data = batch(["1", "2"], ["1", "2"], ["a", "b"], INFOS[:2])
    manager = RuleRewardManager(TOK, {"a": old_style, "b": wants_info}, num_workers=0)
    assert manager(data).batch["reward_scores"].tolist() == [1.0, 0.5] and seen == ["old", "test"]
    no_column = batch(["1"], ["1"], ["b"])  # a batch without extra_info: None
    assert reward_call(wants_info, "w").takes_extra_info
    with pytest.raises(RewardError, match="NoneType"):
        manager(no_column)


def test_a_function_matching_neither_signature_is_an_error_at_construction():
    def one_argument(text):
        return 1.0

    def verl_needs_more(data_source, solution_str, ground_truth, extra_info, threshold):
        return 1.0

    def rlcore_without_kwargs(response, ground_truth):
        return 1.0

    with pytest.raises(TypeError, match=r"\.one_argument has signature \(text\): it cannot be called the way "
                                        r"rlcore's functions are, fn\(response, ground_truth, \*\*extra\), with .*"
                                        r"verl's compute_score\(data_source, solution_str.* or TRL's "
                                        r"f\(prompts, completions, \*\*columns\)"):
        RuleRewardManager(TOK, one_argument)
    with pytest.raises(TypeError, match=r"verl_needs_more.*the way verl's functions are.*'threshold'"):
        RuleRewardManager(TOK, verl_needs_more)
    assert RuleRewardManager(TOK, verl_needs_more, reward_kwargs={"threshold": 1})  # given: fine
    with pytest.raises(TypeError, match=r"rlcore_without_kwargs.*keywords \['data_source', 'prompt'\]"):
        RuleRewardManager(TOK, rlcore_without_kwargs)
    with pytest.raises(TypeError, match=r"one_argument \(reward_fn_by_source\['by_source'\]\) has"):
        RuleRewardManager(TOK, reward_fn_by_source={"by_source": one_argument})


def test_a_dict_without_score_names_the_row():
    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"acc": 1.0}

    with pytest.raises(RewardError, match=r"returned a dict without a 'score' entry: \['acc'\] on sample 0"):
        RuleRewardManager(TOK, no_score, num_workers=0)(batch(["1"], ["1"], ["a"]))


def test_verl_data_sources_map_to_the_built_in_checkers():
    assert {s: reward_fn_for_source(s) for s in [
        "openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
        "math_dapo", "aime_2024", "aime2025", "numina_olympiads", "gsm8k", "math", "code", "hiyouga/geometry3k"]} == {
        "openai/gsm8k": "gsm8k", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
        "HuggingFaceH4/MATH-500": "math", "math_dapo": "math", "aime_2024": "math", "aime2025": "math",
        "numina_olympiads": "math", "gsm8k": "gsm8k", "math": "math", "code": "code", "hiyouga/geometry3k": None}

    responses = ["so\n#### 72", "#### 71", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "so\nanswer: 34", "\\boxed{34}"]
    truths = ["72", "72", "\\frac12", "\\frac{1}{2}", "34", "34"]
    sources = ["openai/gsm8k", "openai/gsm8k", "lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "aime_2024"]
    out = RuleRewardManager(TOK, num_workers=0)(batch(responses, truths, sources))  # no function given
    assert out.batch["reward_scores"].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert out.meta_info["reward/openai/gsm8k/mean"] == 0.5

    with pytest.raises(ValueError, match=r"no reward function for sample 0 \(data_source='hiyouga/geometry3k'\)"):
        RuleRewardManager(TOK, num_workers=0)(batch(["1"], ["1"], ["hiyouga/geometry3k"]))


@pytest.mark.parametrize("response, truth, strict, flexible", [
    ("3 + 4 = 7\n#### 7", "7", 1.0, 1.0),  # verl's layout: the bare number after "####"
    ("#### 1,000", "1000", 1.0, 1.0),  # verl's preprocessing drops the commas of the ground truth
    ("#### $1000", "1000", 1.0, 1.0),
    ("#### 72.0", "72", 1.0, 1.0),
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 72.", "72", 1.0, 1.0),  # a full stop after the number
    ("#### 73", "72", 0.0, 0.0),
    ("the answer is 72", "72", 0.0, 1.0),  # no "####": strict finds nothing, flexible takes the last number
    ("#### 7 and later #### 8", "8", 1.0, 1.0),  # the last "####" counts
    ("#### 72", 72, 1.0, 1.0),  # a parquet column of numbers
    ("#### 18", "janet sells 16 - 3 - 4 = 9 duck eggs... 9 * 2 = 18\n#### 18", 1.0, 1.0),  # a whole GSM8K solution
])
def test_gsm8k_scores_verl_style_rows(response, truth, strict, flexible):
    assert gsm8k_reward(response, truth) == strict
    assert gsm8k_reward(response, truth, method="flexible") == flexible


def test_math_reads_dapo_answer_lines_and_numeric_truths():
    assert math_reward("reasoning...\nAnswer: $34$", "34") == 1.0  # DAPO's "Answer: $Answer" last line
    assert math_reward("answer: 33", 34) == 0.0 and math_reward("\\boxed{34}", 34) == 1.0
    assert math_reward("the answer: is 5", "5") == 0.0  # not a line that starts with "Answer:"
    assert get_reward_fn("math") is math_reward
