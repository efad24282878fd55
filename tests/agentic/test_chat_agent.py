"""Black-box agents end to end in this process: the example agents (stock ``openai`` client) played
by ``ChatAgentRunner`` on a real engine, their rewards and segments; a synchronous agent; agents
that fail (raise, hang, never ask the model) get an ``AgentError`` naming them and the session."""

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from recipes.chat_agent_grpo import chat_metrics
from rlcore.agentic.chat_agent import AgentError, ChatAgentRunner, ChatAgentSpec, load_agent
from rlcore.agentic.episode import to_dataproto
from rlcore.algos.advantages import compute_grpo_outcome_advantage
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.models.config import ModelConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"
SAMPLED = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6, n=1, do_sample=True)
TASK = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}

AGENTS = '''
import threading
import time
import openai


class Together:
    """A synchronous agent that waits until ten of its kind run at once (a barrier), then asks."""
    barrier = threading.Barrier(10, timeout=30)

    def run(self, ctx):
        self.barrier.wait()
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=30)
        client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        return 1.0


class SlowSync:
    """A synchronous agent that works 1.5 s before asking."""
    def run(self, ctx):
        time.sleep(1.5)
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=30)
        client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        return 1.0


class SyncAgent:
    """A plain def with the synchronous client: runs in a thread."""
    def run(self, ctx):
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=30)
        reply = client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        return float(len(reply.choices[0].message.content or "") > 0)


class Raises:
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        raise KeyError("tool crashed")


class Hangs:
    async def run(self, ctx):
        import asyncio
        await asyncio.sleep(60)


class NeverAsks:
    async def run(self, ctx):
        return 1.0


class ReturnsText:
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
        return "great"
'''


@pytest.fixture(scope="module")
def agents_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("agents") / "agents.py"
    path.write_text(AGENTS)
    return path


def play(model_dir, agent: str, tasks, size: int = 1, timeout_s: float = 60.0, sync_threads: int = 64, **kwargs):
    spec = ChatAgentSpec(agent, model_dir, SAMPLED, kwargs, max_total_tokens=128, episode_timeout_s=timeout_s,
                         sync_threads=sync_threads)

    async def scenario():
        runner = ChatAgentRunner(spec, [AsyncHFEngine(ModelConfig(path=model_dir), RolloutConfig())])
        try:
            return await asyncio.gather(*[runner.run_group(g, t, size) for g, t in enumerate(tasks)]), runner
        finally:
            await runner.close()

    return asyncio.run(scenario())


def test_the_retry_agent_plays_groups_and_its_rewards_follow_its_rule(model_dir, tok):
    groups, runner = play(model_dir, f"{EXAMPLES}/arithmetic_chat.py:RetryAgent", [TASK, TASK], size=3)
    segments = [t for g in groups for t in g]
    # each retry is a new user message: a try; right at the first try = rewarded after one
    assert [t.metrics["chat/tries"] for t in segments] == [float(t.turns) for t in segments]
    assert chat_metrics(segments)["episode/first_try_right"] == pytest.approx(
        np.mean([t.reward == 1.0 for t in segments]))
    assert len(segments) == 6 and runner.episodes_done == 6 and not runner.proxy.sessions
    for t in segments:
        replies = [tok.decode(ids, skip_special_tokens=True) for ids in _model_turns(t)]
        right = [r.strip() == "5" for r in replies]
        expected = 0.5 ** right.index(True) if any(right) else 0.0
        assert t.reward == expected and t.turns == len(replies) <= 3
        assert (not any(right[:-1])) and (len(replies) == 3 or right[-1])  # it stops at the first right answer
        assert t.metrics["chat/segments"] == 1.0 and t.episode_id is not None
    assert len({t.episode_id for t in segments}) == 6


def _model_turns(traj):
    turns, current = [], []
    for token, own in zip(traj.token_ids, traj.policy_mask):
        if own:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def test_a_synchronous_agent_runs_in_a_thread(model_dir, agents_file):
    groups, _ = play(model_dir, f"{agents_file}:SyncAgent", [TASK])
    assert len(groups[0]) == 1 and groups[0][0].turns == 1


