"""Chat-agent GRPO: train a black-box agent written with the OpenAI client, as it is.

    python -m recipes.chat_agent_grpo                                        # examples/agents/arithmetic_chat.py
    python -m recipes.chat_agent_grpo agent.path=examples/agents/calculator_agent.py:CalculatorAgent

The agent (``agent.path``, a class with ``async def run(self, ctx)``) talks to ``ctx.base_url``
with ``openai.AsyncOpenAI``; it never sees the trainer. Behind that URL (``rlcore.agentic``):
    chat proxy       per runner actor, on its event loop: POST /s/<session>/v1/chat/completions,
                     one session per episode, each request rendered as a delta on the session's
                     exact ids and sent to the session's engine (chat_proxy, chat_session)
    engine servers   Ray actors, one engine each (HF batching loop or vLLM AsyncLLM)
    pool             agentic.groups_in_flight task groups always being played (rollout.n episodes
                     of one task each), finished groups handed to the trainer as they finish
Per step:
    take train_batch_size finished groups: their episodes' segments, each with the    wait_rollout
      reward the agent returned, the ids the engine sampled (env and tool text masked)
    reference log-probs; advantage = the episode's reward against its group's         ref / adv
      (an episode of several segments counts once)
    update (per-token IS correction for tokens of older weights)                      update
    stream the new weights to the engines, bucket by bucket                           sync_weights
Validation is the single-turn greedy one of the other recipes, on the engine servers, with the
chat template (the warm start is SFT on chat-formatted prompts). The loop is the agentic recipe's
(``rlcore.trainer.streamed_grpo``); what differs is who plays the episodes and the rows' episode ids.
"""

from __future__ import annotations

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from rlcore.agentic import start_runners
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec, load_agent
from rlcore.agentic.chat_proxy import ChatProxyConfig
from rlcore.trainer.cli import prepare_argv, user_errors
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.streamed_grpo import train_on_streamed_episodes

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "agent", "agentic", "trainer")
register_schema("chat_agent_grpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    a, g = cfg.agentic, cfg.agent
    agent_kwargs = OmegaConf.to_container(g.kwargs)
    load_agent(g.path, agent_kwargs)  # a bad agent.path or agent.kwargs fail now, before the warm start or an engine

    def agent_runners(engines, sampling):
        proxy = ChatProxyConfig(max_request_bytes=g.max_request_bytes, max_n=g.max_n,
                                request_timeout_s=g.request_timeout_s)
        in_flight = (a.groups_in_flight or cfg.data.train_batch_size) * cfg.rollout.n  # at most, on one runner
        spec = ChatAgentSpec(g.path, cfg.model.path, sampling, agent_kwargs, g.max_total_tokens,
                             g.episode_timeout_s, proxy, sync_threads=g.sync_threads or in_flight)
        return start_runners(a.num_runners, spec, engines, num_cpus=a.cpus_per_runner, runner_cls=ChatAgentRunner)

    def describe(played, version):
        segments = [t for group in played for t in group]  # an episode's id is unique in the run
        return {"episode": np.array([t.episode_id for t in segments], dtype=object)}, chat_metrics(segments)

    return train_on_streamed_episodes(cfg, agent_runners, describe)


def chat_metrics(segments: list) -> dict[str, float]:
    """Per episode (its first segment): reward, requests, tries, right at the first try (rewarded after one
    try: tool calls and retried requests are part of a try, a new user message starts the next); per
    segment: count."""
    first: dict = {}
    for t in segments:
        first.setdefault(t.episode_id, t)
    episodes = list(first.values())
    rewards = np.array([t.reward for t in episodes])
    requests = np.array([t.metrics["chat/requests"] for t in episodes])
    tries = np.array([t.metrics["chat/tries"] for t in episodes])
    return {"episode/reward_mean": float(rewards.mean()), "episode/requests_mean": float(requests.mean()),
            "episode/tries_mean": float(tries.mean()),
            "episode/first_try_right": float(((tries == 1) & (rewards > 0)).mean()),
            "episode/segments_mean": float(np.mean([t.metrics["chat/segments"] for t in episodes])),
            "episode/discarded_replies": float(np.sum([t.metrics["chat/discarded_replies"] for t in episodes])),
            # requests that re-sent the history in another form: matched to the sampled ids, or sealed
            "episode/rerendered_matched": float(np.sum([t.metrics.get("chat/rerendered_matched", 0.0) for t in episodes])),
            "episode/rerendered_unmatched": float(np.sum([t.metrics.get("chat/rerendered_unmatched", 0.0)
                                                          for t in episodes])),
            "episode/agent_s_mean": float(np.mean([t.metrics["episode/agent_s"] for t in episodes]))}


@hydra.main(config_path="config", config_name="chat_agent_grpo", version_base=None)
@user_errors  # a user's mistake: its message and exit status 2, no traceback (rlcore.trainer.cli)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    prepare_argv(SECTIONS)  # verl's key names rewritten, unknown or refused keys named, --debug
    main()
