"""Episodes as coroutines: the same trajectories as the turn-lockstep rollout, per-token versions,
rewards over turns, the token budget, env timeouts; chat deltas; masking stale tokens."""

import asyncio
import dataclasses
import time

import pytest
import torch
from transformers import AutoTokenizer

from rlcore.agentic.chat import ChatDelta
from rlcore.agentic.env import ArithmeticRetryEnv, Env, LatencyEnv, Result, make_env
from rlcore.agentic.episode import (ENV_TOKEN_VERSION, EnvError, Trajectory, continue_after, mask_stale_tokens,
                                    play_episode, to_dataproto)
from rlcore.agentic.multi_turn import MultiTurnRollout
from rlcore.engines.async_base import Completion
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_char_tokenizer, build_tiny_model

GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, n=1, do_sample=False)
TASKS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 1), (2, 3), (12, 30), (7, 8), (40, 9), (5, 0)]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_episode"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------ against the turn-lockstep rollout
def test_play_episode_gives_the_turn_lockstep_trajectories(model_dir, tok):
    kw = dict(max_turns=3, max_total_tokens=40)
    lockstep = MultiTurnRollout(HFEngine(ModelConfig(path=model_dir), RolloutConfig()), tok,
                                lambda: make_env("arithmetic_retry", tok), settings=GREEDY, **kw).run(TASKS)
    engine = AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig(), engine_id=3)

    async def run():
        return await asyncio.gather(*[
            play_episode(make_env("arithmetic_retry", tok), engine, {**task, "seed": i}, GREEDY, session_id=i, **kw)
            for i, task in enumerate(TASKS)])

    trajs = asyncio.run(run())
    out = to_dataproto(trajs, tok.pad_token_id, 1.0)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                "token_level_scores"):
        assert torch.equal(out.batch[key], lockstep.batch[key]), key
    torch.testing.assert_close(out.batch["rollout_log_probs"], lockstep.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    assert out.non_tensor_batch["num_turns"].tolist() == lockstep.non_tensor_batch["num_turns"].tolist()
    assert out.non_tensor_batch["truncated"].tolist() == lockstep.non_tensor_batch["truncated"].tolist()
    assert out.non_tensor_batch["engine"].tolist() == [3] * len(TASKS)
    assert out.meta_info["temperature"] == 1.0

    # Multi-turn for real (the random model answers wrong, the env asks again): env tokens inside.
    resp_attn = out.batch["attention_mask"][:, -out.batch["responses"].shape[1]:].bool()
    model = out.batch["response_mask"].bool()
    env_tokens = resp_attn & ~model
    assert max(t.turns for t in trajs) > 1 and env_tokens.any()
    versions = out.batch["token_versions"]
    assert torch.equal(versions == ENV_TOKEN_VERSION, ~model)  # -1 on env tokens and padding, exactly
    assert (versions[model] == 0).all()
    for t in trajs:
        assert [v == ENV_TOKEN_VERSION for v in t.versions] == [m == 0 for m in t.policy_mask]
        assert t.oldest_version == 0 and t.engine_id == 3
        assert t.metrics["episode/gen_s"] > 0 and "episode/env_s" in t.metrics


# ------------------------------------------------------------------ scripted engine and envs
class ScriptedEngine:
    """Answers ``answer`` (cut to the budget; "stop" if whole) stamped with version ``call index``;
    records every context and budget."""

    def __init__(self, answer, log_prob=-0.5):
        self.answer, self.log_prob = list(answer), log_prob
        self.contexts, self.budgets = [], []

    async def generate(self, prompt_ids, sampling, session_id=None):
        self.contexts.append(list(prompt_ids))
        self.budgets.append(sampling.max_new_tokens)
        version = len(self.budgets) - 1
        tokens = self.answer[: sampling.max_new_tokens]
        reason = "stop" if len(tokens) == len(self.answer) else "length"
        return Completion(tokens, [self.log_prob] * len(tokens), reason, [version] * len(tokens), engine_id="s")


class ScriptedEnv(Env):
    """Reward 1 per step; answers ``reply``; terminates after ``steps`` steps (never if None)."""

    def __init__(self, tokenizer, steps=3, reply="\nok: ", prompt="go: "):
        super().__init__(tokenizer)
        self.steps, self.reply, self.prompt = steps, reply, prompt
        self.actions = []

    async def reset(self, task):
        return self.encode(self.prompt)

    async def step(self, action_token_ids):
        self.actions.append(list(action_token_ids))
        done = self.steps is not None and len(self.actions) >= self.steps
        return Result(1.0, self.encode(self.reply), terminated=done, info={"turn": float(len(self.actions))})


class SleepyEnv(ScriptedEnv):
    async def step(self, action_token_ids):
        await asyncio.sleep(10)
        return Result(1.0, [])


class SleepyResetEnv(ScriptedEnv):
    async def reset(self, task):
        await asyncio.sleep(10)
        return []


class BrokenEnv(ScriptedEnv):
    async def step(self, action_token_ids):
        if self.actions:
            raise ConnectionError("the sandbox went away")
        return await super().step(action_token_ids)


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


def play(env, engine, **kw):
    kw = {"max_turns": 5, "max_total_tokens": 200, "session_id": "s0", **kw}
    sampling = kw.pop("sampling", dataclasses.replace(GREEDY, max_new_tokens=6))
    return asyncio.run(play_episode(env, engine, {}, sampling, **kw))


def test_rewards_are_summed_over_turns_and_env_tokens_carry_no_version(char_tok):
    answer = ids(char_tok, "12") + [char_tok.eos_token_id]
    engine, env = ScriptedEngine(answer), ScriptedEnv(char_tok, steps=3)
    traj = play(env, engine)
    prompt, reply = ids(char_tok, "go: "), ids(char_tok, "\nok: ")
    assert traj.reward == 3.0 and traj.turns == 3 and traj.terminated and not traj.truncated
    assert traj.prompt_ids == prompt
    assert traj.token_ids == answer + reply + answer + reply + answer  # nothing after the final step
    assert traj.policy_mask == [1] * 3 + [0] * 5 + [1] * 3 + [0] * 5 + [1] * 3
    assert traj.versions == [0] * 3 + [-1] * 5 + [1] * 3 + [-1] * 5 + [2] * 3  # each turn its own version
    assert traj.log_probs == [-0.5] * 3 + [0.0] * 5 + [-0.5] * 3 + [0.0] * 5 + [-0.5] * 3
    assert traj.oldest_version == 0 and traj.info == {"turn": 3.0} and traj.engine_id == "s"
    assert env.actions == [answer] * 3  # the model's tokens, eos included, untouched
    # Each turn continues exactly the context of the one before.
    assert engine.contexts == [prompt, prompt + answer + reply, prompt + (answer + reply) * 2]

    batch = to_dataproto([traj, play(ScriptedEnv(char_tok, steps=1), ScriptedEngine(answer))], char_tok.pad_token_id, 1.0)
    scores, mask = batch.batch["token_level_scores"], batch.batch["response_mask"]
    assert scores[0].tolist() == [0.0] * 18 + [3.0] and scores[1, 2] == 1.0 and scores[1].sum() == 1.0
    assert batch.batch["token_versions"][0].tolist() == traj.versions
    assert batch.batch["token_versions"][1].tolist() == [0] * 3 + [-1] * 16  # padding: -1 too
    assert mask[1].tolist() == [1] * 3 + [0] * 16
    assert batch.non_tensor_batch["num_turns"].tolist() == [3, 1]


def test_max_turns_truncates(char_tok):
    traj = play(ScriptedEnv(char_tok, steps=None), ScriptedEngine(ids(char_tok, "7")), max_turns=2)
    assert traj.turns == 2 and traj.truncated and not traj.terminated and traj.reward == 2.0


def test_the_token_budget(char_tok):
    """A turn gets min(max_new_tokens, tokens left) and is still handed to the env; a reply that
    leaves no room for another model token ends the episode truncated, the reply not appended."""
    answer = ids(char_tok, "1234")
    prompt_len, reply_len = 4, 3  # "go: ", "\n: "
    engine, env = ScriptedEngine(answer), ScriptedEnv(char_tok, steps=None, reply="\n: ")
    traj = play(env, engine, max_total_tokens=prompt_len + 10)
    assert engine.budgets == [6, 3]  # 10 left, then 10 - 4 - 3 = 3
    assert env.actions == [answer, answer[:3]]  # the cut turn still goes to the env
    assert len(traj) == prompt_len + 10 and traj.truncated and not traj.terminated
    assert traj.reward == 2.0 and traj.turns == 2
    assert traj.policy_mask == [1] * 4 + [0] * 3 + [1] * 3

    # The first reply would fill the budget exactly: no room for a model token, so it ends there.
    env = ScriptedEnv(char_tok, steps=None, reply="\n: ")
    traj = play(env, ScriptedEngine(answer), max_total_tokens=prompt_len + 4 + reply_len)
    assert traj.turns == 1 and traj.truncated and traj.token_ids == answer and traj.reward == 1.0
    # One token more, and the reply fits with room for one model token.
    traj = play(ScriptedEnv(char_tok, steps=None, reply="\n: "), ScriptedEngine(answer),
                max_total_tokens=prompt_len + 4 + reply_len + 1, max_turns=2)
    assert traj.turns == 2 and len(traj) == prompt_len + 4 + reply_len + 1 and traj.token_ids[-1] == answer[0]

    with pytest.raises(EnvError, match="ScriptedEnv.reset gave 4 tokens .*max_total_tokens - 1 = 3"):
        play(ScriptedEnv(char_tok), ScriptedEngine(answer), max_total_tokens=4)
    with pytest.raises(ValueError, match="sampling.n=1"):
        play(ScriptedEnv(char_tok), ScriptedEngine(answer), sampling=dataclasses.replace(GREEDY, n=2))


def test_continue_after_folds_a_step():
    traj = Trajectory([1, 2], [3], [1], [-0.1], [0])
    assert continue_after(traj, Result(0.5, [7, 8]), max_total_tokens=6)
    assert traj.token_ids == [3, 7, 8] and traj.versions == [0, -1, -1] and traj.reward == 0.5
    assert not continue_after(traj, Result(0.25, [9], terminated=True), max_total_tokens=100)
    assert traj.token_ids == [3, 7, 8] and traj.terminated and traj.reward == 0.75


def test_a_hung_env_is_an_env_error_naming_env_session_and_turn(char_tok):
    engine = ScriptedEngine(ids(char_tok, "5"))
    # SleepyEnv's step would return a result after 10 s: the error shows the 0.5 s timeout ended it
    with pytest.raises(EnvError, match=r"SleepyEnv\.step did not return within 0\.5s \(session 'sess-7', turn 1\)"):
        play(SleepyEnv(char_tok), engine, session_id="sess-7", step_timeout_s=0.5)
    with pytest.raises(EnvError, match=r"SleepyResetEnv\.reset did not return within 0\.2s \(session 3, turn 0\)"):
        play(SleepyResetEnv(char_tok), engine, session_id=3, step_timeout_s=0.2)
    with pytest.raises(EnvError, match=r"BrokenEnv\.step raised ConnectionError: the sandbox went away "
                                       r"\(session 's0', turn 2\)") as err:
        play(BrokenEnv(char_tok), engine)
    assert isinstance(err.value.__cause__, ConnectionError)


def test_make_env_with_step_latency(char_tok):
    fixed = make_env("arithmetic_retry", char_tok, step_latency_s=0.05, latency_sigma=0.0, max_turns=2)
    assert isinstance(fixed, LatencyEnv) and isinstance(fixed.env, ArithmeticRetryEnv) and fixed.env.max_turns == 2
    assert isinstance(make_env("arithmetic_retry", char_tok), ArithmeticRetryEnv)  # no latency: no wrapper
    task = {"prompt": "1+1=", "answer": "2", "seed": 4}

    async def run(env):
        obs = await env.reset(task)
        start = time.perf_counter()
        result = await env.step(ids(char_tok, "3"))
        return obs, result, time.perf_counter() - start

    obs, result, took = asyncio.run(run(fixed))
    assert obs == ids(char_tok, "1+1=") and result.observation == ids(char_tok, "\n1+1=")  # passed through
    assert result.reward == 0.0 and not result.terminated
    assert took >= 0.049  # it slept the latency (a lower bound, less a timer tick); that it is 0.05 with sigma 0:
    assert [fixed.delay() for _ in range(3)] == pytest.approx([0.05] * 3, rel=1e-9)

    def delays(seed, n=2000):
        env = make_env("arithmetic_retry", char_tok, step_latency_s=0.2, latency_sigma=1.0)
        asyncio.run(env.reset({**task, "seed": seed}))
        return [env.delay() for _ in range(n)]

    heavy = delays(seed=1)
    assert heavy == delays(seed=1) and heavy != delays(seed=2)  # seeded by the task
    assert sum(heavy) / len(heavy) == pytest.approx(0.2, rel=0.15)  # mean step_latency_s ...
    assert max(heavy) > 5 * 0.2  # ... with a heavy tail
    with pytest.raises(ValueError, match="mean_s > 0"):
        LatencyEnv(ArithmeticRetryEnv(char_tok), 0.0)


# ------------------------------------------------------------------ chat deltas
def test_chat_delta_on_the_tiny_template(tok):
    chat = ChatDelta(tok)
    assert chat.end_of_turn == "\n"
    first = chat.prompt([{"role": "user", "content": "2+2?"}])
    assert tok.decode(first) == "user: 2+2?\nassistant: "
    model = ids(tok, "4") + [tok.eos_token_id]  # the model's turn, ending in eos
    delta = chat.after_model_turn(model, [{"role": "user", "content": "again"}])
    assert tok.decode(delta) == "\nuser: again\nassistant: "
    assert delta == ids(tok, "\nuser: again\nassistant: ")
    # A turn that already wrote the newline gets no second one; no cue when none is asked for.
    assert tok.decode(chat.after_model_turn(ids(tok, "4\n"), [{"role": "user", "content": "x"}])) == "user: x\nassistant: "
    assert tok.decode(chat.after_model_turn(model, [{"role": "user", "content": "x"}], add_generation_prompt=False)) \
        == "\nuser: x\n"
    # Prompt + model turn + delta is what rendering the whole conversation gives here (no history edits).
    whole = chat.render([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "again"}], add_generation_prompt=True)
    assert tok.decode(first + model + delta, skip_special_tokens=True) == whole