def test_ten_synchronous_agents_run_at_once(model_dir, agents_file):
    """Each waits at a barrier for all ten: asyncio's default pool (cpu_count + 4 threads: 6 here) held
    four of them back, the barrier timed out and every episode failed."""
    groups, runner = play(model_dir, f"{agents_file}:Together", [TASK], size=10, timeout_s=60)
    assert len(groups[0]) == 10 and all(t.reward == 1.0 for t in groups[0])


def test_the_episode_timeout_of_a_synchronous_agent_starts_when_it_starts(model_dir, agents_file):
    """Two threads, four agents of 1.5 s, 2.5 s each: the last two wait 1.5 s for a thread and still have
    their whole 2.5 s (counted from the queue they would have had 1 s, and failed)."""
    groups, _ = play(model_dir, f"{agents_file}:SlowSync", [TASK], size=4, timeout_s=2.5, sync_threads=2)
    waited = sorted(t.metrics["episode/agent_s"] for t in groups[0])[2:]
    assert len(groups[0]) == 4 and all(s > 2.5 for s in waited)  # longer than the timeout, from the queue


@pytest.mark.parametrize("name, message", [
    ("Raises", "raised KeyError: 'tool crashed' (session r0-g0-e0-"),
    ("Hangs", "did not finish within 1s (session r0-g0-e0-"),
    ("NeverAsks", "without a reply from the model"),
    ("ReturnsText", "returned str for session"),
])
def test_failing_agents_are_agent_errors_naming_agent_and_session(model_dir, agents_file, name, message):
    with pytest.raises(AgentError, match="agents.py:" + name) as err:
        play(model_dir, f"{agents_file}:{name}", [TASK], timeout_s=1.0)
    assert message in str(err.value)


def test_bad_agent_paths_fail_when_the_spec_is_made(model_dir, agents_file):
    with pytest.raises(FileNotFoundError, match="nowhere.py"):
        ChatAgentSpec("nowhere.py:Agent", model_dir, SAMPLED)
    with pytest.raises(ValueError, match="no class 'Missing'"):
        load_agent(f"{agents_file}:Missing")
    with pytest.raises(ValueError, match="file.py:Name"):
        load_agent("no_colon")


def test_grpo_counts_an_episode_of_several_segments_once():
    # one group: episode A (two segments, reward 1), B and C (reward 0)
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0])
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = scores
    mask = torch.ones(4, 3)
    index = np.array(["g"] * 4, dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index, episode_index=np.array(["A", "A", "B", "C"]))
    mean, std = 1 / 3, np.std([1.0, 0.0, 0.0], ddof=1)  # over episodes: [1, 0, 0]
    expected = [(s - mean) / (std + 1e-6) for s in [1.0, 1.0, 0.0, 0.0]]
    assert adv[:, 0].tolist() == pytest.approx(expected, rel=1e-5)
    plain, _ = compute_grpo_outcome_advantage(rewards, mask, index)  # rows: [1, 1, 0, 0] -> mean 0.5
    assert plain[0, 0] == pytest.approx(0.5 / (np.std([1, 1, 0, 0], ddof=1) + 1e-6), rel=1e-5)


def test_segments_become_training_rows_with_the_episode_column(model_dir, tok):
    groups, _ = play(model_dir, f"{EXAMPLES}/arithmetic_chat.py:RetryAgent", [TASK], size=2)
    segs = groups[0]
    batch = to_dataproto(segs, tok.pad_token_id, 1.0, {"uid": np.array(["0"] * len(segs), dtype=object),
                                                       "episode": np.array([t.episode_id for t in segs], dtype=object)})
    for row, t in enumerate(segs):
        mask = batch.batch["response_mask"][row].bool()
        assert batch.batch["responses"][row][mask].tolist() == [x for x, m in zip(t.token_ids, t.policy_mask) if m]


NO_ARG_AGENTS = '''
class NoArgs:
    async def run(self, ctx):
        return 1.0


class NeedsTurns:
    def __init__(self, turns):
        self.turns = turns

    async def run(self, ctx):
        return 1.0
'''


