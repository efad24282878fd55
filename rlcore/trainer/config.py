"""The one config model of a run: every section a recipe can set is a typed dataclass, checked here.

The sections and where their dataclasses live (each next to the code that reads it):

    section      dataclass                          layer
    model        ModelConfig                        rlcore.models
    tiny_model   TinyModelConfig                    rlcore.models
    rollout      RolloutConfig                      rlcore.engines
    actor        ActorConfig (a PolicyLossConfig)   rlcore.workers
    critic       CriticConfig                       rlcore.workers
    reward_model RewardModelConfig                  rlcore.workers
    reward       RewardConfig                       rlcore.rewards
    trainer, data, algorithm, warmstart, replay, env   below, in this module

A recipe's YAML (``recipes/config/<name>.yaml``) composes ``base.yaml`` and the recipe's schema
(``register_schema``: every key of its sections, with its default) through Hydra's ``defaults:``,
so ``python -m recipes.grpo --cfg job`` prints every key and Hydra refuses an unknown override by
name. ``load_config`` then checks the composed config: an unknown section or key, a value of the
wrong type (``actor.lr=abc``, ``rollout.do_sample=maybe``) or out of range is one ``ConfigError``
naming ``section.key`` and what was expected, before anything slow starts.

The result is an OmegaConf struct config: reading a misspelt key in code fails too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlcore.engines.base import RolloutConfig
from rlcore.models.config import ModelConfig, TinyModelConfig
from rlcore.models.gguf import resolve_model_path
from rlcore.rewards.manager import RewardConfig
from rlcore.trainer.batch_sizes import (  # noqa: F401 (re-exported: the conversion's home is batch_sizes)
    TRAINED_SECTIONS,
    check_batch_split,
    mini_batch_rows,
    rows_per_prompt,
    scheduled_steps,
)
from rlcore.typed_config import ConfigError, merge_section, section_schema, to_section
from rlcore.workers.config import ActorConfig, CriticConfig
from rlcore.workers.mismatch import CheckConfig
from rlcore.workers.reward_model import RewardModelConfig

__all__ = ["ConfigError", "SECTIONS", "TRAINED_SECTIONS", "check_batch_split", "load_config", "mini_batch_rows",
           "register_schema", "rows_per_prompt", "to_plain", "to_worker_config"]


STALL_ACTIONS = ("warn", "fail")
# Seconds per phase (the recipes' run.timer stages, and "step": a whole step); each listed so that a
# command line can set it without Hydra's "+". Other stages get trainer.watchdog.deadline_s.
STAGE_DEADLINES = {
    "step": 7200.0, "gen": 1800.0, "reward": 900.0, "old_log_prob": 1800.0, "ref": 1800.0, "values": 1800.0,
    "adv": 600.0, "update_actor": 1800.0, "update_critic": 1800.0, "sync_weights": 600.0, "wait_rollout": 300.0,
    "validate": 3600.0, "save_checkpoint": 3600.0}


@dataclass
class WatchdogConfig:
    """The driver's stall watchdog (``rlcore.trainer.watchdog``, docs/stalls.md): a phase (a ``run.timer``
    stage, or a whole ``step``) running past its deadline names the stuck group, rank and method and
    writes their stacks to ``<run>/stalls/``."""

    enable: bool = True
    deadline_s: float = 1800.0  # any phase without a deadline of its own
    deadlines: dict[str, float] = field(default_factory=lambda: dict(STAGE_DEADLINES))  # per phase; 0: not watched
    on_stall: str = "warn"  # "warn": report and go on waiting; "fail": report and raise StallError in the driver

    def __post_init__(self) -> None:
        if self.on_stall not in STALL_ACTIONS:
            raise ValueError(f"trainer.watchdog.on_stall must be one of {STALL_ACTIONS}, got {self.on_stall!r}")
        bad = {k: v for k, v in {"deadline_s": self.deadline_s, **self.deadlines}.items() if v < 0}
        if bad:
            raise ValueError(f"trainer.watchdog deadlines must be >= 0 seconds (0: not watched), got {bad}")


@dataclass
class CompletionTableConfig:
    """A table of sampled completions (prompt, response, reward and its components, advantage, policy
    version, data source) in the trackers that show tables (``rlcore.trainer.completion_table``)."""

    every: int = 10  # log one every N steps; 0: off
    rows: int = 16  # rows per table (whole prompt groups, evenly spread over the batch, the last one cut)

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"trainer.completion_table.every must be >= 0 (0: off), got {self.every}")
        if self.rows < 1:
            raise ValueError(f"trainer.completion_table.rows must be >= 1, got {self.rows}")


@dataclass
class TrainerConfig:
    """How and where a run executes; shared by every recipe."""

    backend: str = "ray"  # "ray": worker groups of Ray actors; "local": every role in this process
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when available)
    nnodes: int = 1  # nodes of the resource pool
    procs_per_node: int = 1  # ranks per node (one per GPU on GPU machines); "local" needs 1
    cpus_per_proc: float = 1.0  # CPUs Ray reserves per rank (also its torch thread count)
    balance_batch: bool = True  # split actor/critic/ref/reward-model batches over DP ranks by token count (results in order)
    ray_num_cpus: int | None = None  # CPUs of a Ray instance this run starts; None: all cores
    ray_address: str | None = None  # host:port of a running cluster's GCS; None: RAY_ADDRESS, else a local instance
    ray_connect_timeout_s: float = 30.0  # that address must accept a connection this soon, else the run fails
    total_steps: int = 100  # training steps (one batch of prompts each)
    val_freq: int = 10  # validate every N steps and after the last; 0: never
    val_before_train: bool = True  # validate the starting model (step 0)
    save_freq: int = 0  # checkpoint every N steps; 0: never
    max_ckpt_to_keep: int | None = None  # prune older checkpoints; None: keep all
    export_hf: bool = True  # a HF model (config, tokenizer, safetensors) in each checkpoint (<ckpt>/hf) and at the end (<run>/hf)
    keep_best: bool = True  # with export_hf: the policy of each new best validation score exported to <run>/hf_best
    resume: str = "disable"  # "disable", "auto" (the latest complete checkpoint) or a step folder
    overwrite: bool = False  # start afresh in a run folder that holds another run, deleting its records
    output_dir: str = "outputs"  # runs go to <output_dir>/<project>/<run_name>
    project: str = "rlcore"
    run_name: str = "default"
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    seed: int = 1  # driver RNG (python, numpy, torch), and each prompt batch's sampling seed (from seed, batch index)
    trajectory_groups: int = 2  # prompt groups of each step written to <run>/trajectories/ for rlcore.inspect; 0: off
    completion_table: CompletionTableConfig = field(default_factory=CompletionTableConfig)  # tables in W&B, TensorBoard, ...
    deterministic: bool = False  # torch's deterministic algorithms in driver and workers (+ cuBLAS / vLLM settings on GPU)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)  # stalled phases named, their stacks written
    check: CheckConfig = field(default_factory=CheckConfig)  # the consistency check (rlcore.trainer.consistency)
    memory_watch_s: float = 5.0  # seconds between readings of the run's processes' PSS (rlcore.trainer.process_memory); 0: off
    release_memory: bool = False  # free heap pages given back after each update and sync, vLLM's KV cache between
                                  # generations and (recipes/grpo.py) its weights through the update
                                  # (rlcore.engines.host_memory): the SmolLM2 preset 6.66 -> 5.93-5.98 GiB, on there; off by
                                  # default, as every page given back is faulted in again by the next phase (fp32 update
                                  # at SmolLM2 26.5 -> 25.2 s alone, more beside other jobs; docs/benchmarks.md)
    trim_in_update: bool = False  # with release_memory, the heap trimmed inside each update too (before each backward,
                                  # between its layers): ~0.5 GiB lower peak, +12% of the update (pages faulted in
                                  # again); on in the SmolLM2 presets (docs/real_models.md, "Memory")
    keep_large_blocks: bool = True  # glibc's heap serves blocks of any size and keeps what a phase frees (no mmap per
                                    # block over 32 MiB, faulted in afresh each micro-batch): fp32 update 28.1 -> 25.5 s;
                                    # release_memory still gives it back between phases; off in the SmolLM2 presets

    def __post_init__(self) -> None:
        for key, allowed in (("backend", ("ray", "local")), ("device", ("cpu", "cuda", "auto"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"trainer.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        for key in ("nnodes", "procs_per_node", "total_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        if self.trajectory_groups < 0:
            raise ValueError(f"trainer.trajectory_groups must be >= 0 (0: off), got {self.trajectory_groups}")
        for key in ("save_freq", "val_freq"):  # step % -1 == 0: verl's "never" would mean "every step"
            if getattr(self, key) < 0:
                raise ValueError(f"trainer.{key}={getattr(self, key)}: write 0 for never (verl's -1)")
        if self.overwrite and self.resume != "disable":
            raise ValueError(f"trainer.overwrite=true replaces the run in the folder, trainer.resume={self.resume!r} "
                             "continues it: set one of them")
        if self.memory_watch_s < 0:
            raise ValueError(f"trainer.memory_watch_s must be >= 0 seconds (0: off), got {self.memory_watch_s}")
        for key in ("cpus_per_proc", "ray_connect_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"trainer.{key} must be > 0, got {getattr(self, key)}")
        if self.backend == "local" and self.nnodes * self.procs_per_node != 1:
            raise ValueError("trainer.backend=local runs one rank in this process: set trainer.nnodes=1 and "
                             "trainer.procs_per_node=1, or use trainer.backend=ray for more ranks")


@dataclass
class ArithmeticConfig:
    """The synthetic task written when no data files are given (``rlcore.data.arithmetic``)."""

    n_train: int = 320
    n_val: int = 80
    max_operand: int = 19
    ops: str = "+"
    seed: int = 0


GENERATED_TASKS = ("arithmetic", "arithmetic_words", "multi_step")


@dataclass
class WordProblemsConfig:
    """The chat tasks written for ``data.task=arithmetic_words`` / ``multi_step`` (``rlcore.data.word_problems``)."""

    n_train: int = 4000
    n_val: int = 200  # the held-out split greedy validation reports
    seed: int = 0


@dataclass
class DataConfig:
    train_files: Any = None  # a path or list of paths (.jsonl/.parquet); None: the generated task of data.task
    val_files: Any = None  # same; None with train_files None: that task's validation split
    task: str = "arithmetic"  # generated when no files: "arithmetic" (a+b=, tiny model), "arithmetic_words" or "multi_step" (chat models)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    response_key: str | None = None  # SFT only: the column trained on as the reply (e.g. "solution"); None: the answer
    max_prompt_length: int = 64  # longer prompts are dropped (and counted) when loading
    # plain-string prompts: "auto" (or null) through the chat template when the tokenizer has one (chat
    # models, the smollm2 preset); true always; false never (the tiny model learns raw "a+b="). Chat lists always are
    apply_chat_template: Any = False
    train_batch_size: int = 64  # prompts per training step
    val_batch_size: int | None = None  # prompts per validation generate call; None: all at once
    shuffle: bool = True
    seed: int = 0  # shuffling order; epoch e is a pure function of (seed, e); with data.source: the source's seed
    # prompts produced on the fly instead of files (rlcore.data.sources, docs/environments.md): "reasoning_gym:<task>",
    # "verifiers:<environment>", "package.module:function" or "path/file.py:function"; with its own reward
    source: str | None = None
    source_kwargs: dict[str, Any] = field(default_factory=dict)  # the source's arguments (size, a task's config, ...)
    source_val_size: int = 64  # validation rows: the first ones of the source opened with split="val"
    source_val_seed: int | None = None  # validation's seed; null: data.seed + 1000003 (training skips those prompts)
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    word_problems: WordProblemsConfig = field(default_factory=WordProblemsConfig)

    def __post_init__(self) -> None:
        if self.task not in GENERATED_TASKS:
            raise ValueError(f"data.task must be one of {GENERATED_TASKS}, got {self.task!r}")
        if self.source is not None and (self.train_files is not None or self.val_files is not None):
            raise ValueError("data.source and data.train_files/val_files exclude each other: prompts come from one")
        if self.source_val_size <= 0:
            raise ValueError(f"data.source_val_size must be positive, got {self.source_val_size}")
        if not (self.apply_chat_template is None or isinstance(self.apply_chat_template, bool)
                or self.apply_chat_template == "auto"):
            raise ValueError(f"data.apply_chat_template must be true, false, null or auto, got {self.apply_chat_template!r}")


@dataclass
class KLControlConfig:
    type: str = "fixed"  # "fixed" or "adaptive" (rlcore.algos.kl.get_kl_controller)
    kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    horizon: int = 10000  # adaptive only


FILTER_METRICS = ("score", "reward")


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``recipes/dapo.py``): prompt groups whose responses all score the same
    are dropped and more prompts are drawn until ``data.train_batch_size`` groups remain."""

    enable: bool = False
    metric: str = "score"  # "score": the rule reward (accuracy, as in DAPO); "reward": after the overlong penalty
    max_num_gen_batches: int = 4  # generation rounds per step at most; then the batch is topped up with dropped groups

    def __post_init__(self) -> None:
        if self.metric not in FILTER_METRICS:
            raise ValueError(f"algorithm.filter_groups.metric must be one of {FILTER_METRICS}, got {self.metric!r}")
        if self.max_num_gen_batches < 1:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches must be >= 1, got {self.max_num_gen_batches}")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (``rlcore.algos.dapo.overlong_penalty``), added to the score."""

    enable: bool = False
    len: int = 4  # L_cache: the penalty ramps 0 -> -1 over the last `len` tokens before rollout.max_new_tokens
    penalty_factor: float = 1.0  # scales that penalty

    def __post_init__(self) -> None:
        if self.len < 1 or self.penalty_factor < 0:
            raise ValueError(f"algorithm.overlong_buffer needs len >= 1 and penalty_factor >= 0, got {self.len}, "
                             f"{self.penalty_factor}")


