import textwrap

import pytest

from rlcore.rewards import registry
from rlcore.rewards import (
    answers_equal,
    extract_answer_tag,
    extract_boxed,
    extract_gsm8k_answer,
    extract_last_number,
    get_reward_fn,
    normalize_answer,
    register_reward_fn,
)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{2}", "2"),
    (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
    (r"\boxed{ \{1, 2\} }", r"\{1, 2\}"),
    (r"\boxed{a{b{c}}d}", "a{b{c}}d"),
    (r"The answer is $\boxed 5$.", "5"),
    (r"\boxed{12", None),
    ("no box here", None),
    (r"\boxed", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>x</think><answer> 7 </answer>", "7"),
    ("<answer>1</answer> <answer>\n2\n</answer>", "2"),
    ("<answer>open", None),
    ("none", None),
])
def test_extract_answer_tag(text, expected):
    assert extract_answer_tag(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("#### $18", "18"),
    ("####-3.5", "-3.5"),
    ("#### 1\nlater #### 2", "2"),
    ("The answer is 42", None),
    ("#### forty", None),
])
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("I got 3 then 1,000.", "1000"),
    ("x = -2.5 and done", "-2.5"),
    ("it is 42.", "42"),
    ("no digits", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize("raw, expected", [
    ("  Yes ", "yes"),
    (r"$\text{Paris}$", "paris"),
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    ("x = 5", "5"),
    (r"90^\circ", "90"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    ("42.", "42"),
    ("\u22123", "-3"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize("a, b", [
    ("3", "3.0"),
    ("3", " 3 "),
    ("1/2", "0.5"),
    (r"\frac{1}{2}", "0.5"),
    (r"\dfrac12", "1/2"),
    (r"\tfrac{3}{4}", "0.75"),
    (r"-\frac{1}{2}", "-0.5"),
    ("1e5", "100000"),
    ("1E-2", "0.01"),
    ("1,000", "1000"),
    ("1,000,000.5", "1000000.5"),
    ("$5", "5"),
    (r"\$5", "5.00"),
    ("50%", "50"),
    (r"50\%", "50"),
    (r"\text{yes}", "Yes"),
    ("x = 3", "3"),
    ("+7", "7"),
    ("-0", "0"),
    ("(1, 2)", "(1,2)"),
    (r"\sqrt{2}", r"\sqrt{2}"),
])
def test_answers_equal_positive(a, b):
    assert answers_equal(a, b)
    assert answers_equal(b, a)


@pytest.mark.parametrize("a, b", [
    ("1/2", "0.25"),
    ("3", "30"),
    ("1/3", "0.333"),
    ("1,2", "12"),
    ("-3", "3"),
    ("1e5", "1e6"),
    ("1/0", "0"),
    ("", ""),
    ("yes", "no"),
    (r"\sqrt{2}", "1.414"),
    ("inf", "infinity"),
    ("nan", "0"),
])
def test_answers_equal_negative(a, b):
    assert not answers_equal(a, b)
    assert not answers_equal(b, a)


def test_huge_exponent_is_not_expanded():
    # Would build a billion-digit integer if parsed; must be refused quickly instead.
    assert not answers_equal("1e1000000000", "1e1000000001")


@pytest.mark.parametrize("response, truth, expected", [
    ("15", "15", 1.0),
    (" 15 \n7+1=8", "15", 1.0),
    ("15</s><pad>", "15", 1.0),
    ("-4", "-4", 1.0),
    ("15.0", "15", 0.0),
    ("015", "15", 0.0),
    ("1", "15", 0.0),
    ("", "0", 0.0),
    ("15+1=16", "15", 0.0),
])
def test_arithmetic_reward(response, truth, expected):
    assert get_reward_fn("arithmetic")(response, truth, prompt="7+8=") == expected


@pytest.mark.parametrize("response, truth, kwargs, expected", [
    ("3 + 4 = 7\n#### 7", "7", {}, 1.0),
    ("#### 1,000", "Natalia sold 1000 clips.\n#### 1000", {}, 1.0),
    ("#### 8", "7", {}, 0.0),
    ("#### 8", "7", {"format_score": 0.1}, 0.1),
    ("the answer is 7", "7", {}, 0.0),
    ("the answer is 7", "7", {"method": "flexible"}, 1.0),
    ("the answer is 7", "7", {"method": "flexible", "format_score": 0.1}, 1.0),
    ("no number", "7", {"method": "flexible", "format_score": 0.1}, 0.0),
])
def test_gsm8k_reward(response, truth, kwargs, expected):
    assert get_reward_fn("gsm8k")(response, truth, data_source="gsm8k", **kwargs) == expected


def test_gsm8k_reward_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        get_reward_fn("gsm8k")("#### 1", "1", method="loose")


@pytest.mark.parametrize("response, truth, kwargs, expected", [
    (r"so $\boxed{\dfrac{1}{2}}$", "0.5", {}, 1.0),
    (r"first \boxed{3}, no: \boxed{4}", "4", {}, 1.0),
    ("<answer>1/2</answer>", r"\frac12", {}, 1.0),
    (r"\boxed{2}", r"Thus the answer is $\boxed{2}$.", {}, 1.0),
    (r"\boxed{0.25}", "1/2", {}, 0.0),
    (r"\boxed{0.25}", "1/2", {"format_score": 0.2}, 0.2),
    ("the answer is 1/2", "1/2", {"format_score": 0.2}, 0.0),
])
def test_math_reward(response, truth, kwargs, expected):
    assert get_reward_fn("math")(response, truth, **kwargs) == expected


def test_register_and_look_up_by_name(monkeypatch):
    monkeypatch.setattr(registry._REGISTRY, "_entries", dict(registry._REGISTRY._entries))  # undo after the test

    @register_reward_fn("test_length_reward")
    def length_reward(response, ground_truth, **extra):
        return float(len(response))

    assert get_reward_fn("test_length_reward") is length_reward
    assert get_reward_fn("test_length_reward")("abc", "") == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("test_length_reward")(length_reward)


def test_look_up_by_module_path():
    assert get_reward_fn("rlcore.rewards.registry:math_reward") is get_reward_fn("math")


def test_look_up_by_file_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent("""
        THRESHOLD = 2

        def longer_than(response, ground_truth, **extra):
            return 1.0 if len(response) > THRESHOLD else -1.0
    """))
    fn = get_reward_fn(f"{path}:longer_than")
    assert fn("abc", "x") == 1.0
    assert fn("ab", "x") == -1.0
    with pytest.raises(TypeError, match="not a callable"):
        get_reward_fn(f"{path}:THRESHOLD")
    with pytest.raises(ValueError, match="defines no 'missing'"):
        get_reward_fn(f"{path}:missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_reward_fn(f"{tmp_path / 'absent.py'}:longer_than")


def test_unknown_name_lists_builtins():
    with pytest.raises(ValueError, match=r"\['arithmetic', 'arithmetic_words', 'code', 'final_number', 'gsm8k', 'math'"):
        get_reward_fn("gsm9k")


def test_unknown_module_raises_import_error():
    with pytest.raises(ModuleNotFoundError):
        get_reward_fn("no_such_package.rewards:fn")
