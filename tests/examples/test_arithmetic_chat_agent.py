"""The example chat agent's two checks: the exact reply (tiny models) and the final number (a real chat model)."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "arithmetic_chat", Path(__file__).resolve().parents[2] / "examples" / "agents" / "arithmetic_chat.py")
agent = importlib.util.module_from_spec(spec)
spec.loader.exec_module(agent)


@pytest.mark.parametrize("text,number", [("17 + 25 = 42.", "42"), ("The answer is 7. Then 9 more", "7"),
                                         ("3 - 5 = -2", "-2"), ("The answer is: 12", "12"), ("no number", None)])
def test_final_number(text, number):
    assert agent.final_number(text) == number


def test_checks():
    exact, number = agent.RetryAgent(), agent.RetryAgent(check="number")
    assert exact.right(" 42", "42") and not exact.right("17 + 25 = 42", "42")
    assert number.right("17 + 25 = 42", "42") and number.right("42.0", 42) and not number.right("41", "42")
    assert not number.right("no idea", "42")
    with pytest.raises(ValueError, match="check must be"):
        agent.RetryAgent(check="fuzzy")
