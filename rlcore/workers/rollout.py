"""RolloutWorker: the rollout role as an SPMD worker, holding one generation engine per rank.

Config: ``model`` (``ModelConfig``: the checkpoint), ``rollout`` (``rlcore.engines.RolloutConfig``:
the engine, ``hf`` or ``vllm``, and its sampling defaults) and ``trainer.device``.

Per-call overrides through ``prompts.meta_info``: temperature, top_p, top_k, max_new_tokens, n,
do_sample, stop, stop_token_ids, ignore_eos; ``validate=True`` means greedy with n=1 unless do_sample / n are
given too; ``seed``, the call's sampling seed (the driver gives each prompt batch one, so a resumed run
samples what an uninterrupted one would; ranks and rows get seeds derived from it). See
``rlcore.engines.SamplingSettings.resolve``.

Multi-turn episodes: ``generate_episodes(tasks, runner)`` hands this rank's engine to an
``EpisodeRunner`` the driver built (``rlcore.agentic.EnvEpisodes`` plays registered envs). The
worker defines the interface and the agentic layer, above it, plugs in: the worker never imports
env code, the runner object travels to the ranks with the call.

Weights: ``sync_weights()`` (hybrid engine: an actor colocated in this process) pulls the actor's
full state dict in memory; ``update_weights(state_dict)`` takes it from the driver, typically as the
non-blocking future of the actor group's RANK_ZERO ``get_full_state_dict()``, which the single
controller hands to every rollout rank as one Ray object ref (the dict never passes the driver).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from rlcore.engines import Engine, RolloutConfig, SamplingSettings, build_engine, set_deterministic
from rlcore.engines.host_memory import keep_large_blocks, trim_heap
from rlcore.engines.layout import build_output, check_left_padded, pad_rollout
from rlcore.models.config import ModelConfig
from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, DispatchMode, Worker, register
from rlcore.single_controller.decorator import collect_dp_proto, resolve_dispatch_mode
from rlcore.typed_config import read_section
from rlcore.workers.config import worker_deterministic, worker_device, worker_keep_large_blocks, worker_release_memory

PROMPT_KEYS = ("input_ids", "attention_mask", "position_ids")


def _collect_generations(ctx, outputs: list[DataProto]) -> DataProto:
    """Concatenate the ranks' generations; their speed metrics become the group's: the step waits
    for the slowest rank, so ``gen_time_s`` is its time (``gen_time_s_min`` the fastest's: the gap is
    the imbalance); tokens are those of the real (unpadded) rows, ``tokens_per_s`` them over the
    slowest rank's time."""
    out = collect_dp_proto(ctx, outputs)
    times = [o.meta_info["rollout/gen_time_s"] for o in outputs]
    tokens = int(out.batch["response_mask"].sum())
    out.meta_info.update({
        "rollout/gen_time_s": max(times),
        "rollout/gen_time_s_min": min(times),
        "rollout/num_generated_tokens": tokens,
        "rollout/tokens_per_s": tokens / max(times) if max(times) > 0 else float("nan"),
    })
    return out


_collect_generations.concatenates_chunks = True  # a future of it can feed another group rank by rank
DP_COMPUTE_ROLLOUT = DispatchMode(
    resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).dispatch_fn, _collect_generations, "dp_compute_rollout"
)


def _collect_episodes(ctx, outputs: list[DataProto]) -> DataProto:
    """Multi-turn chunks differ in width (each rank's longest prompt and episode): pad them to the
    widest first (prompts on the left, responses on the right), then as ``_collect_generations``."""
    t_p = max(o.batch["prompts"].shape[1] for o in outputs)
    t_r = max(o.batch["responses"].shape[1] for o in outputs)
    out = _collect_generations(ctx, [pad_rollout(o, t_p, t_r, o.meta_info["pad_token_id"]) for o in outputs])
    out.meta_info.pop("pad_token_id")
    return out


DP_COMPUTE_EPISODES = DispatchMode(
    resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).dispatch_fn, _collect_episodes, "dp_compute_episodes"
)


class EpisodeRunner(Protocol):
    """Plays one episode per row of ``tasks`` on ``engine`` and returns them in the trajectory layout
    (``rlcore.engines.layout``), ``response_mask`` 1 on the policy's tokens only. Built by the driver
    and pickled to every rank with the call, so it must hold plain data (names, numbers)."""

    def run(self, engine: Engine, tokenizer: Any, tasks: DataProto, settings: SamplingSettings) -> DataProto: ...