@dataclass
class AlgorithmConfig:
    """Driver-side RL math: the advantage estimator, the KL penalty in the reward, DAPO's group filter
    and length shaping."""

    adv_estimator: str = "grpo"  # a name in the advantage registry (rlcore.algos.advantages)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True  # grpo: divide by the group std (False: Dr. GRPO)
    use_kl_in_reward: bool = False  # rewards = scores - coef * KL(pi_old || ref) per token
    kl_penalty: str = "kl"  # KL estimator of that penalty (rlcore.algos.kl.KL_KINDS)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    dpo_beta: float = 0.1  # online DPO: strength of the implicit KL to the reference
    dpo_loss_type: str = "sigmoid"  # online DPO: "sigmoid" (DPO) or "ipo"
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    overlong_filter: bool = False  # DAPO: responses cut at rollout.max_new_tokens (no stop token) get no loss


@dataclass
class WarmStartConfig:
    """The starting policy of RL recipes when ``model.path`` is null (``rlcore.trainer.warmstart``):
    the SFT recipe run briefly on this recipe's data, to a policy that is sometimes right; cached."""

    dir: str = "outputs/warmstart"  # cache folder, one subfolder per (recipe, steps, data)
    steps: int = 60  # SFT steps: ~10-20% greedy accuracy on the default arithmetic task
    recipe: str = "recipes.sft"  # the module run as ``python -m <recipe>`` to build it
    timeout_s: float = 1800.0  # the warm start fails if it takes longer
    arch: str = "llama"  # the tiny model SFT starts from (tiny_model.arch): "llama", "qwen3" or "qwen3_moe"


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
    step_timeout_s: float = 60.0  # an env reset/step that takes longer fails the episode (EnvError)


