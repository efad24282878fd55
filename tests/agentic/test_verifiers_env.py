"""A verifiers MultiTurnEnv played through rlcore's env API (rlcore.agentic.verifiers_env): turns
scripted as token ids, the environment's own env_response and stop conditions, its rubric's reward."""

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("verifiers")
from rlcore.agentic.verifiers_env import VerifiersEnv  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "data" / "source_fixtures.py"


def play(env, task, replies):
    async def episode():
        observations = [await env.reset(task)]
        for text in replies:
            result = await env.step(env.encode(text))
            observations.append(result.observation)
            if result.terminated:
                return observations, result
        return observations, result
    return asyncio.run(episode())


def test_wrong_then_right_ends_with_the_rubric_reward(tok):
    env = VerifiersEnv(tok, f"{FIXTURES}:retry_env", {"max_turns": 3})
    task = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}
    observations, result = play(env, task, ["<answer>4</answer>", "<answer>5</answer>"])
    assert result.terminated and result.reward == 1.0 and result.info["turns"] == 2.0
    assert "wrong, try again." in tok.decode(observations[1])  # the environment's reply, after the model's turn
    assert tok.decode(observations[0]).count("2+3=") == 1


def test_max_turns_ends_unsolved_with_zero(tok):
    env = VerifiersEnv(tok, f"{FIXTURES}:retry_env", {"max_turns": 2})
    _, result = play(env, {"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}, ["3", "4", "5"])
    assert result.terminated and result.reward == 0.0 and result.info["turns"] == 2.0
    with pytest.raises(RuntimeError, match="finished episode"):
        asyncio.run(env.step(env.encode("2")))


def test_a_single_turn_source_refuses_a_multi_turn_environment(tok):
    from rlcore.data.verifiers_source import load_env
    with pytest.raises(ValueError, match="multi-turn environment"):
        load_env(f"{FIXTURES}:retry_env", {})
