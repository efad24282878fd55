"""The Claude Agent SDK (the Claude Code CLI it bundles) pointed at a session's Anthropic endpoint, with
one tool served over MCP (examples/agents/claude_agent_sdk.py), on the real tiny-model engine: the CLI
runs offline against the loopback proxy, its first request is the prompt the policy sees; a tiny model
taught on that very prompt calls the MCP tool, the CLI runs it and sends the result back, the model
answers, and the episode is one token-exact segment with the tool's result masked and reward 1."""

import asyncio
import dataclasses
import math
import subprocess
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_helpers import GREEDY, serving
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec, load_agent
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig
from rlcore.models.config import ModelConfig
from rlcore.models.tiny import build_tiny_model

sdk = pytest.importorskip("claude_agent_sdk")
AGENT = str(Path(__file__).resolve().parents[2] / "examples/agents/claude_agent_sdk.py") + ":ClaudeSDKAgent"
TASK = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}
CALL_TEXT = '<tool_call>{"name": "mcp__arith__calc", "arguments": {"expression": "2+3"}}</tool_call>'
LONG = dataclasses.replace(GREEDY, max_new_tokens=120)  # the call is 82 tokens


def cli_runs() -> str | None:
    """Why the bundled CLI cannot run here, or None."""
    cli = Path(sdk.__file__).parent / "_bundled" / "claude"
    if not cli.exists():
        return f"claude-agent-sdk bundles no CLI binary here ({cli})"
    try:
        done = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return f"the bundled Claude Code CLI cannot run on this platform: {exc}"
    return None if done.returncode == 0 else f"the bundled Claude Code CLI exits {done.returncode}: {done.stderr[:200]}"


@pytest.fixture(scope="module", autouse=True)
def needs_cli():
    reason = cli_runs()
    if reason:
        pytest.skip(reason)


def context(access, prompt="2+3=", label="5", max_tokens=120):
    """The ChatContext fields the agent reads."""
    return types.SimpleNamespace(session_url=access.session_url, api_key=access.api_key, model_name="policy",
                                 sampling={"max_tokens": max_tokens}, prompt=prompt, label=label)


@pytest.fixture(scope="module")
def cli_model_dir(tmp_path_factory):
    """A tiny model taught (by overfitting one conversation) to call the MCP calc tool on the prompt the CLI
    actually sends for "2+3=" (read off the engine: the first request's ids), then, given the result, to
    answer it."""
    out = build_tiny_model(tmp_path_factory.mktemp("cli_tool"), seed=0)

    async def first_prompt():
        async with serving(out, dataclasses.replace(GREEDY, max_new_tokens=2)) as (proxy, rec, _):
            agent = load_agent(AGENT)(max_turns=1)
            await agent.run(context(proxy.open_session("probe", 400), max_tokens=2))
            proxy.close_session("probe")
            return rec.calls[0][1]

    prompt = asyncio.run(first_prompt())
    tok = AutoTokenizer.from_pretrained(out)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert tok.decode(prompt).endswith("user: 2+3=\nassistant: ") and "mcp__arith__calc" in tok.decode(prompt)
    ids = prompt + enc(CALL_TEXT) + [tok.eos_token_id] + enc("\ntool: 5\nassistant: 5") + [tok.eos_token_id]
    model = AutoModelForCausalLM.from_pretrained(out)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.tensor([ids])
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~14x faster than 2 threads on a shared 2-core machine, for this tiny model
    try:
        for _ in range(150):
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    return out


