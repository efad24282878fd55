"""Build what a recipe runs on from its config: the worker groups and the prompt data.

Worker groups. Every role a recipe asks for (actor, ref, rollout, critic, rm: a learned reward
model, see ``rm_is_trained``) lives in one process per rank: the "hybrid engine", where the rollout engine loads the actor's new weights in memory
(``rollout.sync_weights()``) and the roles take turns on the same device. One colocated group is
built, then ``spawn`` gives a per-role view of it, so a recipe calls ``workers.actor.update_policy``
and never sees role prefixes. ``trainer.backend`` picks where the ranks live:

- ``ray``: a ``RayResourcePool`` of ``trainer.nnodes x trainer.procs_per_node`` bundles (each
  ``trainer.cpus_per_proc`` CPUs, plus one GPU with ``trainer.device=cuda``), one Ray actor per rank.
  The cluster is the one at ``trainer.ray_address`` (or ``RAY_ADDRESS``), else a local Ray instance
  this run starts (``trainer.ray_num_cpus`` CPUs). A given address must accept a TCP connection
  within ``trainer.ray_connect_timeout_s``: ``ray.init`` itself retries a dead one for ever.
- ``local``: one rank in this process (notebooks, debugging, machines without Ray), with
  ``trainer.cpus_per_proc`` torch threads, as a Ray rank would have.

Every worker receives the whole (plain) recipe config and reads the sections it owns, with one
normalisation: ``ppo_mini_batch_size`` arrives as global rows, not prompts (verl's workers normalise
theirs the same way).

Data. ``data.train_files`` / ``data.val_files`` name prompt files (jsonl/parquet with the prompt,
answer and data_source columns); left null, the synthetic arithmetic task of ``data.arithmetic`` is
written under ``<trainer.output_dir>/data/`` once and reused. ``data.source`` instead streams prompts
produced on the fly (rlcore.data.sources: a generator, reasoning-gym, verifiers), each source's own
verifier bound as the reward of its rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlcore import single_controller
from rlcore.data.arithmetic import make_split, write_jsonl
from rlcore.data.dataset import PromptDataset, PromptLoader, collate_prompts
from rlcore.data.sources import (
    VAL_SEED_OFFSET,
    RowEncoder,
    RowStream,
    SourceLoader,
    check_first_rows,
    collate_items,
    validation_items,
)
from rlcore.data.word_problems import ROW_LAYOUT, make_word_problems
from rlcore.protocol import DataProto
from rlcore.rewards.registry import bind_source_reward, reward_fn_for_source
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, WorkerGroup, create_colocated_worker_cls
from rlcore.trainer.choices import resolve_choices
from rlcore.trainer.config import ConfigError, to_worker_config
from rlcore.trainer.preflight import preflight
from rlcore.trainer.process_memory import MemoryWatch, start_run_watch
from rlcore.trainer.progress import phase
from rlcore.trainer.stop_signal import exit_during_startup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.reward_model import RewardModelWorker
from rlcore.workers.rollout import RolloutWorker

ROLES = ("actor", "ref", "critic", "rm", "rollout")  # also the order in which they are initialised
BACKENDS = ("ray", "local")
# Ray forwards every worker's output to the driver's console, interleaved with the per-step line:
# no per-load progress bars, no per-step vLLM info lines (warnings and errors still show).
WORKER_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


@dataclass
class Workers:
    """Per-role views of one colocated worker group (absent roles are None)."""

    group: WorkerGroup
    actor: WorkerGroup | None = None
    ref: WorkerGroup | None = None
    critic: WorkerGroup | None = None
    rollout: WorkerGroup | None = None
    rm: WorkerGroup | None = None  # a learned reward model: frozen scorer, or the reward-model recipe's trained one
    pool: Any = None  # the RayResourcePool of a Ray group
    roles: list[str] = field(default_factory=list)
    rm_trained: bool = False  # the rm role trains (recipes/reward_model.py), so it has checkpoints
    memory: MemoryWatch | None = None  # the run's memory watch, started by build_workers (reported by TrainingRun)

    @property
    def trained(self) -> dict[str, WorkerGroup]:
        """Roles with weights that change, hence with checkpoints: actor and critic (and a trained rm)."""
        trained = ("actor", "critic", "rm") if self.rm_trained else ("actor", "critic")
        return {r: getattr(self, r) for r in trained if getattr(self, r) is not None}

    def shutdown(self) -> None:
        self.group.shutdown()
        if self.pool is not None:
            self.pool.shutdown()
        if self.memory is not None:  # stopped with the group at the latest (workers used without a TrainingRun)
            self.memory.stop()


def rm_is_trained(config: Mapping) -> bool:
    """Whether a run's "rm" role is the reward model it trains: in a run with the ``reward_model``
    section (its optimisation, ``recipes/reward_model.py``) it starts from ``model.path`` and trains;
    in any other run it is the frozen scorer of ``reward.model.path``."""
    return "reward_model" in config


def _role_class(role: str, config: dict, classes: Mapping[str, type]) -> ClassWithInitArgs:
    if role in classes:
        return ClassWithInitArgs(classes[role], config)
    if role in ("actor", "ref"):
        return ClassWithInitArgs(ActorWorker, config, role=role)
    if role == "rm":
        return ClassWithInitArgs(RewardModelWorker, config, trainable=rm_is_trained(config))
    return ClassWithInitArgs({"critic": CriticWorker, "rollout": RolloutWorker}[role], config)


def init_ray(cfg: DictConfig) -> None:
    """Connect to the cluster of ``trainer.ray_address`` / ``RAY_ADDRESS`` once it is known to answer,
    or start a local Ray instance; nothing when this process is already connected."""
    import ray  # optional dependency: trainer.backend=local runs without it (the GPU check machine has none)

    if ray.is_initialized():
        return
    quiet_token_notice()
    t = cfg.trainer
    address = t.ray_address or os.environ.get("RAY_ADDRESS")
    options = {"include_dashboard": False, "configure_logging": False,
               "runtime_env": {"env_vars": WORKER_ENV}}  # set before any import in the worker processes
    if address and address != "local":
        source = "trainer.ray_address" if t.ray_address else "the RAY_ADDRESS environment variable"
        check_reachable(address, t.ray_connect_timeout_s, source)
        ray.init(address=address, **options)
    else:
        loopback_only_ray()
        # "local", not None: with None, ray.init attaches to whatever cluster last wrote
        # /tmp/ray/ray_current_cluster on this machine (a `ray start`, another program's test cluster)
        ray.init(address="local", num_cpus=t.ray_num_cpus, _system_config={**worker_priority(), **NO_PRESTART},
                 **options)
    exit_during_startup()  # Ray's own SIGTERM handler exits with 15; the run's loop installs its own later
    phase(f"Ray ready ({'cluster at ' + address if address and address != 'local' else 'a local instance'}); "
          "starting the worker processes")


RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_TOKEN_NOTICE)


def quiet_token_notice() -> None:
    """Drop Ray's "Token authentication is enabled for this Ray cluster ..." warning, which every
    ``ray.init`` of a local instance logs: it reports Ray's default (token auth on), asks nothing of the
    user, and is the only Ray line of a run's start-up. A filter on the logger that emits it, so that
    Ray's other warnings (its "Token authentication is disabled" one among them) still show."""
    logger = logging.getLogger(RAY_TOKEN_LOGGER)
    if not any(isinstance(f, _DropTokenNotice) for f in logger.filters):
        logger.addFilter(_DropTokenNotice())


