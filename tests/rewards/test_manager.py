"""RuleRewardManager (rlcore.rewards.manager): decoded texts, hand-computed scores at hand-picked positions,
failures that name the row. The same manager as a worker group: tests/workers/test_reward.py."""

import math
import multiprocessing
import threading
import time

import numpy as np
import pytest
import torch

from rlcore.models.tiny import build_char_tokenizer, build_tiny_model
from rlcore.protocol import DataProto
from rlcore.rewards import RewardConfig, RewardError, RuleRewardManager, reward_metrics
from rlcore.rewards.registry import arithmetic_reward, register_reward_fn
from rlcore.typed_config import ConfigError, read_section

TOK = build_char_tokenizer()
PAD, EOS = TOK.pad_token_id, TOK.eos_token_id


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A model directory for from_config, which loads the tokenizer from model.path."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_lm"), seed=0)


def ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def response_batch(rows, ground_truths, sources=None, width=None, **non_tensors) -> DataProto:
    """rows: (token ids, mask) pairs, or token ids with every token valid; right-padded with PAD (mask 0)."""
    rows = [r if isinstance(r, tuple) else (r, [1] * len(r)) for r in rows]
    width = width or max(len(t) for t, _ in rows)
    responses = torch.tensor([t + [PAD] * (width - len(t)) for t, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows])
    cols = {"ground_truth": list(ground_truths), **non_tensors}
    if sources is not None:
        cols["data_source"] = list(sources)
    return DataProto.from_dict({"responses": responses, "response_mask": mask}, cols)


def plus_minus(response, ground_truth, **extra):
    """+1 for the arithmetic task's exact answer, -1 otherwise: a wrong answer's score is visible too."""
    return 1.0 if arithmetic_reward(response, ground_truth) else -1.0


def prompt_check(response, ground_truth, *, prompt, data_source, weight, format_score=0.0, **extra):
    """The ground truth holds the prompt text the manager must pass; every argument moves the score."""
    return float(prompt == ground_truth) * weight + (100.0 if data_source == "gsm8k" else 0.0) + format_score


def too_long_fails(response, ground_truth, **extra):
    if len(response) > 250:
        raise ValueError("answer too long")
    return 1.0


def returns_text(response, ground_truth, **extra):
    """Not a number on the row whose ground truth is "1" only: with forked workers the rows run at once,
    so a failure on every row would make which one is reported a race."""
    return "1" if ground_truth == "1" else 1.0


def hangs_on_request(response, ground_truth, **extra):
    if ground_truth == "hang":
        time.sleep(60)
    return 0.5