def test_the_cli_runs_the_mcp_tool_the_model_calls_in_a_token_exact_episode(cli_model_dir):
    spec = ChatAgentSpec(AGENT, cli_model_dir, LONG, max_total_tokens=400)

    async def scenario():
        runner = ChatAgentRunner(spec, [AsyncHFEngine(ModelConfig(path=cli_model_dir), RolloutConfig())])
        try:
            return await runner.play(TASK, "s")
        finally:
            await runner.close()

    [segment] = asyncio.run(scenario())
    assert segment.reward == 1.0 and segment.turns == 2  # the call, then the answer
    assert (segment.metrics["chat/requests"], segment.metrics["chat/tries"]) == (2.0, 1.0)
    tok = AutoTokenizer.from_pretrained(cli_model_dir)
    own = [t for t, m in zip(segment.token_ids, segment.policy_mask) if m]
    assert tok.decode(own) == CALL_TEXT + "</s>5</s>"  # what the model wrote; the tool's "5" came back masked:
    assert tok.decode([t for t, m in zip(segment.token_ids, segment.policy_mask) if not m]) == "\ntool: 5\nassistant: "


def test_the_tool_ran_in_the_agent_and_a_run_out_of_turns_is_reward_0(cli_model_dir, monkeypatch):
    # the machine's own Anthropic settings reach no request: a token sent as Bearer would be a 401 (the
    # proxy reads that header first), another provider would not reach the proxy at all
    for name, value in [("ANTHROPIC_AUTH_TOKEN", "the-users-token"), ("CLAUDE_CODE_USE_BEDROCK", "1"),
                        ("ANTHROPIC_MODEL", "claude-x"), ("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")]:
        monkeypatch.setenv(name, value)

    async def scenario():
        async with serving(cli_model_dir, LONG) as (proxy, rec, _):
            agent, short = load_agent(AGENT)(), load_agent(AGENT)(max_turns=1)
            reward = await agent.run(context(proxy.open_session("a", 400)))
            out_of_turns = await short.run(context(proxy.open_session("b", 400)))
            return agent, reward, short, out_of_turns, [proxy.close_session(s) for s in ("a", "b")]

    agent, reward, short, out_of_turns, sessions = asyncio.run(scenario())
    assert reward == 1.0 and agent.tool_calls == [{"expression": "2+3"}] and agent.result.result == "5"
    assert agent.result.num_turns == 2 and not agent.result.is_error
    # one turn allowed: the model's call is run, then the CLI stops before the answer (no answer: 0)
    assert out_of_turns == 0.0 and short.tool_calls == [{"expression": "2+3"}]
    assert short.result.subtype == "error_max_turns"
    assert [len(s.segments) for s in sessions] == [1, 1]


@pytest.mark.slow
def test_chat_agent_grpo_trains_the_policy_behind_the_cli(cli_model_dir, tmp_path, ray_cluster):
    """One GRPO step of recipes/chat_agent_grpo on the example's episodes, the CLI run by the runner actor:
    the model taught to use the tool earns reward 1 through the CLI and its MCP tool (sampled, not greedy:
    an episode may stray), and the step trains on the episodes' segments."""
    from hydra import compose, initialize_config_dir

    import recipes.chat_agent_grpo as recipe
    from rlcore.data.arithmetic import write_jsonl
    from rlcore.trainer.tracking import read_jsonl_metrics

    data = write_jsonl(tmp_path / "tasks.jsonl", [{"prompt": "2+3=", "answer": "5", "data_source": "arithmetic"}] * 2)
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.total_steps=1",
                 "trainer.val_freq=1", "trainer.backend=local", f"model.path={cli_model_dir}",
                 f"data.train_files={data}", f"data.val_files={data}", "data.train_batch_size=2", "rollout.n=2",
                 "rollout.max_new_tokens=120", "actor.ppo_micro_batch_size_per_gpu=8", "agentic.cpus_per_engine=1",
                 "agentic.bucket_mb=0.1", f"agent.path={AGENT}", "agent.max_total_tokens=400"]
    with initialize_config_dir(config_dir=str(Path(recipe.__file__).parent / "config"), version_base=None):
        run = recipe.train(compose("chat_agent_grpo", overrides=overrides))
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    step = rows[1]
    assert step["reward/score/max"] == 1.0 and step["episode/segments_mean"] == 1.0
    assert step["episode/requests_mean"] >= 1.0 and math.isfinite(step["actor/pg_loss"])