@dataclass
class AgenticConfig:
    """Engines as services, episode runners and the streaming pool (``recipes/agentic_grpo.py``)."""

    num_engines: int = 1  # engine servers, each a Ray actor on resources of its own
    cpus_per_engine: float = 1.0  # CPUs each engine server reserves (also its torch threads)
    gpus_per_engine: float = 0.0
    num_runners: int = 1  # episode-runner actors (they hold no model: many episodes each, as coroutines)
    cpus_per_runner: float = 0.0  # runners mostly wait on engines and envs
    groups_in_flight: int | None = None  # prompt groups being played at once; null: data.train_batch_size
    max_ready: int = 0  # finished groups that may wait beyond groups_in_flight (backpressure: more go stale)
    max_staleness: int = 1  # groups whose oldest token is older than this many versions are dropped
    max_token_staleness: int | None = None  # also mask, token by token, model tokens older than this
    partial_rollout: bool = False  # weight updates land mid-response (tokens stamped per version); false: between responses
    bucket_mb: float = 256.0  # weight-sync bucket size (MiB): the extra memory an engine needs for an update
    pop_timeout_s: float = 600.0  # the trainer waits this long for groups, then fails
    drop_failed_groups: bool = False  # a group whose episode raised: false fails the run naming it; true drops it (counted)

    def __post_init__(self) -> None:
        if self.num_engines < 1 or self.num_runners < 1:
            raise ValueError(f"agentic needs num_engines >= 1 and num_runners >= 1, got {self.num_engines}, "
                             f"{self.num_runners}")
        if self.bucket_mb <= 0 or self.max_staleness < 0:
            raise ValueError(f"agentic.bucket_mb must be > 0 and max_staleness >= 0, got {self.bucket_mb}, "
                             f"{self.max_staleness}")


