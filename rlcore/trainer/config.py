"""Recipe configs: every section a recipe reads, its defaults, and a strict check of the keys.

A recipe's YAML (``recipes/config/<name>.yaml``) is composed by Hydra with the command-line
overrides, then ``load_config`` merges it over the defaults of the sections that recipe declares.
A key that no section knows is an error naming it (``actor.lrr``, ``foo``), before anything slow
starts: a typo must not silently train with a default. Hydra itself already refuses an override of
a key missing from the YAML (``foo.bar=1``); this catches the rest (``+foo.bar=1``, a custom YAML).

Where the defaults live:
- worker sections (``model``, ``actor``, ``critic``, ``rollout``, ``reward``) take the tables the
  workers declare (``ACTOR_DEFAULTS``, ``RolloutConfig``, ...), so each key is documented once, in
  the worker's module docstring; the workers check the values when they are built;
- the recipes' own sections (``trainer``, ``data``, ``algorithm``, ``warmstart``, ``tiny_model``,
  ``replay``, ``env``)
  are the dataclasses below, typed, so ``trainer.total_steps=abc`` fails at once.

The result is an OmegaConf struct config: reading a misspelt key in code fails too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config key no section knows, or a value of the wrong type."""


@dataclass
class TrainerConfig:
    """How and where a run executes; shared by every recipe."""

    backend: str = "ray"  # "ray": worker groups of Ray actors; "local": every role in this process
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when available)
    nnodes: int = 1  # nodes of the resource pool
    procs_per_node: int = 1  # ranks per node (one per GPU on GPU machines); "local" needs 1
    cpus_per_proc: float = 1.0  # CPUs Ray reserves per rank (also its torch thread count)
    ray_num_cpus: int | None = None  # CPUs of a Ray instance this run starts; None: all cores
    total_steps: int = 100  # training steps (one batch of prompts each)
    val_freq: int = 10  # validate every N steps and after the last; 0: never
    val_before_train: bool = True  # validate the starting model (step 0)
    save_freq: int = 0  # checkpoint every N steps; 0: never
    max_ckpt_to_keep: int | None = None  # prune older checkpoints; None: keep all
    resume: str = "disable"  # "disable", "auto" (the latest complete checkpoint) or a step folder
    output_dir: str = "outputs"  # runs go to <output_dir>/<project>/<run_name>
    project: str = "rlcore"
    run_name: str = "default"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    seed: int = 1  # driver RNG (python, numpy, torch)


@dataclass
class ArithmeticConfig:
    """The synthetic task written when no data files are given (``rlcore.data.arithmetic``)."""

    n_train: int = 320
    n_val: int = 80
    max_operand: int = 19
    ops: str = "+"
    seed: int = 0


@dataclass
class DataConfig:
    train_files: Any = None  # a path or list of paths (.jsonl/.parquet); None: the arithmetic task
    val_files: Any = None  # same; None with train_files None: the arithmetic validation split
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_length: int = 64  # longer prompts are dropped (and counted) when loading
    apply_chat_template: bool | None = False  # None: when the tokenizer has a template
    train_batch_size: int = 64  # prompts per training step
    val_batch_size: int | None = None  # prompts per validation generate call; None: all at once
    shuffle: bool = True
    seed: int = 0  # shuffling order; epoch e is a pure function of (seed, e)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # "fixed" or "adaptive" (core_algos.get_kl_controller)
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


@dataclass
class AlgorithmConfig:
    """Driver-side RL math: the advantage estimator and the KL penalty in the reward."""

    adv_estimator: str = "grpo"  # a name in core_algos' advantage registry
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True  # grpo: divide by the group std (False: Dr. GRPO)
    use_kl_in_reward: bool = False  # rewards = scores - coef * KL(pi_old || ref) per token
    kl_penalty: str = "kl"  # KL estimator of that penalty (core_algos.kl_penalty kinds)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    dpo_beta: float = 0.1  # online DPO: strength of the implicit KL to the reference
    dpo_loss_type: str = "sigmoid"  # online DPO: "sigmoid" (DPO) or "ipo"


@dataclass
class TinyModelConfig:
    """A model built from scratch when ``model.path`` is null (``rlcore.models.tiny``)."""

    preset: str = "tiny"
    arch: str = "llama"
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int | None = None
    seed: int = 0


@dataclass
class WarmStartConfig:
    """The starting policy of RL recipes when ``model.path`` is null: the SFT recipe run briefly
    (recipes/config/sft.yaml on this recipe's data), to a policy that is sometimes right; cached."""

    dir: str = "outputs/warmstart"
    steps: int = 60  # SFT steps: ~10-20% greedy accuracy on the default arithmetic task