RAY_NICENESS_ENV = "RAY_worker_niceness"


# Ray starts one idle Python worker per CPU for a local instance's first driver, without the job's runtime_env;
# a run's workers are actors that need it (WORKER_ENV above), so Ray starts theirs afresh and the prestarted
# ones idle to the end: 2 processes of ~84 MB RSS and ~1 s of CPU at every start on 2 cores, for nothing.
NO_PRESTART = {"prestart_worker_first_driver": False}


def worker_priority() -> dict:
    """Ray starts its worker processes at nice 15, below the driver and its own daemons; a run's workers
    are where its compute happens, so the Ray instance a run starts gives them the driver's priority.
    At 15 they got a few percent of the CPU whenever anything else ran: 0.3 s of work in a worker took
    12.2 s next to three busy processes on 2 cores, 0.95 s at nice 0 (its fair share). The user's own
    RAY_worker_niceness wins."""
    return {} if RAY_NICENESS_ENV in os.environ else {"worker_niceness": 0}


LOOPBACK_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only_ray() -> None:
    """Have the Ray instance this process starts listen on loopback only: a local run serves nobody
    else, and Ray's metrics endpoints are unauthenticated HTTP. Ray binds its servers (GCS, raylet,
    workers, agents, metrics) to the node address, and ``ray.init`` refuses 127.0.0.1 as one unless
    clusters are off, its single-machine mode (the default on macOS and Windows). Setting
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 keeps Ray's own choice (e.g. to let other machines join)."""
    import ray._private.ray_constants as ray_constants  # read at import: set here too if ray came first

    os.environ.setdefault(LOOPBACK_RAY_ENV, "0")
    if os.environ[LOOPBACK_RAY_ENV].lower() in ("0", "false"):
        ray_constants.ENABLE_RAY_CLUSTER = False


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS frame
HTTP2_SETTINGS = 4


