"""`math_verify` (rlcore.rewards.math_verify_grader): right where the exact `math` checker says wrong,
wrong where both should be, and a pathological answer stopped by its budget (score 0) or by the
manager's timeout (RewardError), in the reward manager's forked workers."""

import multiprocessing
import signal
import string
import threading
import time

import pytest
import torch

from rlcore.models.tiny import DEFAULT_CHARS, build_char_tokenizer
from rlcore.protocol import DataProto
from rlcore.rewards import RewardError, RuleRewardManager, get_reward_fn
from rlcore.rewards.math_verify_grader import MathScore, math_verify_reward, time_limit
from rlcore.rewards.registry import math_reward

TOK = build_char_tokenizer(DEFAULT_CHARS + "^[]|" + string.ascii_uppercase)  # the default lacks ^ and [ ]
PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"  # SymPy compares this to 3 for ever


# (response, ground truth): the exact checker says wrong, math-verify says right
EQUIVALENT = [
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt2}{2}"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{\\{3, 2, 1\\}}", "\\{1,2,3\\}"),  # a set in another order
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{[3, \\infty) \\cup (-\\infty, 2]}", "(-\\infty,2]\\cup[3,\\infty)"),  # a union in another order
    ("<answer>\\dfrac{3}{\\sqrt{3}}</answer>", "\\sqrt{3}"),
    ("the last line:\nanswer: 2^{10}", "1024"),
]
# both reject: a different value, an open vs a half-open interval, a smaller set, no answer form
BOTH_REJECT = [
    ("\\boxed{\\frac{1}{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{(1, 3)}", "[1, 3)"),
    ("\\boxed{\\{1, 2\\}}", "\\{1,2,3\\}"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
    ("the answer is \\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}"),  # right value, but not in \boxed{} / answer:
]


@pytest.mark.parametrize("response, truth", EQUIVALENT)
def test_equivalent_answers_the_exact_checker_misses(response, truth):
    assert math_reward(response, truth) == 0.0
    score = math_verify_reward(response, truth)
    assert score == 1.0 and score.reason == "equal (math-verify)"


@pytest.mark.parametrize("response, truth", BOTH_REJECT)
def test_wrong_answers_stay_wrong(response, truth):
    assert math_reward(response, truth) == 0.0
    assert math_verify_reward(response, truth) == 0.0
    assert math_verify_reward(response, truth, format_score=0.1) == (0.0 if "boxed" not in response else 0.1)


def test_exact_matches_skip_math_verify_and_the_registry_has_it():
    assert math_verify_reward("\\boxed{0.5}", "\\frac12").reason == "equal (exact)"
    assert math_verify_reward("no answer", "3").reason.startswith("no final answer")
    assert get_reward_fn("math_verify") is math_verify_reward and math_verify_reward.needs_process


@pytest.mark.timeout(30)
def test_a_pathological_answer_scores_zero_at_its_budget():
    start = time.monotonic()
    score = math_verify_reward(PATHOLOGICAL, "3", budget_s=0.5)
    took = time.monotonic() - start
    assert isinstance(score, MathScore) and score == 0.0
    assert score.reason == "timeout: grading took over budget_s=0.5s"
    assert took >= 0.5  # it graded for its budget (the reason above says the budget ended it)
    assert signal.getsignal(signal.SIGALRM) is not None and math_verify_reward("\\boxed{1}", "1") == 1.0


def test_time_limit_puts_back_a_running_timer():
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 50.0)
        with time_limit(1.0):
            assert 0.9 < signal.getitimer(signal.ITIMER_REAL)[0] <= 1.0
        assert 45 < signal.getitimer(signal.ITIMER_REAL)[0] <= 50  # the outer timer, about where it was
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def batch(responses, truths) -> DataProto:
    ids = [TOK(r)["input_ids"] for r in responses]
    width = max(len(i) for i in ids)
    return DataProto.from_dict(
        {"responses": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
         "response_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])},
        {"ground_truth": list(truths), "data_source": ["math"] * len(ids)})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_in_the_manager_pool_pathological_rows_score_zero_and_the_rest_are_graded(num_workers):
    """num_workers=0 (the recipes' default) still forks for math_verify: its timer needs a main thread."""
    responses = [EQUIVALENT[0][0], PATHOLOGICAL, EQUIVALENT[2][0], BOTH_REJECT[0][0]]
    truths = [EQUIVALENT[0][1], "3", EQUIVALENT[2][1], BOTH_REJECT[0][1]]
    assert TOK.decode(TOK("".join(responses))["input_ids"]) == "".join(responses)  # the tokenizer keeps the latex
    manager = RuleRewardManager(TOK, "math_verify", reward_kwargs={"budget_s": 1.0}, timeout_s=8,
                                num_workers=num_workers)
    start = time.monotonic()
    out = manager(batch(responses, truths))
    assert out.batch["reward_scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    # the pathological row ran to its budget (1 s) and scored 0; had it run to the manager's timeout, the call
    # would have raised RewardError instead of returning scores
    assert time.monotonic() - start >= 1.0
    assert multiprocessing.active_children() == []
    exact = RuleRewardManager(TOK, "math", num_workers=num_workers)(batch(responses, truths))
    assert exact.batch["reward_scores"].tolist() == [0.0, 0.0, 0.0, 0.0]  # the default checker on the same rows


@pytest.mark.timeout(120)
def test_called_from_a_thread_the_forked_grading_keeps_its_budget():
    """The driver may score from a non-main thread; each fork's only thread is its main thread."""
    result = {}

    def score():
        manager = RuleRewardManager(TOK, "math_verify", reward_kwargs={"budget_s": 1.0}, num_workers=0)
        result["out"] = manager(batch([PATHOLOGICAL, EQUIVALENT[3][0]], ["3", EQUIVALENT[3][1]]))

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert result["out"].batch["reward_scores"].tolist() == [0.0, 1.0]


@pytest.mark.timeout(120)
def test_a_budget_over_the_manager_timeout_fails_the_call_cleanly():
    manager = RuleRewardManager(TOK, "math_verify", reward_kwargs={"budget_s": 30.0}, timeout_s=2, num_workers=0)
    with pytest.raises(RewardError, match=r"'math_verify' did not return within timeout_s=2s \(its worker process "
                                          r"was killed\) on sample 1 \(data_source='math'\)"):
        manager(batch(["\\boxed{3}", PATHOLOGICAL], ["3", "3"]))  # its 30 s budget would have scored 0, not raised
    assert multiprocessing.active_children() == []
    assert manager(batch([EQUIVALENT[1][0]], [EQUIVALENT[1][1]])).batch["reward_scores"].tolist() == [1.0]