# Six hand-made rollouts of the arithmetic task (width 6):
#   0 "15"</s>  right       1 "16"</s>  wrong       2 " 7"</s>  right (spaces kept in the text)
#   3 "123456"  right, truncated (no eos)           4 empty (its score lands nowhere)
#   5 "4?2"</s> with the "?" token masked out (a tool-output hole) and junk after, masked too
ARITH_ROWS = [
    ids("15") + [EOS],
    ids("16") + [EOS],
    ids(" 7") + [EOS],
    ids("123456"),
    [],
    (ids("4x2") + [EOS] + ids("9"), [1, 0, 1, 1, 0]),
]
ARITH_TRUTHS = ["15", "15", "7", "123456", "3", "42"]
ARITH_SOURCES = ["x", "x", "x", "x", "y", "y"]
LAST_TOKEN = {0: 2, 1: 2, 2: 2, 3: 5, 5: 3}  # row -> last position where response_mask is 1


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("reward_fn", "expected"), [
    ("arithmetic", [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
    (plus_minus, [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]),
])
def test_scores_sit_on_the_last_valid_response_token(reward_fn, expected, num_workers):
    data = response_batch(ARITH_ROWS, ARITH_TRUTHS, ARITH_SOURCES, width=6)
    out = RuleRewardManager(TOK, reward_fn, num_workers=num_workers)(data)

    assert list(out.non_tensor_batch["response_text"]) == ["15", "16", " 7", "123456", "", "42"]
    assert torch.equal(out.batch["reward_scores"], torch.tensor(expected))
    token_scores = torch.zeros(6, 6)
    for row, pos in LAST_TOKEN.items():
        token_scores[row, pos] = expected[row]
    assert out.batch["token_level_scores"].dtype == torch.float32
    assert torch.equal(out.batch["token_level_scores"], token_scores)  # row 4 (empty) is all zero

    s = np.array(expected)
    m = out.meta_info
    assert m["reward/mean"] == pytest.approx(s.mean()) and m["reward/std"] == pytest.approx(s.std())
    assert (m["reward/min"], m["reward/max"]) == (s.min(), s.max())
    assert m["reward/frac_correct"] == pytest.approx(4 / 6)
    assert m["reward/x/mean"] == pytest.approx(s[:4].mean()) and m["reward/y/mean"] == pytest.approx(s[4:].mean())
    if reward_fn is plus_minus:  # the numbers above, by hand
        assert (m["reward/mean"], m["reward/std"]) == (pytest.approx(1 / 3), pytest.approx(math.sqrt(8) / 3))
        assert (m["reward/x/mean"], m["reward/y/mean"]) == (pytest.approx(0.5), 0.0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_prompt_source_extra_keys_and_kwargs_reach_the_function(num_workers):
    prompts = ["12+3=", "7*8="]
    prompt_ids = torch.tensor([ids(prompts[0]), [PAD] + ids(prompts[1])])  # left-padded
    data = response_batch([ids("15"), ids("56")], prompts, ["gsm8k", "arithmetic"], weight=[2.0, 3.0])
    data.batch["prompts"] = prompt_ids
    data.batch["attention_mask"] = torch.cat([(prompt_ids != PAD).long(), data.batch["response_mask"]], dim=1)
    manager = RuleRewardManager(TOK, prompt_check, reward_kwargs={"format_score": 0.25}, extra_keys=["weight"],
                                num_workers=num_workers)

    decoded = manager(data).batch["reward_scores"]  # no raw_prompt: the prompt tokens are decoded
    assert torch.equal(decoded, torch.tensor([2.0 + 100.0 + 0.25, 3.0 + 0.25]))
    data.non_tensor_batch["raw_prompt"] = np.array(["12+3=", "something else"], dtype=object)
    assert torch.equal(manager(data).batch["reward_scores"], torch.tensor([102.25, 0.25]))


def test_functions_by_data_source():
    rows = [ids("so #### 12"), ids("#### 13"), ids("12"), ids("12"), ids("\\boxed{3}")]
    truths = ["12", "12", "12", "12", "3"]
    data = response_batch(rows, truths, ["gsm8k", "gsm8k", "gsm8k", "arithmetic", "math"])
    kwargs = {"reward_kwargs": {"format_score": 0.1}, "num_workers": 2}

    with_default = RuleRewardManager(TOK, "arithmetic", reward_fn_by_source={"gsm8k": "gsm8k"}, **kwargs)
    # gsm8k (strict): right, wrong in the right format, no "####"; the default scores the rest
    assert torch.equal(with_default(data).batch["reward_scores"], torch.tensor([1.0, 0.1, 0.0, 1.0, 0.0]))
    by_registry = RuleRewardManager(TOK, **kwargs)  # no function given: each row's data_source names one
    assert torch.equal(by_registry(data).batch["reward_scores"], torch.tensor([1.0, 0.1, 0.0, 1.0, 1.0]))
    mapping = RuleRewardManager(TOK, {"math": plus_minus}, **kwargs)  # unlisted sources: the registry again
    assert torch.equal(mapping(data).batch["reward_scores"], torch.tensor([1.0, 0.1, 0.0, 1.0, -1.0]))

    unknown = response_batch([ids("1"), ids("2")], ["1", "2"], ["arithmetic", "nope"])
    with pytest.raises(ValueError, match=r"sample 1 \(data_source='nope'\).*'math'"):
        mapping(unknown)


def test_import_path_functions_and_config(tmp_path, tiny_model_dir):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def length_reward(response, ground_truth, **extra):\n    return len(response) / 10\n")
    config = {
        "model": {"path": tiny_model_dir, "dtype": "float32"},  # model keys of other roles are left alone
        "reward": {"reward_fn": f"{reward_file}:length_reward", "timeout_s": 5, "num_workers": 1,
                   "reward_fn_by_source": {"arithmetic": "rlcore.rewards.registry:arithmetic_reward"}},
    }
    manager = RuleRewardManager.from_config(config)
    data = response_batch([ids("1 2 3") + [EOS], ids("7") + [EOS]], ["x", "7"], ["other", "arithmetic"])
    assert torch.equal(manager(data).batch["reward_scores"], torch.tensor([0.5, 1.0]))

    with pytest.raises(ConfigError, match=r"config key reward\.timeout: Key 'timeout' not in 'RewardConfig'"):
        RuleRewardManager.from_config({**config, "reward": {"timeout": 5}})
    with pytest.raises(ConfigError, match=r"config key reward\.num_workers: .*'many'.*\(expected int"):
        RuleRewardManager.from_config({**config, "reward": {"num_workers": "many"}})
    with pytest.raises(ValueError, match="model.path is required"):
        RuleRewardManager.from_config({"reward": {}})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failing_function_names_the_row(num_workers):
    long_response = "x" * 199 + "y" + "z" * 100
    data = response_batch([ids("1"), ids("2"), ids(long_response)], ["1", "2", "3"], ["a", "b", "gsm8k"])
    with pytest.raises(RewardError) as info:
        RuleRewardManager(TOK, too_long_fails, num_workers=num_workers)(data)
    message = str(info.value)
    assert "'too_long_fails' raised ValueError: answer too long on sample 2 (data_source='gsm8k')" in message
    # the first 200 characters, no more: the preview's closing quote follows the 200th; nothing is said of
    # characters that could come from elsewhere in the message (the traceback names the checkout's path)
    assert f"response (first 200 chars): {'x' * 199 + 'y'!r}" in message and long_response[:201] not in message
    assert (info.value.index, info.value.data_source, info.value.response) == (2, "gsm8k", long_response)
    assert isinstance(info.value.__cause__, ValueError) and info.value.__cause__.args == ("answer too long",)

    with pytest.raises(RewardError, match=r"'returns_text' raised TypeError: .*returned '1' \(str\).* sample 0"):
        RuleRewardManager(TOK, returns_text, num_workers=num_workers)(data)


def test_a_hanging_function_fails_the_call_within_the_timeout():
    data = response_batch([ids("1"), ids("2"), ids("3")], ["1", "hang", "3"], ["a", "b", "c"])
    manager = RuleRewardManager(TOK, hangs_on_request, timeout_s=1, num_workers=2)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"did not return within timeout_s=1s .* sample 1 \(data_source='b'\)"):
        manager(data)  # waiting for the row would have returned 0.5 after 60 s, not raised
    assert time.monotonic() - start >= 1.0  # it waited the timeout (a lower bound: no machine is too fast for it)
    assert multiprocessing.active_children() == []  # the hung worker was killed, not leaked
    ok = response_batch([ids("1")], ["1"], ["a"])
    assert torch.equal(manager(ok).batch["reward_scores"], torch.tensor([0.5]))  # the manager is still usable


@register_reward_fn("test_sleeps_forever")
def sleeps_forever(response, ground_truth, **extra):
    if ground_truth == "hang":
        threading.Event().wait()  # never set: a reward function that never returns
    return 0.5


@pytest.mark.timeout(60)  # without the bound it would hang here
def test_a_hanging_function_in_process_fails_within_the_timeout(tiny_model_dir):
    """num_workers=0 (the recipes' default) scores in the driver: still bounded by reward.timeout_s."""
    manager = RuleRewardManager.from_config({"model": {"path": tiny_model_dir}, "reward": {
        "reward_fn": "test_sleeps_forever", "timeout_s": 1, "num_workers": 0}})
    data = response_batch([ids("1"), ids("2"), ids("3")], ["1", "hang", "3"], ["a", "b", "c"])
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"'test_sleeps_forever' did not return within timeout_s=1s .*num_workers=0"
                                          r".* on sample 1 \(data_source='b'\)"):
        manager(data)  # the row never returns: only the timeout can end the call
    assert time.monotonic() - start >= 1.0
    ok = response_batch([ids("1")], ["1"], ["a"])
    assert torch.equal(manager(ok).batch["reward_scores"], torch.tensor([0.5]))  # the manager is still usable


def test_reward_section_defaults_and_metrics_by_hand():
    cfg = read_section({"reward": {"reward_fn": "arithmetic", "extra_keys": ["weight"]}}, "reward", RewardConfig)
    assert cfg == RewardConfig(reward_fn="arithmetic", extra_keys=["weight"])
    assert (cfg.timeout_s, cfg.num_workers, cfg.reward_fn_by_source, cfg.reward_kwargs) == (10.0, None, {}, {})
    # frac_correct: only the 1.0 is a full score (1.0 when no full scores are given); 0.5 is partial credit
    m = reward_metrics(torch.tensor([1.0, 0.0, 0.5, -1.0]), np.array(["a", "b", "a", "b"], dtype=object))
    assert m == pytest.approx({"reward/mean": 0.125, "reward/std": math.sqrt(0.546875), "reward/min": -1.0,
                               "reward/max": 1.0, "reward/frac_correct": 0.25, "reward/a/mean": 0.75,
                               "reward/b/mean": -0.5})
    assert list(m)[-2:] == ["reward/a/mean", "reward/b/mean"]  # sources in order of appearance
