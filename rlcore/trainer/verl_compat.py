"""verl's command-line keys, translated to rlcore's or refused by name, before Hydra reads them.

A verl user's muscle memory (``actor_rollout_ref.actor.optim.lr=1e-6``,
``custom_reward_function.path=my_reward.py``, ``trainer.total_training_steps=20``) would otherwise
meet Hydra's generic "Could not override ... append with +" error, which names neither the cause
(another framework's key) nor the fix. Hydra refuses an unknown key while composing, before any
recipe code runs, so the translation works on the override strings themselves: each recipe's
``__main__`` calls ``rlcore.trainer.cli.prepare_argv(SECTIONS)`` before ``main()``, which lists every
refused key at once (``translate_overrides_collecting``).

An override is left alone when it is already a key of the recipe's config (``data.train_batch_size``,
``algorithm.adv_estimator``: verl and rlcore share those names and meanings). Otherwise a verl key
of the same meaning is rewritten to rlcore's, with one note line per key on stderr saying what it
became; a verl key with no rlcore counterpart is a ``ConfigError`` naming the key and what to set
instead. docs/recipes.md ("Coming from verl") lists the table.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence

from rlcore.trainer.config import SECTIONS, ConfigError

# verl key -> rlcore key, same meaning and same values.
RENAMED = {
    "actor_rollout_ref.model.path": "model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.warmup_steps",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.lr_scheduler",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.lr_scheduler",
    "actor_rollout_ref.actor.optim.clip_grad": "actor.grad_clip",
    "actor_rollout_ref.actor.grad_clip": "actor.grad_clip",
    "actor_rollout_ref.rollout.name": "rollout.backend",  # vllm, or hf for transformers' generate
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.model.path": "model.path",
    "data.max_response_length": "rollout.max_new_tokens",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.n_gpus_per_node": "trainer.procs_per_node",
    "trainer.test_freq": "trainer.val_freq",
    "trainer.project_name": "trainer.project",
    "trainer.experiment_name": "trainer.run_name",
    "trainer.logger": "trainer.loggers",
    "trainer.resume_mode": "trainer.resume",
    "trainer.resume_from_path": "trainer.resume",
    "reward_model.model.path": "reward.model.path",
    "reward_model.micro_batch_size_per_gpu": "reward.model.micro_batch_size_per_gpu",
}
# verl sections whose keys rlcore has under the same leaf name in its own section.
SAME_LEAF = {
    "actor_rollout_ref.actor.optim.": "actor",
    "actor_rollout_ref.actor.": "actor",
    "actor_rollout_ref.rollout.": "rollout",
    "critic.optim.": "critic",
}
# verl keys with no rlcore counterpart: what to do instead.
REFUSED = {
    "actor_rollout_ref.actor.clip_ratio": "set actor.clip_ratio_low and actor.clip_ratio_high (both 0.2 by default)",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rlcore's vLLM rollout runs one engine per rank "
                                                             "(tensor parallelism is not supported)",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "the reference forwards use "
                                                                "actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "log-prob forwards use "
                                                                    "actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "validation decodes greedily (rollout.temperature is "
                                                         "the training samples')",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "validation decodes greedily",
    "trainer.total_epochs": "rlcore counts steps: set trainer.total_steps (one step = data.train_batch_size "
                            "prompts; an epoch = rows / data.train_batch_size steps)",
    "trainer.default_local_dir": "a run's folder is <trainer.output_dir>/<trainer.project>/<trainer.run_name>, "
                                 "checkpoints under its checkpoints/",
    "trainer.critic_warmup": "not supported: the critic and the actor update from the first step",
    "data.filter_overlong_prompts": "prompts longer than data.max_prompt_length are always dropped (and counted) "
                                    "at load",
    "data.truncation": "prompts are never truncated: longer ones than data.max_prompt_length are dropped at load",
    "data.return_raw_chat": "not needed: chat-list prompts keep their messages",
    "reward_model.reward_manager": "rule rewards run in the driver: reward.num_workers forks scoring processes",
    "reward_model.enable": "a learned reward model is on when reward.model.path is set",
}
VERL_PREFIXES = ("actor_rollout_ref.", "custom_reward_function.", "reward_model.", "trainer.", "data.", "critic.",
                 "algorithm.")
OVERRIDE = re.compile(r"^(\+{0,2})([A-Za-z_][\w.]*)=(.*)$", re.S)


def _has_key(sections: Sequence[str], dotted: str) -> bool:
    """Whether ``dotted`` (``actor.lora.rank``) is a key of the recipe's sections' dataclasses."""
    head, _, rest = dotted.partition(".")
    if head not in sections or not rest:
        return False
    cls = SECTIONS[head]
    for part in rest.split("."):
        if not (dataclasses.is_dataclass(cls) and part in {f.name for f in dataclasses.fields(cls)}):
            return False
        hints = typing.get_type_hints(cls)
        cls = hints[part]
    return True


def translate_overrides(overrides: Sequence[str], sections: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the overrides with verl's keys rewritten to rlcore's, one note per rewritten key). Raises
    ``ConfigError`` for the verl keys rlcore has no counterpart for (all of them, a line each), naming what to
    set instead."""
    out, notes, refused = translate_overrides_collecting(overrides, sections)
    if refused:
        raise ConfigError("\n".join(refused))
    return out, notes


