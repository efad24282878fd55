"""How batch sizes given in prompts become the rows and optimizer steps the workers count.

verl's ``ppo_mini_batch_size`` counts prompts of ``data.train_batch_size``; a worker's update loops over
rows. This module holds that one conversion (``rows_per_prompt``, ``mini_batch_rows``), the optimizer
steps a run takes (``scheduled_steps``: what a decaying learning rate spans when its ``total_steps`` is
null) and the load-time check that a step's prompts split as the run needs (``check_batch_split``).
``rlcore.trainer.config.to_worker_config`` applies them to the config the workers are built with.
"""

from __future__ import annotations

from collections.abc import Mapping

from omegaconf import DictConfig

from rlcore.typed_config import ConfigError

TRAINED_SECTIONS = ("actor", "critic", "reward_model")  # the sections with a ppo_mini_batch_size (TrainConfig)


def rows_per_prompt(cfg: DictConfig | Mapping, role: str) -> int:
    """The rows one prompt of ``data.train_batch_size`` adds to ``role``'s update batch: what turns
    ``ppo_mini_batch_size`` (prompts, verl's meaning) into the rows of one optimizer step.

    - ``reward_model`` (and any run without a rollout): 1, a row is one (prompt, chosen, rejected) pair;
    - the actor of online DPO (``actor.policy_loss=dpo``): 2, a prompt gives at most one
      (chosen, rejected) pair, so the mini-batch counts pairs;
    - otherwise ``rollout.n``: a prompt's sampled responses (GRPO, PPO, DAPO, async GRPO) or
      episodes (multi-turn, agentic). SFT keeps ``rollout.n=1`` (its rollout only validates): one row
      per prompt, its answer.
    """
    if role == "reward_model" or "rollout" not in cfg:
        return 1
    if role == "actor" and cfg["actor"].get("policy_loss") == "dpo":
        return 2
    return int(cfg["rollout"].get("n", 1))


def mini_batch_rows(cfg: DictConfig | Mapping, role: str) -> int | None:
    """``role``'s global rows per optimizer step: ``ppo_mini_batch_size`` prompts x ``rows_per_prompt``
    (verl's normalisation, before its division over the ranks); None (the whole batch) stays None."""
    mini = cfg[role]["ppo_mini_batch_size"]
    return None if mini is None else mini * rows_per_prompt(cfg, role)


def scheduled_steps(cfg: DictConfig | Mapping, role: str) -> int:
    """The optimizer steps of ``role`` over the whole run, for a decaying learning rate whose
    ``total_steps`` is null: ``trainer.total_steps`` x the mini-batches of a full batch
    (``data.train_batch_size`` / ``ppo_mini_batch_size`` prompts, one when null) x ``ppo_epochs``.
    A step that trains fewer rows (GRPO's zero-advantage groups skipped, online DPO's pairs) takes fewer
    optimizer steps, and the decay then ends short of its floor: count them in ``total_steps`` yourself."""
    section, batch = cfg[role], cfg["data"]["train_batch_size"]
    mini = section["ppo_mini_batch_size"] or batch
    return cfg["trainer"]["total_steps"] * -(-batch // mini) * section["ppo_epochs"]


def check_batch_split(cfg: DictConfig) -> None:
    """Batch sizes that cannot be split as the run needs, refused now rather than at the first dispatch
    or update, after the workers (and maybe a warm start) were built. A step's prompts are split over
    the ranks; ``ppo_mini_batch_size`` prompts must divide ``data.train_batch_size`` prompts (whole
    mini-batches per step), and their rows (``mini_batch_rows``) split over the ranks; with
    ``use_dynamic_bsz`` the longest possible sequence must fit one micro-batch's token budget."""
    t, d = cfg.trainer, cfg.data
    ranks = t.nnodes * t.procs_per_node
    over = f"{ranks} ranks (trainer.nnodes={t.nnodes} x trainer.procs_per_node={t.procs_per_node})"
    if d.train_batch_size % ranks:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} prompts do not split evenly over {over}")
    longest = None
    if "rollout" in cfg:
        longest = cfg.env.max_total_tokens if "env" in cfg else d.max_prompt_length + cfg.rollout.max_new_tokens
    for role in TRAINED_SECTIONS:
        if role not in cfg:
            continue
        c = cfg[role]
        mini = c.ppo_mini_batch_size
        # online DPO trains on a varying number of (chosen, rejected) pairs, not on every prompt
        if mini is not None and d.train_batch_size % mini and c.get("policy_loss") != "dpo":
            raise ConfigError(f"{role}.ppo_mini_batch_size={mini} does not divide data.train_batch_size="
                              f"{d.train_batch_size}: both count prompts (as in verl), and a step's prompts must "
                              "make whole mini-batches")
        rows = mini_batch_rows(cfg, role)
        if rows is not None and rows % ranks:
            raise ConfigError(f"{role}.ppo_mini_batch_size={mini} prompts ({rows} rows, {rows_per_prompt(cfg, role)} "
                              f"per prompt) do not split evenly over {over}")
        if c.use_dynamic_bsz and longest is not None and longest > c.ppo_max_token_len_per_gpu:
            raise ConfigError(f"{role}.ppo_max_token_len_per_gpu={c.ppo_max_token_len_per_gpu} is below the longest "
                              f"possible sequence ({longest} tokens: data.max_prompt_length + rollout.max_new_tokens, "
                              f"or env.max_total_tokens) with {role}.use_dynamic_bsz=true")