@dataclass
class AgentConfig:
    """The black-box chat agent of ``recipes/chat_agent_grpo.py`` and its OpenAI endpoint."""

    path: str = "examples/agents/arithmetic_chat.py:RetryAgent"  # file.py:Class or package.module:Class
    kwargs: dict[str, Any] = field(default_factory=dict)  # the agent's constructor arguments
    max_total_tokens: int = 64  # prompt + all replies of one segment at most
    episode_timeout_s: float = 120.0  # an agent that runs longer fails the episode (AgentError)
    request_timeout_s: float = 120.0  # one request's generation
    max_n: int = 8  # choices per request
    max_request_bytes: int = 1 << 20
    # threads for synchronous agents (def run) per runner; null: the episodes a runner may play at once
    # (agentic.groups_in_flight x rollout.n), so none waits for a thread
    sync_threads: int | None = None

    def __post_init__(self) -> None:
        if self.sync_threads is not None and self.sync_threads < 1:
            raise ValueError(f"agent.sync_threads must be >= 1 or null, got {self.sync_threads}")
        if ":" not in self.path:
            raise ValueError(f"agent.path must be 'file.py:Class' or 'package.module:Class', got {self.path!r}")
        if self.max_total_tokens < 2 or self.episode_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("agent.max_total_tokens must be >= 2 and the timeouts > 0")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tiny_model": TinyModelConfig,
    "rollout": RolloutConfig,
    "actor": ActorConfig,
    "critic": CriticConfig,
    "reward_model": RewardModelConfig,
    "reward": RewardConfig,
    "trainer": TrainerConfig,
    "data": DataConfig,
    "algorithm": AlgorithmConfig,
    "warmstart": WarmStartConfig,
    "replay": ReplayConfig,
    "agent": AgentConfig,
    "env": EnvConfig,
    "agentic": AgenticConfig,
}