@dataclass
class ReplayConfig:
    """The replay buffer between an asynchronous recipe's rollout producer and its trainer."""

    capacity_batches: int = 1  # rows held, in training batches (train_batch_size x rollout.n)
    max_staleness: int = 1  # rows more than this many policy versions old are dropped; 0: on-policy
    pop_timeout_s: float = 600.0  # the trainer waits this long for a fresh batch, then fails


@dataclass
class EnvConfig:
    """The environment of a multi-turn recipe (``rlcore.agentic.env`` registry)."""

    name: str = "arithmetic_retry"  # a registered env
    kwargs: dict[str, Any] = field(default_factory=dict)  # the env's constructor arguments
    max_turns: int = 3  # policy turns per episode at most
    max_total_tokens: int = 64  # prompt + all turns of an episode at most


RECIPE_SECTIONS: dict[str, type] = {
    "trainer": TrainerConfig,
    "data": DataConfig,
    "algorithm": AlgorithmConfig,
    "tiny_model": TinyModelConfig,
    "warmstart": WarmStartConfig,
    "replay": ReplayConfig,
    "env": EnvConfig,
}


def worker_section_defaults() -> dict[str, dict[str, Any]]:
    """The worker-owned sections and their defaults, as the workers declare them."""
    from rlcore.workers.actor import ACTOR_DEFAULTS
    from rlcore.workers.critic import CRITIC_DEFAULTS
    from rlcore.workers.fsdp_utils import MODEL_DEFAULTS
    from rlcore.workers.reward import REWARD_DEFAULTS
    from rlcore.workers.rollout.base import RolloutConfig

    rollout = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
    rollout = {k: list(v) if isinstance(v, tuple) else v for k, v in rollout.items()}
    return {"model": MODEL_DEFAULTS, "actor": ACTOR_DEFAULTS, "critic": CRITIC_DEFAULTS,
            "rollout": rollout, "reward": REWARD_DEFAULTS}


def _section_schema(name: str, worker_defaults: dict[str, dict[str, Any]]) -> DictConfig:
    if name in RECIPE_SECTIONS:
        return OmegaConf.structured(RECIPE_SECTIONS[name])
    schema = OmegaConf.create(dict(worker_defaults[name]))
    OmegaConf.set_struct(schema, True)
    for key, value in worker_defaults[name].items():
        if isinstance(value, Mapping):  # a free-form mapping (e.g. reward.reward_kwargs): any keys
            OmegaConf.set_struct(schema[key], False)
    return schema


def register_schema(name: str, sections: Sequence[str]) -> None:
    """Store the defaults of ``sections`` in Hydra's ConfigStore as ``name``.

    A recipe YAML that starts with ``defaults: [<name>, _self_]`` then composes over every known key,
    so any of them can be overridden on the command line, and Hydra refuses an unknown one by name.
    """
    from hydra.core.config_store import ConfigStore

    worker_defaults = worker_section_defaults()
    ConfigStore.instance().store(name=name, node={s: _section_schema(s, worker_defaults) for s in sections})


def load_config(cfg: DictConfig | Mapping, sections: Sequence[str]) -> DictConfig:
    """``cfg`` merged over the defaults of ``sections``; unknown sections or keys raise ConfigError.

    Hydra's own ``hydra`` node, if present, is dropped. Returns a resolved struct config.
    """
    worker_defaults = worker_section_defaults()
    known = set(RECIPE_SECTIONS) | set(worker_defaults)
    bad = sorted(set(sections) - known)
    if bad:
        raise ConfigError(f"no such config section(s) {bad}; known: {sorted(known)}")
    given = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))
    given = OmegaConf.to_container(given, resolve=False)
    for hydra_key in ("hydra", "defaults"):  # present when a recipe YAML is loaded without Hydra
        given.pop(hydra_key, None)
    given = OmegaConf.to_container(OmegaConf.create(given), resolve=True)
    unknown = sorted(set(given) - set(sections))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}: this recipe reads the sections {list(sections)}")
    merged = {}
    for name in sections:
        schema = _section_schema(name, worker_defaults)
        value = given.get(name) or {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"config section {name!r} must be a mapping, got {value!r}")
        try:
            merged[name] = OmegaConf.merge(schema, value)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            reason = str(exc).splitlines()[0]  # OmegaConf appends full_key/object_type lines
            raise ConfigError(f"config key {name}.{key}: {reason}") from None
    out = OmegaConf.create(merged)
    OmegaConf.set_struct(out, True)
    return out


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """A resolved plain-dict copy (what workers receive: cheap to pickle, no OmegaConf needed)."""
    return OmegaConf.to_container(cfg, resolve=True)