# Qwen3-like ChatML: <think>...</think> of assistant messages before the last one is dropped on render.
CHATML = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}"
    "{%- set content = m['content'].split('</think>')[-1].lstrip('\\n') -%}"
    "{%- else -%}{%- set content = m['content'] -%}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_chat_delta_keeps_earlier_ids_where_a_re_render_would_not():
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = ChatDelta(tok)
    assert chat.end_of_turn == "<|im_end|>\n"

    q1, q2 = {"role": "user", "content": "what is 2+2?"}, {"role": "user", "content": "and 3+3?"}
    ids_ = chat.prompt([q1])
    assert tok.decode(ids_) == "<|im_start|>user\nwhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    turn1 = ids(tok, "<think>hmm</think>4") + [end]  # ends in its end-of-turn token
    context = ids_ + turn1
    delta1 = chat.after_model_turn(turn1, [q2])
    assert tok.decode(delta1) == "\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    context += delta1
    turn2 = ids(tok, "<think>ok</think>6")  # cut at its budget: no end-of-turn token of its own
    delta2 = chat.after_model_turn(turn2, [{"role": "user", "content": "bye"}])
    assert tok.decode(delta2) == "<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
    context += turn2 + delta2

    # Prefix-stable: every earlier id, the first turn's <think> included, is still where it was.
    assert context[: len(ids_) + len(turn1)] == ids_ + turn1
    assert tok.decode(context) == (
        "<|im_start|>user\nwhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>hmm</think>4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n<think>ok</think>6<|im_end|>\n"
        "<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    # Re-rendering the whole conversation drops the earlier thinking: the ids the policy saw change.
    messages = [q1, {"role": "assistant", "content": "<think>hmm</think>4"}, q2,
                {"role": "assistant", "content": "<think>ok</think>6"}, {"role": "user", "content": "bye"}]
    rerendered = chat.prompt(messages)
    assert rerendered[: len(ids_) + len(turn1)] != ids_ + turn1
    assert "<think>hmm</think>" not in tok.decode(rerendered)
    assert tok.decode(rerendered).endswith(tok.decode(delta2))  # the new part itself renders the same


def test_chat_delta_needs_a_template():
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatDelta(tok)


# ------------------------------------------------------------------ stale tokens
def test_mask_stale_tokens_numbers():
    """Versions 3, 5, 6 on three rows' model tokens (env tokens -1); current 6, staleness 1: only
    tokens of version < 5 leave the loss."""
    rows = []
    for turns in ([(3, 2), (5, 2)], [(6, 3)], [(3, 1), (4, 1), (6, 2)]):
        t = Trajectory([9, 9])
        for version, n in turns:
            t.add_model_turn(Completion([7] * n, [-1.0] * n, "stop", [version] * n))
            t.add_observation([8])
        rows.append(t)
    batch = to_dataproto(rows, 0, 1.0)
    before = batch.batch["response_mask"].clone()
    metrics = mask_stale_tokens(batch, current_version=6, max_token_staleness=1)
    assert metrics["episode/stale_token_frac"] == pytest.approx(4 / 11)  # 2 + 0 + 2 of 4 + 3 + 4 model tokens
    assert batch.batch["token_versions"].tolist() == [
        [3, 3, -1, 5, 5, -1, -1],
        [6, 6, 6, -1, -1, -1, -1],
        [3, -1, 4, -1, 6, 6, -1],
    ]
    assert batch.batch["response_mask"].tolist() == [
        [0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
    ]
    assert (batch.batch["response_mask"] <= before).all()  # only ever removes tokens
    assert mask_stale_tokens(batch, current_version=6, max_token_staleness=1)["episode/stale_token_frac"] == 0.0
    batch = to_dataproto(rows, 0, 1.0)
    assert mask_stale_tokens(batch, current_version=6, max_token_staleness=3)["episode/stale_token_frac"] == 0.0
    assert torch.equal(batch.batch["response_mask"], before)
