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
chat template (the warm start is SFT on chat-formatted prompts).
"""

from __future__ import annotations

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf
from transformers import AutoTokenizer

from rlcore.agentic import RolloutPool, start_runners, to_dataproto
from rlcore.agentic.chat_agent import ChatAgentRunner, ChatAgentSpec
from rlcore.agentic.chat_proxy import ChatProxyConfig
from rlcore.agentic.runner import generate_prompts, stop_runners
from rlcore.engines import RolloutConfig, SamplingSettings
from rlcore.engines.server import engine_idle_metrics, start_engine_servers, stop_engine_servers
from rlcore.models import ModelConfig
from rlcore.rewards.manager import RuleRewardManager
from rlcore.trainer.advantage import build_kl_controller, compute_advantage, compute_rewards, needs_old_log_prob
from rlcore.trainer.builder import build_data, build_workers, init_ray
from rlcore.trainer.config import load_config, register_schema
from rlcore.trainer.loop import TrainingRun
from rlcore.trainer.tasks import episode_tasks
from rlcore.trainer.validation import batch_metrics, mean_over_ranks, validate
from rlcore.trainer.warmstart import warm_start

SECTIONS = ("model", "warmstart", "data", "actor", "rollout", "reward", "algorithm", "agent", "agentic", "trainer")
register_schema("chat_agent_grpo_schema", SECTIONS)


def train(cfg: DictConfig) -> TrainingRun:
    cfg = load_config(cfg, SECTIONS)
    if cfg.model.path is None:
        cfg.model.path = warm_start(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    loader, val_batches = build_data(cfg, tokenizer)
    a, g = cfg.agentic, cfg.agent
    use_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    kl_ctrl = build_kl_controller(cfg.algorithm)  # with algorithm.use_kl_in_reward: the penalty's coefficient
    workers = build_workers(cfg, ["actor"] + (["ref"] if use_ref else []))
    init_ray(cfg)
    model_cfg, rollout_cfg = ModelConfig(**cfg.model), RolloutConfig(**OmegaConf.to_container(cfg.rollout))
    engines = start_engine_servers(a.num_engines, model_cfg, rollout_cfg, num_cpus=a.cpus_per_engine,
                                   num_gpus=a.gpus_per_engine)
    sampling = SamplingSettings.resolve(rollout_cfg, {"n": 1})
    proxy = ChatProxyConfig(max_request_bytes=g.max_request_bytes, max_n=g.max_n, request_timeout_s=g.request_timeout_s)
    spec = ChatAgentSpec(g.path, cfg.model.path, sampling, OmegaConf.to_container(g.kwargs), g.max_total_tokens,
                         g.episode_timeout_s, proxy)
    runners = start_runners(a.num_runners, spec, engines, num_cpus=a.cpus_per_runner, runner_cls=ChatAgentRunner)
    reward_fn = RuleRewardManager.from_config(cfg)  # for the single-turn validation
    groups = cfg.data.train_batch_size
    bucket_bytes = int(a.bucket_mb * 2**20)

    def validate_on_engines() -> dict[str, float]:
        return validate(lambda prompts: generate_prompts(engines, prompts, rollout_cfg), val_batches, reward_fn)

    state = {"kl_ctrl": kl_ctrl} if cfg.algorithm.use_kl_in_reward else {}
    with TrainingRun(cfg, workers, loader, validate_on_engines, state) as run:
        run.on_close(lambda: stop_engine_servers(engines))
        run.on_close(lambda: stop_runners(runners))
        workers.actor.push_weights(engines, run.start_step, bucket_bytes)  # the resumed weights, if any
        pool = RolloutPool(runners, episode_tasks(run), cfg.rollout.n, a.groups_in_flight or groups,
                           max_staleness=a.max_staleness, max_ready=a.max_ready).start()
        run.on_close(pool.stop)
        _, engine_state = engine_idle_metrics(engines)
        for step in run.steps():
            with run.timer("wait_rollout"):
                played = pool.get_groups(groups, current_version=step - 1, timeout_s=a.pop_timeout_s)
            segments = [t for group in played for t in group]
            uid = np.array([str(g) for g, group in enumerate(played) for _ in group], dtype=object)
            episode = np.array([f"{uid[i]}/{t.episode_id}" for i, t in enumerate(segments)], dtype=object)
            batch = to_dataproto(segments, tokenizer.pad_token_id, 1.0 if sampling.greedy else sampling.temperature,
                                 {"uid": uid, "episode": episode})
            metrics = chat_metrics(segments)
            if needs_old_log_prob(cfg):
                with run.timer("old_log_prob"):
                    batch.union(workers.actor.compute_log_prob(batch))
            if use_ref:
                with run.timer("ref"):
                    batch.union(workers.ref.compute_ref_log_prob(batch))
            with run.timer("adv"):
                metrics.update(compute_rewards(batch, cfg.algorithm, kl_ctrl))
                compute_advantage(batch, cfg.algorithm)
            with run.timer("update_actor"):
                metrics.update(mean_over_ranks(workers.actor.update_policy(batch)))
            with run.timer("sync_weights"):
                metrics.update(workers.actor.push_weights(engines, step, bucket_bytes, a.partial_rollout))
            idle, engine_state = engine_idle_metrics(engines, engine_state)
            run.end_step(step, {**metrics, **idle, **pool.metrics(), **batch_metrics(batch)}, batch)
    return run


def chat_metrics(segments: list) -> dict[str, float]:
    """Per episode (its first segment): reward, replies, first reply right; per segment: count."""
    first: dict = {}
    for t in segments:
        first.setdefault(t.episode_id, t)
    episodes = list(first.values())
    rewards = np.array([t.reward for t in episodes])
    requests = np.array([t.metrics["chat/requests"] for t in episodes])
    return {"episode/reward_mean": float(rewards.mean()), "episode/requests_mean": float(requests.mean()),
            "episode/first_try_right": float(((requests == 1) & (rewards > 0)).mean()),
            "episode/segments_mean": float(np.mean([t.metrics["chat/segments"] for t in episodes])),
            "episode/discarded_replies": float(np.sum([t.metrics["chat/discarded_replies"] for t in episodes])),
            "episode/agent_s_mean": float(np.mean([t.metrics["episode/agent_s"] for t in episodes]))}


@hydra.main(config_path="config", config_name="chat_agent_grpo", version_base=None)
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
