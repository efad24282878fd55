"""The driver-side step between scoring and the update: rewards (scores minus an optional KL
penalty), then advantages and returns from the configured estimator.

Estimators in ``rlcore.algos.advantages``' registry take different inputs (GAE needs values, GRPO the prompt
``uid`` groups, ReMax a baseline reward). ``compute_advantage`` offers each one what the batch and
``algorithm`` config hold, by parameter name, so a newly registered estimator works from config
alone; a required input the batch lacks is an error naming it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from omegaconf import DictConfig

from rlcore.algos.advantages import get_advantage_estimator
from rlcore.algos.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller
from rlcore.protocol import DataProto
from rlcore.trainer.consistency import check_rewards


def needs_old_log_prob(cfg: DictConfig) -> bool:
    """Whether the driver must call ``actor.compute_log_prob`` before the update.

    Not when each batch is one optimizer step (``actor.ppo_epochs`` 1, ``actor.ppo_mini_batch_size``
    null or all ``data.train_batch_size`` prompts) and no KL penalty goes into the rewards: the actor's
    update then uses its own log-probs, detached, as the old ones (they are the same numbers: no step
    has been taken yet), and a forward pass over the batch is saved (TRL does the same with
    num_iterations=1).
    """
    single_step = cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size in (None, cfg.data.train_batch_size)
    return cfg.algorithm.use_kl_in_reward or not single_step


def greedy_prompts(prompts: DataProto) -> DataProto:
    """The same prompts marked for one greedy response each: ReMax's baseline (Li et al. 2023) is the
    reward of the response the policy would give without sampling."""
    return DataProto(batch=prompts.batch, non_tensor_batch=dict(prompts.non_tensor_batch),
                     meta_info={**prompts.meta_info, "do_sample": False, "n": 1})


def greedy_baselines(batch: DataProto, greedy: DataProto, uid_key: str = "uid") -> torch.Tensor:
    """``reward_baselines`` (B,) for ReMax: each sampled row gets the score (``reward_scores``) of
    its prompt's greedy response, matched by ``uid``. The greedy rows only give this number; they
    are never trained on."""
    score_of = dict(zip(greedy.non_tensor_batch[uid_key].tolist(), greedy.batch["reward_scores"].tolist()))
    if len(score_of) != len(greedy):
        raise ValueError(f"greedy responses must be one per prompt: {len(greedy)} rows for {len(score_of)} uids")
    uids = batch.non_tensor_batch[uid_key].tolist()
    missing = sorted(set(uids) - score_of.keys())
    if missing:
        raise KeyError(f"no greedy response for prompt uid(s) {missing[:5]}")
    return torch.tensor([score_of[u] for u in uids], dtype=torch.float32)


def build_kl_controller(algo: DictConfig) -> FixedKLController | AdaptiveKLController:
    c = algo.kl_ctrl
    if c.type == "adaptive":
        return get_kl_controller("adaptive", init_kl_coef=c.kl_coef, target_kl=c.target_kl, horizon=c.horizon)
    return get_kl_controller(c.type, kl_coef=c.kl_coef)


def compute_rewards(batch: DataProto, algo: DictConfig,
                    kl_ctrl: FixedKLController | AdaptiveKLController | None) -> dict[str, float]:
    """``token_level_rewards``: the scores, minus coef * KL(pi_old || ref) per token when
    ``algorithm.use_kl_in_reward`` (needs old_log_probs and ref_log_prob). Returns its metrics. A
    NaN / infinite score is refused by name (``rlcore.trainer.consistency.check_rewards``)."""
    b = batch.batch
    checked = check_rewards(batch)
    if not algo.use_kl_in_reward:
        b["token_level_rewards"] = b["token_level_scores"]
        return checked
    if kl_ctrl is None:
        raise ValueError("algorithm.use_kl_in_reward needs a KL controller (build_kl_controller)")
    rewards, metrics = apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"],
                                        b["response_mask"], kl_ctrl, kind=algo.kl_penalty)
    b["token_level_rewards"] = rewards
    return {**checked, **metrics}


def compute_advantage(batch: DataProto, algo: DictConfig) -> None:
    """Fill ``advantages`` and ``returns`` (B, T_r) with the estimator ``algorithm.adv_estimator``."""
    estimator = get_advantage_estimator(algo.adv_estimator)
    b = batch.batch
    offered: dict[str, Any] = {
        "token_level_rewards": b["token_level_rewards"],
        "response_mask": b["response_mask"],
        "gamma": algo.gamma,
        "lam": algo.lam,
        "norm_adv_by_std": algo.norm_adv_by_std,
    }
    for key in ("values", "reward_baselines"):
        if key in b.keys():
            offered[key] = b[key]
    if "uid" in batch.non_tensor_batch:
        offered["index"] = batch.non_tensor_batch["uid"]
    if "episode" in batch.non_tensor_batch:  # rows of one episode (a chat agent's segments)
        offered["episode_index"] = batch.non_tensor_batch["episode"]
    params = inspect.signature(estimator).parameters
    missing = [name for name, p in params.items() if p.default is inspect.Parameter.empty and name not in offered]
    if missing:
        raise KeyError(f"advantage estimator {algo.adv_estimator!r} needs {missing}, which the batch does not hold")
    advantages, returns = estimator(**{k: v for k, v in offered.items() if k in params})
    b["advantages"], b["returns"] = advantages, returns