def check_reachable(address: str, timeout_s: float, source: str) -> None:
    """Fail unless ``[scheme://]host:port`` answers like a Ray head within ``timeout_s``: it accepts a
    TCP connection, and its GCS (a gRPC server) answers an HTTP/2 preface with a SETTINGS frame. A
    listener that accepts and never speaks (a frozen head, another service, a firewall completing
    handshakes) would otherwise make ``ray.init`` retry for ever, deaf to SIGTERM. An address
    without a port ("auto") and a ``ray://`` client address (another protocol) get the TCP check or
    none, and are left to Ray."""
    scheme, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            if scheme in ("", "gcs"):
                sock.settimeout(timeout_s)
                sock.sendall(HTTP2_PREFACE)
                frame = sock.recv(9)
                if len(frame) < 4 or frame[3] != HTTP2_SETTINGS:
                    raise OSError(f"it answered {frame[:16]!r}, not as a gRPC server")
    except socket.timeout:
        raise ConnectionError(f"{address} (from {source}) accepts connections but did not answer as a Ray head "
                              f"within {timeout_s:g}s (trainer.ray_connect_timeout_s): not a Ray head, or a frozen "
                              "one. Check the address, or unset it to run a local instance") from None
    except OSError as exc:
        raise ConnectionError(f"no Ray cluster answers at {address} (from {source}) within {timeout_s:g}s: {exc}. "
                              "Start it (ray start --head) or unset the address to run a local instance") from None


def resolve_device(name: str) -> str:
    if name not in ("cpu", "cuda", "auto"):
        raise ConfigError(f"trainer.device must be 'cpu', 'cuda' or 'auto', got {name!r}")
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def build_workers(cfg: DictConfig, roles: Sequence[str], classes: Mapping[str, type] | None = None) -> Workers:
    """The colocated worker group of ``roles``, split per role, models initialised.

    ``classes`` replaces the worker class of a role (e.g. an actor subclass with an extra method).
    """
    bad = [r for r in roles if r not in ROLES]
    if bad or not {"actor", "rm"} & set(roles):
        raise ValueError(f"roles must include 'actor' (or 'rm', to train a reward model) and come from {ROLES}, "
                         f"got {list(roles)}")
    preflight(cfg)  # every path, file and folder the run names, before any process or engine starts
    exit_during_startup()  # SIGTERM now: exit 143 with a message (the run's loop takes over once it starts)
    watch = start_run_watch(cfg.trainer.memory_watch_s)  # the run's processes' memory, from before the first one starts
    try:
        return _started_workers(cfg, roles, classes, watch)
    except BaseException:
        if watch is not None:
            watch.stop()  # no run will report it
        raise


