"""The guess-the-number env and the env registry, against hand-written token ids and rewards."""

import random

import pytest

from rlcore.agentic.env import Env, GuessNumberEnv, make_env, register_env
from rlcore.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_observations_are_the_envs_own_token_ids(tok):
    env = GuessNumberEnv(tok, low=1, high=20, max_turns=3)
    obs = env.reset(target=7)
    assert obs == ids(tok, "user: guess my number from 1 to 20.\nassistant: ")
    assert all(isinstance(t, int) for t in obs)
    # The char tokenizer: digit d is id 4 + d, so "20." starts with 6, 4.
    assert obs[obs.index(6):][:2] == [6, 4]
    assert tok.decode(obs) == "user: guess my number from 1 to 20.\nassistant: "


def test_replies_rewards_and_turn_discount(tok):
    env = GuessNumberEnv(tok, low=1, high=100, max_turns=5, discount=0.5)
    env.reset(target=37)
    eos = tok.eos_token_id
    obs, reward, done, info = env.step(ids(tok, "50") + [eos])  # the model's eos is not part of the answer
    assert (obs, reward, done) == (ids(tok, "\nuser: too high\nassistant: "), 0.0, False)
    assert info == {"guess": 50, "turn": 1}
    obs, reward, done, _ = env.step(ids(tok, "i say 3"))
    assert (obs, reward, done) == (ids(tok, "\nuser: too low\nassistant: "), 0.0, False)
    obs, reward, done, _ = env.step(ids(tok, "hmm?"))
    assert (obs, reward, done) == (ids(tok, "\nuser: say a number\nassistant: "), 0.0, False)
    obs, reward, done, info = env.step(ids(tok, "37") + [eos])
    assert (obs, done, info) == (ids(tok, "\ncorrect"), True, {"guess": 37, "turn": 4})
    assert reward == 0.5 ** 3  # found on turn 4
    with pytest.raises(RuntimeError, match="reset"):
        env.step(ids(tok, "1"))


def test_episode_ends_after_max_turns_without_reward(tok):
    env = GuessNumberEnv(tok, max_turns=2)
    env.reset(target=10)
    assert env.step(ids(tok, "1"))[1:3] == (0.0, False)
    obs, reward, done, _ = env.step(ids(tok, "99"))
    assert (obs, reward, done) == (ids(tok, "\ntoo high"), 0.0, True)


def test_seeded_targets_are_reproducible_and_in_range(tok):
    env = GuessNumberEnv(tok, low=3, high=9)
    targets = []
    for seed in range(20):
        env.reset(seed=seed)
        targets.append(env.target)
    assert targets == [random.Random(s).randint(3, 9) for s in range(20)]
    assert len(set(targets)) > 1
    with pytest.raises(ValueError, match="outside"):
        env.reset(target=10)


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
        def reset(self, seed=None, text="hi"):
            return self.encode(text)

        def step(self, action_token_ids):
            return self.encode(self.decode_action(action_token_ids)), 1.0, True, {}

    echo = make_env("echo_test_env", tok)
    assert echo.reset(text="ab") == ids(tok, "ab")
    assert echo.step(ids(tok, "xy") + [tok.eos_token_id])[0] == ids(tok, "xy")


def test_arithmetic_retry_asks_again_until_right_or_out_of_tries(tok):
    env = make_env("arithmetic_retry", tok, max_turns=3, discount=0.5)
    eos = [tok.eos_token_id]
    assert tok.decode(env.reset(prompt="12+5=", answer="17")) == "12+5="
    wrong = env.step(tok.encode("13", add_special_tokens=False) + eos)
    assert (wrong.reward, wrong.done) == (0.0, False) and tok.decode(wrong.observation) == "\n12+5="
    right = env.step(tok.encode("17", add_special_tokens=False) + eos)
    assert (right.reward, right.done, right.observation) == (0.5, True, [])  # right at the 2nd try: 0.5
    env.reset(prompt="1+1=", answer="2")
    results = [env.step(tok.encode("3", add_special_tokens=False)) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and sum(r.reward for r in results) == 0.0
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step([5])
    with pytest.raises(ValueError, match="needs prompt= .* and answer="):
        env.reset(prompt="1+1=")
    with pytest.raises(ValueError, match="max_turns >= 1"):
        make_env("arithmetic_retry", tok, max_turns=0)