def _known(sections: Sequence[str]) -> None:
    bad = sorted(set(sections) - set(SECTIONS))
    if bad:
        raise ConfigError(f"no such config section(s) {bad}; known: {sorted(SECTIONS)}")


def register_schema(name: str, sections: Sequence[str]) -> None:
    """Store the defaults of ``sections`` in Hydra's ConfigStore as ``name``.

    A recipe YAML that starts with ``defaults: [<name>, base, _self_]`` then composes over every
    known key, so any of them can be overridden on the command line, and Hydra refuses an unknown
    one by name.
    """
    _known(sections)
    ConfigStore.instance().store(name=name, node={s: section_schema(SECTIONS[s]) for s in sections})


def load_config(cfg: DictConfig | Mapping, sections: Sequence[str]) -> DictConfig:
    """``cfg`` merged over the defaults of ``sections``, every value typed and checked; anything
    wrong raises ``ConfigError`` naming it. Hydra's own ``hydra``/``defaults`` nodes are dropped.
    Returns a resolved struct config."""
    _known(sections)
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
        merged[name] = merge_section(SECTIONS[name], given.get(name), name)
        to_section(SECTIONS[name], merged[name], name)  # the dataclass's own checks (ranges, choices)
    out = OmegaConf.create(merged)
    OmegaConf.set_struct(out, True)
    if "model" in sections and out.model.path is not None:
        try:
            out.model.path = resolve_model_path(out.model.path)  # a .gguf file or "smollm2": its HF directory
            ModelConfig(path=out.model.path).require_local_dir()
        except FileNotFoundError as exc:
            raise ConfigError(f"model.path: {exc}") from None
    if "reward" in sections and out.reward.model.path is not None:
        try:
            ModelConfig(path=out.reward.model.path).require_local_dir()
        except FileNotFoundError as exc:
            raise ConfigError(f"reward.model.path: {exc}") from None
    if {"trainer", "data"} <= set(sections):
        check_batch_split(out)
    return out


def to_worker_config(cfg: DictConfig) -> dict[str, Any]:
    """What the workers are built with: ``to_plain(cfg)``, every trained section's
    ``ppo_mini_batch_size`` turned from prompts into the global rows of one optimizer step
    (``mini_batch_rows``), and a decaying learning rate's null ``total_steps`` into the run's
    (``scheduled_steps``). The one place prompts become rows; the workers count rows."""
    config = to_plain(cfg)
    for role in TRAINED_SECTIONS:
        if role in config:
            section = config[role]
            if section.get("lr_scheduler", "constant") != "constant" and section.get("total_steps") is None:
                section["total_steps"] = scheduled_steps(config, role)
            section["ppo_mini_batch_size"] = mini_batch_rows(config, role)
    return config


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """A resolved plain-dict copy (what workers receive: cheap to pickle, no OmegaConf needed)."""
    return OmegaConf.to_container(cfg, resolve=True)