def _started_workers(cfg: DictConfig, roles: Sequence[str], classes: Mapping[str, type] | None,
                     watch: MemoryWatch | None) -> Workers:
    config = _worker_config(cfg)
    # A LoRA actor is its own reference (adapters off, rlcore.workers.lora): no second copy of the weights.
    lora_ref = ("ref" in roles and "ref" not in (classes or {})
                and OmegaConf.select(cfg, "actor.lora.rank", default=0) > 0)
    built = [r for r in roles if not (lora_ref and r == "ref")]
    colocated = create_colocated_worker_cls({r: _role_class(r, config, classes or {}) for r in built})
    t = cfg.trainer
    phase(f"starting workers: {', '.join(built)} (trainer.backend={t.backend}, {t.nnodes * t.procs_per_node} rank(s))")
    group, pool = _placed_group(cfg, colocated)
    views = group.spawn(built)
    for view in [group, *views.values()]:  # methods registered balance=True split by token count, or not
        view.balance_dp = cfg.trainer.balance_batch
    if lora_ref:
        views["ref"] = views["actor"]
    workers = Workers(group=group, pool=pool, roles=built, rm_trained=rm_is_trained(config), memory=watch, **views)
    for role in ROLES:  # the actor first: it joins torch.distributed, which the others then share
        if role in built:
            phase(_loading(cfg, role))
            views[role].init_model()
    phase("workers ready")
    return workers


def _loading(cfg: DictConfig, role: str) -> str:
    """The progress line of a role's model load (a vLLM engine's is the slow one)."""
    if role == "rollout":
        backend = cfg.rollout.backend
        return f"loading the rollout engine ({backend}{': about a minute on CPU' if backend == 'vllm' else ''})"
    return f"loading the {role} model"


def build_rollout_group(cfg: DictConfig) -> Workers:
    """A rollout group of its own beside the trainer's, for asynchronous recipes: its engine
    generates the next batches while the trainer's group updates. The same placement keys as
    ``build_workers`` (a Ray pool of its own, or this process with ``trainer.backend=local``);
    weights reach it through ``update_weights``, never in memory."""
    group, pool = _placed_group(cfg, _role_class("rollout", _worker_config(cfg), {}), suffix="_rollout")
    phase(_loading(cfg, "rollout") + " in a group of its own")
    group.init_model()
    return Workers(group=group, pool=pool, roles=["rollout"], rollout=group)


def _worker_config(cfg: DictConfig) -> dict:
    """The plain config the workers are built with, the machine's choices made (``resolve_choices``)
    and each ``ppo_mini_batch_size`` in rows (prompts x ``rollout.n``: ``to_worker_config``)."""
    resolve_device(cfg.trainer.device)  # a bad name is refused before anything is decided
    resolve_choices(cfg)  # device, training and sampling dtypes: decided here, recorded in the run's config
    return to_worker_config(cfg)