def translate_overrides_collecting(overrides: Sequence[str],
                                   sections: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """``translate_overrides``, the refused keys returned (a line each, left out of the overrides)."""
    out, notes, refused, reward_path, reward_name = [], [], [], None, None
    for arg in overrides:
        match = OVERRIDE.match(arg)
        if not match or _has_key(sections, match.group(2)) or not match.group(2).startswith(VERL_PREFIXES):
            out.append(arg)
            continue
        key, value = match.group(2), match.group(3)
        if key == "custom_reward_function.path":
            reward_path = value
            continue
        if key == "custom_reward_function.name":
            reward_name = value
            continue
        if key == "trainer.resume_mode" and value == "resume_path":  # verl's switch for resume_from_path
            notes.append("verl's trainer.resume_mode=resume_path: trainer.resume takes the path itself")
            continue
        target = RENAMED.get(key) or _same_leaf(key, sections)
        if target is None:
            reason = REFUSED.get(key)
            if reason is None and not key.startswith(("actor_rollout_ref.", "custom_reward_function.")):
                out.append(arg)  # not a verl key rlcore knows of: Hydra's own error names it
                continue
            refused.append(f"{key} is verl's key, which rlcore has no counterpart for: "
                           f"{reason or 'see docs/recipes.md, Coming from verl, for the keys rlcore maps'}")
            continue
        if target.partition(".")[0] not in sections:
            refused.append(f"{key} is verl's name for {target}, which this recipe does not read "
                           f"(its sections: {', '.join(sections)})")
            continue
        out.append(f"{target}={value}")
        notes.append(f"verl key {key} -> rlcore key {target}")
    if reward_name is not None and reward_path is None:
        refused.append("custom_reward_function.name needs custom_reward_function.path (rlcore: "
                       "reward.reward_fn=<file.py>:<function>)")
    if reward_path is not None:
        fn = f"{reward_path}:{reward_name or 'compute_score'}"  # verl's default function name
        out.append(f"reward.reward_fn={fn}")
        notes.append(f"verl keys custom_reward_function.path/name -> rlcore key reward.reward_fn={fn}")
    return out, notes, refused


def _same_leaf(key: str, sections: Sequence[str]) -> str | None:
    for prefix, section in SAME_LEAF.items():
        if key.startswith(prefix):
            target = f"{section}.{key[len(prefix):]}"
            return target if _has_key(sections, target) else None
    return None