class RolloutWorker(Worker):
    def __init__(self, config: Any) -> None:
        self.model_config = read_section(config, "model", ModelConfig)
        self.model_config.require_path()
        self.config = read_section(config, "rollout", RolloutConfig)
        self.device = str(worker_device(config))
        self.deterministic = worker_deterministic(config)
        self.release_memory = worker_release_memory(config)
        self._keep_large_blocks = worker_keep_large_blocks(config)
        self.engine: Engine | None = None
        self._tok = None  # the tokenizer episode runners encode with, loaded on first use

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        set_deterministic(self.deterministic, self.device)  # before vLLM is imported: it reads the env then
        if self._keep_large_blocks:  # the sampler's per-step blocks reused, not mapped and faulted in afresh
            keep_large_blocks()
        self.engine = build_engine(self.model_config, self.config, device=self.device, rank=self.rank)

    @register(dispatch_mode=DP_COMPUTE_ROLLOUT)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded prompts (input_ids, attention_mask, position_ids) -> prompts ++ responses.

        Output keys: prompts, responses, response_mask, input_ids, attention_mask, position_ids,
        rollout_log_probs, the input's non-tensor fields (repeated like the rows), and meta_info
        with the input's entries plus "temperature" (the one the log-probs refer to, 1.0 when
        greedy) and "top_k" / "top_p" when those filters are on, "rollout/gen_time_s", "rollout/tokens_per_s" and "rollout/num_generated_tokens":
        this rank's here, the whole group's once collected (see ``_collect_generations``).
        """
        engine = self._require_engine()
        if prompts.batch is None or any(k not in prompts.batch.keys() for k in PROMPT_KEYS):
            have = [] if prompts.batch is None else sorted(prompts.batch.keys())
            raise KeyError(f"generate_sequences needs batch keys {list(PROMPT_KEYS)}, got {have}")
        settings = SamplingSettings.resolve(self.config, prompts.meta_info)
        check_left_padded(prompts.batch["attention_mask"])
        rows = prompts.select(batch_keys=list(PROMPT_KEYS))
        if settings.n > 1:
            rows = rows.repeat(settings.n, interleave=True)
        start = time.perf_counter()
        gen = engine.generate(rows.batch["input_ids"], rows.batch["attention_mask"], rows.batch["position_ids"], settings)
        out = build_output(rows, gen, engine.pad_token_id, time.perf_counter() - start)
        if self.release_memory:  # the engine's cache is idle until the next call (the update runs in between)
            engine.release_idle_memory()
            trim_heap()
        # The temperature and top-k / top-p rollout_log_probs refer to (greedy ones are plain
        # softmax); the actor reads them from meta_info, so old_log_probs describe the same distribution.
        out.meta_info.update(settings.log_prob_meta())
        return out

    @register(dispatch_mode=DP_COMPUTE_EPISODES)
    def generate_episodes(self, tasks: DataProto, runner: EpisodeRunner) -> DataProto:
        """One episode per row, played by ``runner`` on this rank's engine; rows are split over the
        ranks like prompts and the runner goes to every rank. Sampling: the ``rollout`` section with
        ``tasks.meta_info`` overrides, one episode per row whatever ``rollout.n`` says (for a group of
        episodes of one task, repeat the row). The ranks' episodes are aligned in width when collected."""
        settings = SamplingSettings.resolve(self.config, {**tasks.meta_info, "n": 1})
        engine = self._require_engine()
        out = runner.run(engine, self._tokenizer(), tasks, settings)
        out.meta_info["pad_token_id"] = engine.pad_token_id  # for the collect, which aligns the ranks' widths
        return out

    def abandon(self) -> None:
        """A generation given up by a stopping run (``rlcore.single_controller.abandon``): the engine drops
        its unfinished requests. Not a group method: the worker's host calls it."""
        if getattr(self, "engine", None) is not None:
            self.engine.abandon()

    def _tokenizer(self):
        if self._tok is None:
            self._tok = AutoTokenizer.from_pretrained(self.model_config.path)
        return self._tok

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Hybrid engine: load the colocated actor's current weights, in memory."""
        actor = self.colocated_workers.get("actor")
        if actor is None:
            raise RuntimeError(
                "sync_weights needs an actor colocated in this process (build the group from "
                "create_colocated_worker_cls({'actor': ..., 'rollout': ...})); with separate pools, call "
                "rollout.update_weights(actor.get_full_state_dict.options(blocking=False)())"
            )
        start = time.perf_counter()
        state_dict = actor.full_weights_uncopied()  # collective over the actor's ranks; full on rank 0 only
        if self.world_size > 1:
            state_dict = broadcast_state_dict(state_dict, src=0)
        return self._load(state_dict, start)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release_weights(self) -> int:
        """With ``trainer.release_memory``: the engine lets its weights go until the next ``sync_weights`` /
        ``update_weights`` (``Engine.release_weights``). A recipe calls it just before an update that a
        full sync follows, with no generation between the two. Returns the bytes let go on this rank."""
        if not self.release_memory:
            return 0
        freed = self._require_engine().release_weights()
        if freed:
            trim_heap()  # the packed kernels' buffers lay in the heap
        return freed

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Separate pools: load a full state dict (HF parameter names) sent by the driver."""
        return self._load(state_dict, time.perf_counter())

    def _load(self, state_dict: Mapping[str, torch.Tensor], start: float) -> dict[str, float]:
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise TypeError(f"expected a non-empty state dict (name -> tensor), got {type(state_dict).__name__}")
        self._require_engine().load_weights(state_dict)
        if self.release_memory:  # the engine's repacked layers freed their old buffers
            trim_heap()
        return {"rollout/weight_sync_s": time.perf_counter() - start}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_checksums(self) -> dict[str, tuple[str, int, int]]:
        """This rank's engine's ``Engine.weight_checksums`` (the consistency check compares them with the actor's)."""
        return self._require_engine().weight_checksums()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe_log_probs(self, ids: list[int]) -> dict[str, Any] | None:
        """This rank's engine's ``Engine.probe_log_probs`` (the consistency check's end-to-end probe)."""
        return self._require_engine().probe_log_probs(ids)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("the rollout engine is not built yet: call init_model() first")
        return self.engine


def broadcast_state_dict(state_dict: Mapping[str, torch.Tensor], src: int = 0) -> dict[str, torch.Tensor]:
    """Every rank of the default process group gets rank ``src``'s state dict (others pass anything).

    The hybrid engine needs the full weights on every rank, while an FSDP full state dict with CPU
    offload lands on rank 0 only. Names, shapes and dtypes go first as one object, then each tensor
    with a plain broadcast (on the GPU under NCCL).
    """
    is_src = dist.get_rank() == src
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in state_dict.items()] if is_src else None]
    dist.broadcast_object_list(meta, src=src)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for name, shape, dtype in meta[0]:
        tensor = state_dict[name].to(device) if is_src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src)
        out[name] = tensor
    return out
