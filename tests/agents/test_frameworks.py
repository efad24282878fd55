"""Agent frameworks trained unchanged (``frameworks.FRAMEWORKS``): each example agent, as its
framework's users write it, plays an episode on the tool model through the chat proxy (its tool
call round-trips, its segments and tries are counted as the framework's history allows, and the ids
trained are the ids sampled); then one ``recipes.chat_agent_grpo`` run trains on episodes of all of
them at once."""

import asyncio
import json
from collections import defaultdict
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import AutoTokenizer

import recipes.chat_agent_grpo
from frameworks import FRAMEWORKS
from recipes.chat_agent_grpo import chat_metrics
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec
from rlcore.engines.async_hf import AsyncHFEngine
from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.models.config import ModelConfig
from rlcore.trainer.tracking import read_jsonl_metrics

CONFIG_DIR = Path(recipes.chat_agent_grpo.__file__).parent / "config"
GREEDY = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=80, n=1, do_sample=False)
TASK = {"messages": [{"role": "user", "content": "2+3="}], "answer": "5"}


class Recording:
    """The router, with every completion it returned written down (what the engine sampled)."""

    def __init__(self, router):
        self.router, self.completions = router, []

    async def generate(self, prompt_ids, sampling, session_id=None):
        completion = await self.router.generate(prompt_ids, sampling, session_id)
        self.completions.append(completion)
        return completion

    def release(self, session_id):
        self.router.release(session_id)


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_the_framework_agent_round_trips_its_tool_call(name, framework_model_dir):
    framework = FRAMEWORKS[name]
    spec = ChatAgentSpec(framework.path, framework_model_dir, GREEDY, max_total_tokens=500)

    async def scenario():
        runner = ChatAgentRunner(spec, [AsyncHFEngine(ModelConfig(path=framework_model_dir), RolloutConfig())])
        recording = runner.proxy.generator = runner.proxy.turns.generator = Recording(runner.router)
        try:
            return await runner.play(TASK, "s"), recording.completions
        finally:
            await runner.close()

    segments, sampled = asyncio.run(scenario())
    tok = AutoTokenizer.from_pretrained(framework_model_dir)
    assert [s.reward for s in segments] == [1.0] * framework.segments
    m = segments[0].metrics
    assert (m["chat/requests"], m["chat/tries"], m["chat/segments"]) == (2.0, 1.0, framework.segments)
    assert chat_metrics(segments)["episode/first_try_right"] == 1.0
    unmatched = framework.segments - 1  # a step that could not be matched to the sampled ids is its own segment
    assert (m["chat/rerendered_matched"], m["chat/rerendered_unmatched"]) == (0.0, unmatched)
    # the ids trained are the ids sampled, in order: the calc call, then the answer
    trained = [t for s in segments for t, mask in zip(s.token_ids, s.policy_mask) if mask]
    assert trained == [t for c in sampled for t in c.token_ids]
    # (smolagents asks with tool_choice "required": the proxy puts the call's opening before the model's ids)
    assert tok.decode(sampled[0].token_ids, skip_special_tokens=True).endswith(
        'calc", "arguments": {"expression": "2+3"}}</tool_call>')
    # the tool's result reached the model: the last segment's prompt or env tokens hold it
    last = segments[-1]
    seen = tok.decode(last.prompt_ids + [t for t, mask in zip(last.token_ids, last.policy_mask) if not mask])
    assert framework.tool_text in seen


def write_rows(path: Path, per_framework: int) -> str:
    rows = [{"prompt": "2+3=", "answer": "5", "data_source": name} for name in FRAMEWORKS for _ in range(per_framework)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_one_recipe_run_trains_on_every_frameworks_episodes(tmp_path, framework_model_dir, ray_cluster):
    """``recipes.chat_agent_grpo`` on rows spread over the frameworks (``FrameworkAgent`` plays each
    with the example its data_source names): 2 steps logged, the weights moved, and every framework's
    episodes called the tool and got its result back, in as many segments as its history allows."""
    data = write_rows(tmp_path / "rows.jsonl", 1)
    agent = str(Path(__file__).with_name("frameworks.py")) + ":FrameworkAgent"
    groups = len(FRAMEWORKS)
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.total_steps=2",
                 "trainer.val_freq=0", "trainer.backend=local", f"model.path={framework_model_dir}",
                 f"data.train_files={data}", f"data.val_files={data}", f"data.train_batch_size={groups}",
                 f"trainer.trajectory_groups={groups}", "rollout.n=4", "rollout.max_new_tokens=80",
                 "actor.ppo_micro_batch_size_per_gpu=8", f"agent.path={agent}", "agent.max_total_tokens=500",
                 "agentic.cpus_per_engine=1", "agentic.bucket_mb=0.1", "reward.reward_fn=arithmetic"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose("chat_agent_grpo", overrides=overrides)
    run = recipes.chat_agent_grpo.train(cfg)
    rows = read_jsonl_metrics(run.dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    before, after = load_file(Path(framework_model_dir) / "model.safetensors"), load_file(run.dir / "hf" / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before)
    # every framework's groups were played and trained on (the pool counts kept groups by data_source). The
    # pool plays ahead of the steps, and which groups finish first depends on the machine: a step may take a
    # second pass's group of one framework before the first pass's of another, so count at least one each
    drops = json.loads((run.dir / "drops.json").read_text())
    kept = {name: drops["by_data_source"][name]["kept"] for name in FRAMEWORKS}
    assert all(kept.values()) and sum(kept.values()) == 2 * groups, kept
    # every trained row (trainer.trajectory_groups covers the batch), by episode: its segments and what the
    # model was shown. The rows do not name their framework; a framework's first prompt does (by its
    # system prompt and tools); LangGraph's and pydantic-ai's are the same (the native round trip).
    episodes = defaultdict(list)
    for path in sorted((run.dir / "trajectories").glob("step_*.jsonl")):
        for record in map(json.loads, path.read_text().splitlines()):
            episodes[record["episode"]].append(("".join(record["prompt_pieces"]), "".join(
                p for p, m in zip(record["pieces"], record["mask"]) if not m)))
    assert len(episodes) == 2 * groups * 4  # 2 steps x 3 groups x rollout.n
    kinds = {name: [e for e in episodes.values() if e[0][0] == framework.first_prompt]
             for name, framework in FRAMEWORKS.items()}
    assert all(e[0][0] in {f.first_prompt for f in FRAMEWORKS.values()} for e in episodes.values())
    for name, framework in FRAMEWORKS.items():
        assert kinds[name], name
        # sampled (and, in flight, by a policy whose version depends on the machine's timing), an episode may leave
        # the tool model's trained path and take more steps: bounded by what the framework's history allows
        assert all(len(segments) <= framework.most_segments for segments in kinds[name]), name
        shown = ["".join(prompt + env for prompt, env in segments) for segments in kinds[name]]
        assert any(framework.tool_text in text for text in shown), name  # the tool's result came back
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert sum(r["episode/rerendered_unmatched"] for r in steps) >= 1  # smolagents' steps, sealed and counted