def run_recipe_until_engines(overrides, monkeypatch):
    """``recipes.chat_agent_grpo.train`` on the real YAML, stopped where the engines would start: the
    spec its runners would get (made from ``agent_runners`` as the streamed loop makes it), or the error."""
    from hydra import compose, initialize_config_dir

    import recipes.chat_agent_grpo as recipe

    specs = []

    def no_training(cfg, agent_runners, describe):  # instead of warm start, engines and steps
        agent_runners([], SAMPLED)
        return "stopped"

    monkeypatch.setattr(recipe, "train_on_streamed_episodes", no_training)
    monkeypatch.setattr(recipe, "start_runners", lambda n, spec, engines, **kw: specs.append(spec))
    with initialize_config_dir(config_dir=str(Path(recipe.__file__).parent / "config"), version_base=None):
        cfg = compose("chat_agent_grpo", overrides=overrides)
    assert recipe.train(cfg) == "stopped"
    (spec,) = specs
    return spec


def test_an_agent_without_arguments_loads_with_the_default_config(tmp_path, monkeypatch):
    # issue 24: the default RetryAgent's kwargs were in the YAML and reached every agent.path
    path = tmp_path / "my_agent.py"
    path.write_text(NO_ARG_AGENTS)
    spec = run_recipe_until_engines([f"agent.path={path}:NoArgs"], monkeypatch)
    assert spec.agent == f"{path}:NoArgs" and dict(spec.agent_kwargs) == {}
    agent = load_agent(spec.agent)(**spec.agent_kwargs)  # what every episode does
    assert type(agent).__name__ == "NoArgs"


def test_the_default_agent_keeps_its_own_defaults_and_takes_overrides(monkeypatch):
    spec = run_recipe_until_engines([], monkeypatch)
    assert spec.agent.endswith("examples/agents/arithmetic_chat.py:RetryAgent") and dict(spec.agent_kwargs) == {}
    agent = load_agent(spec.agent)(**spec.agent_kwargs)
    assert (agent.max_tries, agent.discount) == (3, 0.5)
    spec = run_recipe_until_engines(["+agent.kwargs.max_tries=5"], monkeypatch)
    agent = load_agent(spec.agent)(**spec.agent_kwargs)
    assert (agent.max_tries, agent.discount) == (5, 0.5)


def test_agent_kwargs_the_class_does_not_take_fail_before_any_engine(tmp_path, monkeypatch):
    path = tmp_path / "my_agent.py"
    path.write_text(NO_ARG_AGENTS)
    with pytest.raises(TypeError) as err:  # raised in train(), before train_on_streamed_episodes
        run_recipe_until_engines([f"agent.path={path}:NoArgs", "+agent.kwargs.max_tries=3",
                                  "+agent.kwargs.discount=0.5"], monkeypatch)
    message = str(err.value)
    assert "agent.kwargs" in message and "['discount', 'max_tries']" in message and "NoArgs" in message
    with pytest.raises(TypeError, match=r"agent.kwargs .*\['turns'\].*NeedsTurns"):  # a required one missing
        ChatAgentSpec(f"{path}:NeedsTurns", "unused", SAMPLED)
    with pytest.raises(TypeError, match=r"\['turn'\] that it does not take.*NeedsTurns\(turns\)"):
        ChatAgentSpec(f"{path}:NeedsTurns", "unused", SAMPLED, {"turn": 2})
    assert ChatAgentSpec(f"{path}:NeedsTurns", "unused", SAMPLED, {"turns": 2}).agent_kwargs == {"turns": 2}


def test_synchronous_agents_get_a_thread_per_episode_in_flight_unless_set(monkeypatch):
    spec = run_recipe_until_engines(["agentic.groups_in_flight=5", "rollout.n=3"], monkeypatch)
    assert spec.sync_threads == 15  # every episode a runner may play at once
    spec = run_recipe_until_engines(["agentic.groups_in_flight=5", "rollout.n=3", "agent.sync_threads=4"], monkeypatch)
    assert spec.sync_threads == 4
    with pytest.raises(ValueError, match="agent.sync_threads must be >= 1"):
        run_recipe_until_engines(["agent.sync_threads=0"], monkeypatch)