def _placed_group(cfg: DictConfig, worker: Any, suffix: str = "") -> tuple[WorkerGroup, Any]:
    """``worker`` as a group placed by the ``trainer`` keys, and its Ray pool (None in-process):
    this process with ``backend=local`` (one rank), else a Ray pool of its own of ``nnodes`` x
    ``procs_per_node`` ranks of ``cpus_per_proc`` CPUs (named with ``suffix``)."""
    t = cfg.trainer
    if t.backend not in BACKENDS:
        raise ConfigError(f"trainer.backend must be one of {BACKENDS}, got {t.backend!r}")
    if t.backend == "local":
        if t.nnodes * t.procs_per_node != 1:
            raise ConfigError("trainer.backend=local runs one rank in this process: set trainer.nnodes=1 and "
                             "trainer.procs_per_node=1, or use trainer.backend=ray for more ranks")
        # As many threads as a Ray rank would get. torch._C's builtin, because a vLLM CPU engine started
        # earlier in this process replaces torch.set_num_threads with a no-op that only logs a warning.
        torch._C.set_num_threads(max(1, int(t.cpus_per_proc)))
        for key, value in WORKER_ENV.items():  # what a Ray worker gets; a value the user set wins
            os.environ.setdefault(key, value)
        return LocalWorkerGroup(worker), None
    init_ray(cfg)
    # single_controller's Ray classes are looked up on use, so Ray is imported only when a Ray group is built
    pool = single_controller.RayResourcePool(
        [t.procs_per_node] * t.nnodes, use_gpu=resolve_device(t.device) == "cuda",
        num_cpus_per_process=t.cpus_per_proc, name_prefix=f"{t.project}_{t.run_name}{suffix}")
    return single_controller.RayWorkerGroup(pool, worker, name_prefix=f"{t.project}{suffix}"), pool


# ----------------------------------------------------------------------------- data
def _generated_files(cfg: DictConfig) -> tuple[str, str]:
    """The train/val split of the generated task ``data.task`` (its ``data.arithmetic`` or
    ``data.word_problems`` settings), written once per setting under ``<trainer.output_dir>/data/``."""
    task = cfg.data.task
    spec = OmegaConf.to_container(cfg.data.arithmetic if task == "arithmetic" else cfg.data.word_problems)
    if task != "arithmetic":
        spec["columns"] = ROW_LAYOUT  # a cache written in an older row layout is rewritten
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    folder = Path(cfg.trainer.output_dir) / "data" / f"{task}-{key}"
    train, val = folder / "train.jsonl", folder / "val.jsonl"
    if not (train.exists() and val.exists()):
        if task == "arithmetic":
            rows_train, rows_val = make_split(spec["n_train"], spec["n_val"], spec["seed"],
                                              max_operand=spec["max_operand"], ops=spec["ops"])
        else:
            rows = make_word_problems(task, spec["n_train"] + spec["n_val"], spec["seed"])
            rows_train, rows_val = rows[:spec["n_train"]], rows[spec["n_train"]:]
        write_jsonl(train, rows_train)
        write_jsonl(val, rows_val)
    return str(train), str(val)


def data_files(cfg: DictConfig) -> tuple[Any, Any]:
    """(train files, val files) of a config: the given ones, or the generated task's (``data.task``)."""
    d = cfg.data
    if d.train_files is None:
        if d.val_files is not None:
            raise ConfigError("data.val_files is set but data.train_files is not: give both, or neither for the "
                             "generated task of data.task")
        return _generated_files(cfg)
    if d.val_files is None:
        raise ConfigError("data.val_files is required when data.train_files is set")
    return _listed(d.train_files), _listed(d.val_files)


def _listed(files: Any) -> str | list[str]:
    return files if isinstance(files, str) else [str(f) for f in files]


def _dataset(cfg: DictConfig, files: Any, tokenizer: Any) -> PromptDataset:
    d = cfg.data
    extra = ("data_source",) + ((d.response_key,) if d.get("response_key") else ())
    reward = cfg.get("reward") or {}
    extra += tuple(k for k in reward.get("extra_keys") or () if k not in extra)  # columns the reward reads
    return PromptDataset(files, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key, extra_keys=extra,
                         max_prompt_length=d.max_prompt_length, apply_chat_template=d.apply_chat_template)


