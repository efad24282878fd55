"""MultiTurnRollout: exact trajectories with a scripted policy, structure and log-probs with the HF backend."""

import asyncio
import functools

import pytest
import torch

from rlcore.agentic.env import Env, GuessNumberEnv, Result, make_env
from rlcore.agentic.multi_turn import EnvEpisodes, MultiTurnRollout
from rlcore.engines.base import Generation, RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_char_tokenizer, build_tiny_model


def settings(**kw):
    base = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, n=1, do_sample=True)
    return SamplingSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


class ScriptedPolicy:
    """Call k answers ``answers[k]`` + eos on every row, with log-prob -(k+1)/10 per token; records its inputs."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.calls = tok, answers, []

    def __call__(self, input_ids, attention_mask, position_ids, settings):
        k = len(self.calls)
        self.calls.append((input_ids.clone(), attention_mask.clone(), position_ids.clone(), settings))
        answer = (ids(self.tok, self.answers[k]) + [self.tok.eos_token_id])[: settings.max_new_tokens]
        rows, width = input_ids.shape[0], settings.max_new_tokens
        responses = torch.zeros((rows, width), dtype=torch.long)
        responses[:, : len(answer)] = torch.tensor(answer)
        return Generation(responses=responses, lengths=torch.full((rows,), len(answer)),
                          log_probs=torch.full((rows, width), -(k + 1) / 10))


def unpadded_contexts(call):
    input_ids, mask, positions, _ = call
    for row in range(input_ids.shape[0]):
        assert positions[row][mask[row].bool()].tolist() == list(range(int(mask[row].sum())))
    return [input_ids[r][mask[r].bool()].tolist() for r in range(input_ids.shape[0])]


def test_scripted_episodes_exact_tokens_masks_rewards(tok):
    eos = tok.eos_token_id
    policy = ScriptedPolicy(tok, ["50", "25", "37", "43"])
    env_factory = functools.partial(GuessNumberEnv, tok, max_turns=3, discount=0.9)
    rollout = MultiTurnRollout(policy, tok, env_factory, max_turns=4, max_total_tokens=200, settings=settings())
    out = rollout.run([{"target": 50}, {"target": 37}, {"target": 99}])

    prompt = ids(tok, "user: guess my number from 1 to 100.\nassistant: ")
    high, low = ids(tok, "\nuser: too high\nassistant: "), ids(tok, "\nuser: too low\nassistant: ")
    a50, a25, a37 = (ids(tok, a) + [eos] for a in ("50", "25", "37"))
    assert a50 == [9, 4, 2]  # digit d is id 4 + d, eos is 2
    # (token ids, policy mask, log-prob) per episode, built by hand from the script and the env's rules.
    turn = lambda toks, k: (toks, [1] * len(toks), [-(k + 1) / 10] * len(toks))  # noqa: E731
    env = lambda toks: (toks, [0] * len(toks), [0.0] * len(toks))  # noqa: E731
    expected = [
        [turn(a50, 0)],
        [turn(a50, 0), env(high), turn(a25, 1), env(low), turn(a37, 2)],
        [turn(a50, 0), env(low), turn(a25, 1), env(low), turn(a37, 2)],  # env ends after its 3 turns
    ]
    width = max(sum(len(p[0]) for p in parts) for parts in expected)
    assert out.batch["responses"].shape == (3, width)
    for row, parts in enumerate(expected):
        tokens = sum((p[0] for p in parts), [])
        mask = sum((p[1] for p in parts), [])
        log_probs = sum((p[2] for p in parts), [])
        pad = width - len(tokens)
        assert out.batch["responses"][row].tolist() == tokens + [tok.pad_token_id] * pad
        assert out.batch["response_mask"][row].tolist() == mask + [0] * pad
        assert out.batch["attention_mask"][row].tolist() == [1] * len(prompt) + [1] * len(tokens) + [0] * pad
        torch.testing.assert_close(out.batch["rollout_log_probs"][row], torch.tensor(log_probs + [0.0] * pad))
        assert out.batch["input_ids"][row, : len(prompt) + len(tokens)].tolist() == prompt + tokens
        assert out.batch["position_ids"][row].tolist() == list(range(len(prompt) + width))
    scores = out.batch["token_level_scores"]
    assert scores[0, 2] == 1.0 and scores[1, len(sum((p[0] for p in expected[1]), [])) - 1] == pytest.approx(0.81)
    assert scores.abs().sum() == pytest.approx(1.81)  # one reward per episode, on its last model token
    assert out.non_tensor_batch["num_turns"].tolist() == [1, 3, 3]
    assert out.non_tensor_batch["truncated"].tolist() == [False, False, False]
    assert out.meta_info["rollout/num_generated_tokens"] == 3 + 9 + 9
    assert out.meta_info["temperature"] == 1.0

    # Batched turn by turn: only live episodes are sent, each with its full context so far.
    assert [len(unpadded_contexts(c)) for c in policy.calls] == [3, 2, 2]
    assert unpadded_contexts(policy.calls[1]) == [prompt + a50 + high, prompt + a50 + low]
    assert unpadded_contexts(policy.calls[2])[0] == prompt + a50 + high + a25 + low


def test_rollout_max_turns_truncates(tok):
    policy = ScriptedPolicy(tok, ["1", "2"])
    rollout = MultiTurnRollout(policy, tok, functools.partial(GuessNumberEnv, tok, max_turns=5), max_turns=2,
                               max_total_tokens=200, settings=settings())
    out = rollout.run([{"target": 9}])
    assert out.non_tensor_batch["num_turns"].tolist() == [2]
    assert out.non_tensor_batch["truncated"].tolist() == [True]
    assert out.batch["token_level_scores"].abs().sum() == 0
    # The env's reply to the last turn is part of the context it would have conditioned: kept.
    assert out.batch["response_mask"][0].tolist()[-1] == 0


class PointsEnv(Env):
    """Half a point per turn, never done: rewards add up and land on the last *model* token."""

    async def reset(self, task):
        return self.encode("go:")

    async def step(self, action_token_ids):
        return Result(0.5, self.encode("ok;"))


def test_step_rewards_sum_onto_the_last_model_token(tok):
    rollout = MultiTurnRollout(ScriptedPolicy(tok, ["1", "2", "3"]), tok, functools.partial(PointsEnv, tok),
                               max_turns=3, max_total_tokens=200, settings=settings())
    out = rollout.run([{}])
    eos = tok.eos_token_id
    assert out.batch["responses"][0].tolist() == ids(tok, "1") + [eos] + ids(tok, "ok;2") + [eos] + ids(
        tok, "ok;3") + [eos] + ids(tok, "ok;")
    assert out.batch["token_level_scores"][0].tolist() == [0.0] * 11 + [1.5, 0.0, 0.0, 0.0]
    assert out.non_tensor_batch["truncated"].tolist() == [True]


def test_token_budget(tok):
    prompt_len = len(ids(tok, "user: guess my number from 1 to 100.\nassistant: "))
    reply_len = len(ids(tok, "\nuser: too low\nassistant: "))
    # Room for one full answer ("5" + eos) and the env's reply, then only 2 tokens of "123" + eos.
    budget = prompt_len + 2 + reply_len + 2
    policy = ScriptedPolicy(tok, ["5", "123"])
    rollout = MultiTurnRollout(policy, tok, functools.partial(GuessNumberEnv, tok), max_turns=5,
                               max_total_tokens=budget, settings=settings(max_new_tokens=8))
    out = rollout.run([{"target": 12}])
    assert int(out.batch["attention_mask"].sum()) == budget
    assert policy.calls[1][3].max_new_tokens == 2  # the engine is asked for no more than fits
    assert out.batch["responses"][0, -2:].tolist() == ids(tok, "12")  # the cut answer still goes to the env ...
    assert out.batch["token_level_scores"][0, -1] == pytest.approx(0.9)  # ... which finds it correct on turn 2
    assert out.non_tensor_batch["truncated"].tolist() == [False]

    # A reply that leaves no room for another model token ends the episode as truncated, unappended.
    out = MultiTurnRollout(ScriptedPolicy(tok, ["5"]), tok, functools.partial(GuessNumberEnv, tok), max_turns=5,
                           max_total_tokens=prompt_len + 2 + reply_len, settings=settings()).run([{"target": 12}])
    assert out.batch["response_mask"][0].tolist() == [1, 1]
    assert out.non_tensor_batch["truncated"].tolist() == [True]


def test_bad_input_is_named(tok):
    env_factory = functools.partial(GuessNumberEnv, tok)
    with pytest.raises(ValueError, match="n=2"):
        MultiTurnRollout(ScriptedPolicy(tok, []), tok, env_factory, 2, 100, settings(n=2))
    with pytest.raises(TypeError, match="engine"):
        MultiTurnRollout(object(), tok, env_factory, 2, 100, settings())
    with pytest.raises(ValueError, match="initial observation has 48 tokens"):
        MultiTurnRollout(ScriptedPolicy(tok, []), tok, env_factory, 2, 40, settings()).run([{}])
    with pytest.raises(ValueError, match="2 seeds for 1 tasks"):
        MultiTurnRollout(ScriptedPolicy(tok, []), tok, env_factory, 2, 100, settings()).run([{}], seeds=[1, 2])
    def silent(input_ids, attention_mask, position_ids, settings):
        rows = input_ids.shape[0]
        return Generation(torch.zeros((rows, 1), dtype=torch.long), torch.zeros(rows), torch.zeros((rows, 1)))

    with pytest.raises(RuntimeError, match="empty turn"):
        MultiTurnRollout(silent, tok, env_factory, 2, 100, settings()).run([{}])


# ------------------------------------------------------------------ the real HF backend
@pytest.fixture(scope="module")
def hf_backend(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny_mt"), seed=0)
    return HFEngine(ModelConfig(path=path), RolloutConfig(seed=3))


def test_hf_backend_trajectories(hf_backend):
    tok, model = hf_backend.tokenizer, hf_backend.model
    max_total, temperature = 110, 0.7
    env_factory = functools.partial(make_env, "guess_number", tok, max_turns=3)
    rollout = MultiTurnRollout(hf_backend, tok, env_factory, max_turns=4, max_total_tokens=max_total,
                               settings=settings(temperature=temperature, max_new_tokens=7))
    seeds = [11, 12, 13, 14]
    out = rollout.run([{}] * 4, seeds=seeds)
    b = out.batch
    t_p = b["prompts"].shape[1]
    assert out.meta_info["temperature"] == temperature
    assert (b["attention_mask"].sum(1) <= max_total).all()
    assert int(b["response_mask"].sum()) == out.meta_info["rollout/num_generated_tokens"]
    env_tokens = 0
    for row, seed in enumerate(seeds):
        real = b["attention_mask"][row].bool()
        seq = b["input_ids"][row][real].tolist()
        n_resp = int(b["attention_mask"][row, t_p:].sum())
        response = b["responses"][row, :n_resp].tolist()
        policy = b["response_mask"][row, :n_resp].tolist()
        assert (b["response_mask"][row, n_resp:] == 0).all() and (b["rollout_log_probs"][row, n_resp:] == 0).all()
        # Split into runs: model turns (mask 1) alternate with env replies (mask 0).
        runs, start = [], 0
        for j in range(1, n_resp + 1):
            if j == n_resp or policy[j] != policy[start]:
                runs.append((policy[start], response[start:j]))
                start = j
        assert [m for m, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
        # Replaying the model's turns in a fresh env gives byte-identical env tokens.
        replay = GuessNumberEnv(tok, max_turns=3)
        assert seq[: len(seq) - n_resp] == asyncio.run(replay.reset({"seed": seed}))
        total_reward = 0.0
        for (_, action), nxt in zip(runs[::2], runs[1::2] + [None]):
            result = asyncio.run(replay.step(action))
            obs = result.observation
            total_reward += result.reward
            if nxt is not None:
                assert nxt[1] == obs
                env_tokens += len(obs)
        assert out.non_tensor_batch["num_turns"][row] == len(runs[::2])
        assert float(b["token_level_scores"][row].sum()) == total_reward
        # The sampler's log-probs equal a fresh forward pass over the whole trajectory.
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float() / temperature
        log_probs = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:]).unsqueeze(1)).squeeze(1)
        model_positions = torch.tensor(policy).bool()
        torch.testing.assert_close(b["rollout_log_probs"][row, :n_resp][model_positions],
                                   log_probs[-n_resp:][model_positions], atol=1e-4, rtol=0)
    assert env_tokens > 0  # the test saw env replies inside trajectories


# ------------------------------------------------------------------ through a worker group
def test_generate_episodes_on_ray_ranks_equals_in_process(tmp_path, ray_cluster):
    """RolloutWorker.generate_episodes with an EnvEpisodes runner: tasks split over 2 Ray ranks (each
    rank's episodes of its own widths, aligned when collected) give the in-process group's greedy
    episodes exactly."""
    import numpy as np

    from rlcore.protocol import DataProto
    from rlcore.single_controller import (ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup,
                                          WorkerError)
    from rlcore.workers.rollout import RolloutWorker

    path = build_tiny_model(tmp_path / "tiny", seed=0)
    config = {"model": {"path": path}, "rollout": {"max_new_tokens": 6}}
    targets = [3, 9, 27, 81, 40]
    tasks = DataProto.from_dict(non_tensors={"task": np.array([{"target": t} for t in targets], dtype=object),
                                             "uid": np.array([f"u{i}" for i in range(5)], dtype=object)},
                                meta_info={"validate": True})
    runner = EnvEpisodes(env="guess_number", env_kwargs={"max_turns": 3}, max_turns=3, max_total_tokens=90)
    local = LocalWorkerGroup(ClassWithInitArgs(RolloutWorker, config), world_size=1)
    local.init_model()
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="multi_turn_test")
    remote = RayWorkerGroup(pool, ClassWithInitArgs(RolloutWorker, config), default_timeout=300)
    try:
        remote.init_model()
        one = local.generate_episodes(tasks, runner)
        two = remote.generate_episodes.options(pad=True)(tasks, runner)  # 5 tasks over 2 ranks: padded to 6
    finally:
        remote.shutdown()
        pool.shutdown()
    assert len(two) == 5 and list(two.non_tensor_batch["uid"]) == [f"u{i}" for i in range(5)]
    for key in ("input_ids", "attention_mask", "response_mask", "token_level_scores"):
        assert torch.equal(one.batch[key], two.batch[key]), key
    torch.testing.assert_close(one.batch["rollout_log_probs"], two.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    assert list(one.non_tensor_batch["num_turns"]) == list(two.non_tensor_batch["num_turns"])
    assert two.meta_info["rollout/num_generated_tokens"] == int(two.batch["response_mask"].sum())
    with pytest.raises(WorkerError, match="non-tensor 'task' column"):
        local.generate_episodes(DataProto.from_dict(non_tensors={"uid": np.array(["a"], dtype=object)},
                                                    meta_info=dict(tasks.meta_info)), runner)
