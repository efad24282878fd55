"""Rule-based reward functions, looked up by name or by import path.

A reward function scores one decoded response against its ground truth:

    fn(response: str, ground_truth: str, **extra) -> float

`extra` carries per-row fields (`prompt`, `data_source`, ...) and config options; a function
ignores what it does not use. Built-in names equal the `data_source` of the datasets they score,
so a batch that mixes sources can pick each row's function by its `data_source`. `code` runs the
response's program against test cases (rlcore.rewards.code_checks) in a sandbox
(rlcore.rewards.sandbox).

A config names a function either by a registered name ("gsm8k") or by a path:
"package.module:function" or "/path/to/file.py:function", so a user's reward needs no change here.
A function may also have verl's signature, ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)`` (rlcore.rewards.signatures tells the two apart). verl's preprocessing scripts name
their rows' data_source after the Hugging Face dataset ("openai/gsm8k", "lighteval/MATH", "aime_2024"):
`reward_fn_for_source` maps those to the built-in checker of the same kind of answer, as verl's
default scorer does. `math_verify` (rlcore.rewards.math_verify_grader, the optional `math-verify`
package) decides MATH answers the exact `math` checker cannot; `math` stays the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from rlcore.errors import did_you_mean
from rlcore.registry import Registry, UnknownNameError, load_module, public_callables
from rlcore.rewards.math_answers import (
    answers_equal,
    extract_boxed,
    extract_final_number,
    extract_gsm8k_answer,
    extract_last_number,
    extract_math_answer,
)
from rlcore.rewards.code_checks import CodeScore, check_program, extract_program, parse_tests
from rlcore.rewards.math_verify_grader import math_verify_reward
from rlcore.rewards.sandbox import SandboxLimits


class RewardFn(Protocol):
    def __call__(self, response: str, ground_truth: str, **extra) -> float: ...


_REGISTRY: Registry[RewardFn] = Registry("reward function")
register_reward_fn = _REGISTRY.register


# data_source -> the verifier a prompt source brought along (rlcore.data.sources), bound when the run
# loads its data. Unlike a registered name it may be bound again: each run (a test, a notebook) binds
# the function of its own source, which closes over that source's settings.
_SOURCE_BOUND: dict[str, RewardFn] = {}


def bind_source_reward(data_source: str, fn: RewardFn) -> None:
    """Make ``fn`` the function of rows whose data_source is ``data_source`` in this process (and in the
    scoring processes it forks): the rows of a prompt source carry their own verifier, and the reward
    manager finds it the way it finds a registered name. A name registered with ``register_reward_fn``
    cannot be rebound: a source may not silently replace a built-in."""
    if not isinstance(data_source, str) or not data_source or ":" in data_source:
        raise ValueError(f"a source's data_source must be a non-empty string without ':', got {data_source!r}")
    if data_source in _REGISTRY:
        raise ValueError(f"data_source {data_source!r} is a registered reward function's name; a prompt source "
                         "with its own reward needs another data_source")
    if not callable(fn):
        raise TypeError(f"the reward of source {data_source!r} is a {type(fn).__name__}, not callable")
    _SOURCE_BOUND[data_source] = fn


def get_reward_fn(name_or_path: str) -> RewardFn:
    """A registered reward function, or one imported from "module:function" / "file.py:function"
    (or a prompt source's own function, bound to its data_source: ``bind_source_reward``)."""
    if name_or_path in _SOURCE_BOUND:
        return _SOURCE_BOUND[name_or_path]
    if name_or_path in _REGISTRY:
        return _REGISTRY.get(name_or_path)
    if ":" not in name_or_path:
        raise UnknownNameError(f"unknown reward function {name_or_path!r}{did_you_mean(name_or_path, _REGISTRY.names())}"
                               f"; registered: {_REGISTRY.names()}, or give 'package.module:function' or "
                               f"'/path/file.py:function'")
    module = load_module(name_or_path, "reward function")
    where, attr = name_or_path.rsplit(":", 1)
    fn = getattr(module, attr, None)
    if fn is None:
        raise UnknownNameError(f"{where!r} defines no {attr!r}{did_you_mean(attr, public_callables(module))} "
                               f"(from reward function {name_or_path!r})")
    if not callable(fn):
        raise TypeError(f"{name_or_path!r} is a {type(fn).__name__}, "
                        "not a callable reward function")
    return fn


# data_source of verl's preprocessing scripts (verl/examples/data_preprocess) -> the built-in that scores it.
VERL_DATA_SOURCES = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math",
    **{f"numina_{name}": "math" for name in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc",
                                             "cn_k12", "olympiads")},
}
VERL_SOURCE_PREFIXES = {"aime": "math"}  # aime_2024, aime2025, ... (verl: data_source.startswith("aime"))