def prompts_to_proto(tensors: dict, non_tensors: dict, meta_info: dict | None = None) -> DataProto:
    """A collated prompt batch as a DataProto, with ``uid`` (the row number) naming each prompt,
    which the n samples of a prompt share after the rollout."""
    n = len(tensors["input_ids"])
    uid = np.array([str(i) for i in range(n)], dtype=object)
    return DataProto.from_dict(tensors, {**non_tensors, "uid": uid}, meta_info or {})


def build_data(cfg: DictConfig, tokenizer: Any) -> tuple[PromptLoader, list[DataProto]]:
    """The resumable training loader (endless; the run length is ``trainer.total_steps``) and the
    validation prompts as DataProto batches marked for greedy decoding."""
    d = cfg.data
    if d.get("source") is not None:
        return _source_data(cfg, tokenizer)
    train_files, val_files = data_files(cfg)
    phase(f"loading data (data.apply_chat_template={d.apply_chat_template})")
    train = _dataset(cfg, train_files, tokenizer)
    loader = PromptLoader(train, d.train_batch_size, shuffle=d.shuffle, seed=d.seed)
    val = _dataset(cfg, val_files, tokenizer)
    phase(f"data: train {train.describe()}; validation {val.describe()}")
    return loader, _val_batches(cfg, [val[i] for i in range(len(val))], loader.pad_token_id, collate_prompts)


def _val_batches(cfg: DictConfig, items: list, pad_token_id: int, collate: Any) -> list[DataProto]:
    """Validation items as DataProto batches of ``data.val_batch_size`` (all at once by default), marked greedy."""
    size = cfg.data.val_batch_size or len(items)
    return [prompts_to_proto(*collate(items[start:start + size], pad_token_id), {"validate": True})
            for start in range(0, len(items), size)]


def _source_data(cfg: DictConfig, tokenizer: Any) -> tuple[SourceLoader, list[DataProto]]:
    """``build_data`` for ``data.source`` (rlcore.data.sources): validation's rows first (held out), then
    the training stream, which skips them. The source's own reward is bound to its data_source, where the
    reward manager looks a row's function up (``reward.reward_fn`` / ``reward_fn_by_source`` still win)."""
    d = cfg.data
    if d.get("response_key"):
        raise ConfigError("data.response_key names a column of data files; a source's rows have prompt and answer "
                         "only (SFT on a source trains on the answer): unset it, or write the rows to a file")
    kwargs = OmegaConf.to_container(d.source_kwargs, resolve=True) if d.source_kwargs else {}
    val_seed = d.source_val_seed if d.source_val_seed is not None else d.seed + VAL_SEED_OFFSET
    phase(f"opening data.source={d.source} (train seed {d.seed}, validation seed {val_seed})")
    train, val = RowStream(d.source, kwargs, d.seed, "train"), RowStream(d.source, kwargs, val_seed, "val")
    encode = RowEncoder(tokenizer, d.max_prompt_length, d.apply_chat_template, train.reward is not None)
    val_items, held_out = validation_items(val, encode, d.source_val_size)
    check_first_rows(d.source, kwargs, d.seed, d.train_batch_size, encode)
    loader = SourceLoader(train, encode, d.train_batch_size, tokenizer.pad_token_id, held_out)
    if train.reward is not None:
        bind_source_reward(train.data_source, train.reward)
    elif cfg.get("reward") is not None and cfg.reward.get("reward_fn") is None \
            and train.data_source not in (cfg.reward.get("reward_fn_by_source") or {}) \
            and reward_fn_for_source(train.data_source) is None:
        raise ConfigError(f"data.source={d.source} brings no reward and its rows' data_source {train.data_source!r} has "
                         "no registered function: return a rlcore.data.sources.PromptSource with reward=..., or set "
                         "reward.reward_fn")
    phase(f"data: a stream from data.source={d.source} (data_source {train.data_source!r}, "
          f"{'its own reward' if train.reward is not None else 'the registered reward'}); "
          f"validation {len(val_items)} held-out rows")
    return loader, _val_batches(cfg, val_items, loader.pad_token_id, collate_items)
