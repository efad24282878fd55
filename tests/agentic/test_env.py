"""The async, token-first env contract (reset(task) -> ids, step(ids) -> Result), the built-in envs,
simulated latency and the registry, against hand-written token ids and rewards."""

import asyncio
import math
import random
import time

import pytest

from rlcore.agentic.env import Env, GuessNumberEnv, LatencyEnv, Result, make_env, register_env
from rlcore.models.tiny import build_char_tokenizer

run = asyncio.run


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_observations_are_the_envs_own_token_ids(tok):
    env = GuessNumberEnv(tok, low=1, high=20, max_turns=3)
    obs = run(env.reset({"target": 7}))
    assert obs == ids(tok, "user: guess my number from 1 to 20.\nassistant: ")
    assert all(isinstance(t, int) for t in obs)
    # The char tokenizer: digit d is id 4 + d, so "20." starts with 6, 4.
    assert obs[obs.index(6):][:2] == [6, 4]
    assert tok.decode(obs) == "user: guess my number from 1 to 20.\nassistant: "


def test_replies_rewards_and_turn_discount(tok):
    env = GuessNumberEnv(tok, low=1, high=100, max_turns=5, discount=0.5)
    run(env.reset({"target": 37}))
    eos = tok.eos_token_id
    r = run(env.step(ids(tok, "50") + [eos]))  # the model's eos is not part of the answer
    assert (r.observation, r.reward, r.terminated, r.truncated) == (ids(tok, "\nuser: too high\nassistant: "), 0.0,
                                                                      False, False)
    assert r.info == {"guessed": 1.0, "turn": 1.0}
    r = run(env.step(ids(tok, "i say 3")))
    assert (r.observation, r.reward, r.terminated) == (ids(tok, "\nuser: too low\nassistant: "), 0.0, False)
    r = run(env.step(ids(tok, "hmm?")))
    assert (r.observation, r.reward, r.terminated, r.info["guessed"]) == (
        ids(tok, "\nuser: say a number\nassistant: "), 0.0, False, 0.0)
    r = run(env.step(ids(tok, "37") + [eos]))
    assert (r.observation, r.terminated, r.info) == (ids(tok, "\ncorrect"), True, {"guessed": 1.0, "turn": 4.0})
    assert r.reward == 0.5 ** 3  # found on turn 4
    with pytest.raises(RuntimeError, match="reset"):
        run(env.step(ids(tok, "1")))


def test_episode_ends_after_max_turns_without_reward(tok):
    env = GuessNumberEnv(tok, max_turns=2)
    run(env.reset({"target": 10}))
    first = run(env.step(ids(tok, "1")))
    assert (first.reward, first.terminated) == (0.0, False)
    last = run(env.step(ids(tok, "99")))
    assert (last.observation, last.reward, last.terminated) == (ids(tok, "\ntoo high"), 0.0, True)


def test_seeded_targets_are_reproducible_and_in_range(tok):
    env = GuessNumberEnv(tok, low=3, high=9)
    targets = []
    for seed in range(20):
        run(env.reset({"seed": seed}))
        targets.append(env.target)
    assert targets == [random.Random(s).randint(3, 9) for s in range(20)]
    assert len(set(targets)) > 1
    with pytest.raises(ValueError, match="outside"):
        run(env.reset({"target": 10}))


def test_bad_arguments_are_named(tok):
    with pytest.raises(ValueError, match="low <= high"):
        GuessNumberEnv(tok, low=5, high=1)
    with pytest.raises(ValueError, match="max_turns"):
        GuessNumberEnv(tok, max_turns=0)
    with pytest.raises(ValueError, match="discount"):
        GuessNumberEnv(tok, discount=0.0)


def test_registry(tok):
    env = make_env("guess_number", tok, high=5)
    assert isinstance(env, GuessNumberEnv) and env.high == 5
    with pytest.raises(ValueError, match="unknown env 'nope'.*guess_number"):
        make_env("nope", tok)
    with pytest.raises(ValueError, match="already registered"):
        register_env("guess_number")(GuessNumberEnv)

    @register_env("echo_test_env")
    class Echo(Env):
        async def reset(self, task):
            return self.encode(task.get("text", "hi"))

        async def step(self, action_token_ids):
            return Result(1.0, self.encode(self.decode_action(action_token_ids)), terminated=True)

    echo = make_env("echo_test_env", tok)
    assert run(echo.reset({"text": "ab"})) == ids(tok, "ab")
    assert run(echo.step(ids(tok, "xy") + [tok.eos_token_id])).observation == ids(tok, "xy")


def test_arithmetic_retry_asks_again_until_right_or_out_of_tries(tok):
    env = make_env("arithmetic_retry", tok, max_turns=3, discount=0.5)
    eos = [tok.eos_token_id]
    assert tok.decode(run(env.reset({"prompt": "12+5=", "answer": "17"}))) == "12+5="
    wrong = run(env.step(tok.encode("13", add_special_tokens=False) + eos))
    assert (wrong.reward, wrong.terminated) == (0.0, False) and tok.decode(wrong.observation) == "\n12+5="
    right = run(env.step(tok.encode("17", add_special_tokens=False) + eos))
    assert (right.reward, right.terminated, right.observation) == (0.5, True, [])  # right at the 2nd try: 0.5
    run(env.reset({"prompt": "1+1=", "answer": "2"}))
    results = [run(env.step(tok.encode("3", add_special_tokens=False))) for _ in range(3)]
    assert [r.terminated for r in results] == [False, False, True] and sum(r.reward for r in results) == 0.0
    with pytest.raises(RuntimeError, match="finished episode"):
        run(env.step([5]))
    with pytest.raises(ValueError, match="'prompt'.*'answer'"):
        run(env.reset({"prompt": "1+1="}))
    with pytest.raises(ValueError, match="max_turns >= 1"):
        make_env("arithmetic_retry", tok, max_turns=0)


def test_simulated_latency_is_lognormal_with_the_given_mean_and_seeded(tok):
    env = make_env("arithmetic_retry", tok, step_latency_s=0.02, latency_sigma=1.0)
    assert isinstance(env, LatencyEnv)
    run(env.reset({"prompt": "1+1=", "answer": "2", "seed": 3}))
    delays = [env.delay() for _ in range(4000)]
    assert math.isclose(sum(delays) / len(delays), 0.02, rel_tol=0.1)  # the mean asked for
    assert max(delays) > 5 * 0.02  # heavy-tailed
    run(env.reset({"prompt": "1+1=", "answer": "2", "seed": 3}))
    assert [env.delay() for _ in range(3)] == delays[:3]  # the task's seed fixes the stream
    run(env.reset({"prompt": "1+1=", "answer": "2", "seed": 3}))
    start = time.perf_counter()
    result = run(env.step(ids(tok, "2")))
    assert time.perf_counter() - start >= delays[0] * 0.9 and result.reward == 1.0  # slept, then stepped