def reward_fn_for_source(source: str) -> str | None:
    """The registered name that scores rows of this data_source: the source itself when registered,
    else the built-in a verl data source maps to, else None. A prompt source's own function
    (``bind_source_reward``) is found under its data_source."""
    if source in _REGISTRY or source in _SOURCE_BOUND:
        return source
    if source in VERL_DATA_SOURCES:
        return VERL_DATA_SOURCES[source]
    return next((name for prefix, name in VERL_SOURCE_PREFIXES.items() if source.startswith(prefix)), None)


@register_reward_fn("arithmetic")
def arithmetic_reward(response: str, ground_truth: str, **extra) -> float:
    """1.0 when the response's first line, before any "</s>", stripped, is the ground truth.

    Exact string match on purpose: the arithmetic task (rlcore.data.arithmetic) teaches an exact
    format, "15" then end of sequence; "15.0", "015" or "15 apples" earn nothing.
    """
    answer = response.split("</s>", 1)[0].split("\n", 1)[0].strip()
    return float(answer == ground_truth.strip())


@register_reward_fn("gsm8k")
def gsm8k_reward(response: str, ground_truth: str, *, method: str = "strict",
                 format_score: float = 0.0, **extra) -> float:
    """1.0 for a correct final answer, `format_score` for a wrong one, 0.0 when none is found.

    method="strict" reads only a "#### <number>" line, the format GSM8K's solutions use;
    method="flexible" falls back to the last number in the response. The ground truth may be a
    bare number (verl's gsm8k files: the number after "####", commas removed) or a whole GSM8K solution
    ending in "#### <number>"; numbers compare by value, so "#### 1,000", "#### 1000.0" and "#### $1000"
    all match "1000".
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    answer = extract_gsm8k_answer(response)
    if answer is None and method == "flexible":
        answer = extract_last_number(response)
    if answer is None:
        return 0.0
    ground_truth = str(ground_truth)  # a parquet column of numbers: 72, not "72"
    truth = extract_gsm8k_answer(ground_truth) or ground_truth
    return 1.0 if answers_equal(answer, truth) else format_score


@register_reward_fn("final_number")
@register_reward_fn("arithmetic_words")
@register_reward_fn("multi_step")
def final_number_reward(response: str, ground_truth: str, **extra) -> float:
    """1.0 when the response's final number (after the last "answer is", else its last number) equals
    the ground truth by value; 0.0 otherwise or without a number.

    The checker of the word-problem tasks (rlcore.data.word_problems) a real chat model is trained
    on: lenient about form ("59+63 is 122.", "The answer is 122.", "122"), so what it rewards is the
    right number, not a format the model was never taught.
    """
    answer = extract_final_number(response)
    return 1.0 if answer is not None and answers_equal(answer, str(ground_truth)) else 0.0


@register_reward_fn("math")
def math_reward(response: str, ground_truth: str, *, format_score: float = 0.0,
                **extra) -> float:
    """1.0 when the last \\boxed{} (else the last <answer> tag, else the last line starting "Answer:", the
    form DAPO's prompts ask for) equals the ground truth.

    `format_score` rewards a wrong answer given in the right form; no answer scores 0.0. The
    ground truth may itself contain a \\boxed{} (MATH solutions), which is then what counts.
    """
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    ground_truth = str(ground_truth)
    truth = extract_boxed(ground_truth) or ground_truth
    return 1.0 if answers_equal(answer, truth) else format_score


register_reward_fn("math_verify")(math_verify_reward)


@register_reward_fn("code")
def code_reward(response: str, ground_truth: Any, *, sandbox_limits: Mapping[str, float] | None = None,
                budget_s: float | None = 8.0, **extra) -> CodeScore:
    """The fraction of the row's tests that the response's program passes, run in a sandbox
    (rlcore.rewards.sandbox); 0.0 when a run hits a limit or the isolation (a loop, a fork bomb, a huge
    allocation, an output flood, network, a write outside its directory).

    The program is the response's last ```python block (else its last fenced block, else all of it).
    The ground truth is a JSON list of tests (see `parse_tests`); rlcore.data.code_tasks writes such
    rows. A fraction rather than all-or-nothing, so a half-right function already earns a signal.
    `sandbox_limits` overrides fields of `SandboxLimits` (e.g. {"wall_s": 2}); `budget_s` bounds all
    runs of one row together and must stay below the manager's `timeout_s` (default 10 s). The
    returned float's `.reason` says what happened; the manager keeps only the number.
    """
    limits = SandboxLimits(**sandbox_limits) if sandbox_limits else SandboxLimits()
    return check_program(extract_program(response), parse_tests(ground_truth), limits, budget_s=budget_s)
