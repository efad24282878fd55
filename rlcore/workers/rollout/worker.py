"""RolloutWorker: the rollout role as an SPMD worker; the backend (HF or vLLM) is a config choice.

Config (a dict or OmegaConf config with these two sections; an unknown key in them is an error,
other sections are ignored so that a recipe can hand over its whole config)::

    model:
      path: str                  required; Hugging Face checkpoint directory (weights + tokenizer)
      dtype: "float32"           dtype of the HF backend's weights (float32 | bfloat16 | float16)
      gradient_checkpointing     training only (shared model section); ignored by the rollout
      mixed_precision            training only (shared model section); ignored by the rollout
    trainer:
      device: "auto"             device of the HF backend (auto: cuda if available); vLLM picks its own
    rollout:
      backend: "hf"              "hf" (transformers generate) or "vllm" (a vLLM engine in this process)
      temperature: 1.0           sampling temperature; 0 means greedy
      top_p: 1.0                 nucleus filter, in (0, 1]; 1 disables it
      top_k: 0                   keep the k most likely tokens; 0 (or -1) disables it
      max_new_tokens: 64         response length T_r: responses are right-padded to exactly this
      n: 1                       samples per prompt; the n rows of one prompt are adjacent
      do_sample: true            false: greedy decoding
      stop: []                   stop strings (checked on the generated text; their tokens are kept)
      stop_token_ids: []         extra token ids that end a response (eos does too, unless ignore_eos)
      ignore_eos: false          true: eos does not end a response (fixed-length rollouts, benchmarks)
      dtype: null                weights dtype of the rollout engine; null: model.dtype for hf,
                                 "bfloat16" for vllm (on 2 CPU cores bf16 is ~2x faster than fp32)
      gpu_memory_utilization: 0.1   vllm: fraction of device memory (on CPU: of RAM) for the KV cache
      kv_cache_memory_bytes: null   vllm: KV cache size in bytes; overrides gpu_memory_utilization
      max_model_len: null        vllm: longest prompt + response; null: the model's max positions
      enforce_eager: true        vllm: no CUDA graphs / compilation (fast start; what works on CPU)
      seed: 0                    sampling seed; rank r uses seed + r

Per-call overrides through ``prompts.meta_info``: temperature, top_p, top_k, max_new_tokens, n,
do_sample, stop, stop_token_ids, ignore_eos; ``validate=True`` means greedy with n=1 unless do_sample / n are
given too. See ``base.SamplingSettings.resolve``.

Weights: ``sync_weights()`` (hybrid engine: an actor colocated in this process) pulls the actor's
full state dict in memory; ``update_weights(state_dict)`` takes it from the driver, typically as the
non-blocking future of the actor group's RANK_ZERO ``get_full_state_dict()``, which the single
controller hands to every rollout rank as one Ray object ref (the dict never passes the driver).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

import torch

from rlcore.protocol import DataProto
from rlcore.single_controller import Dispatch, DispatchMode, Worker, register
from rlcore.single_controller.decorator import collect_dp_proto, resolve_dispatch_mode
from rlcore.workers.rollout.base import RolloutBackend, SamplingSettings, build_output, check_left_padded, parse_config

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
    from rlcore.agentic.replay_buffer import pad_rollout

    t_p = max(o.batch["prompts"].shape[1] for o in outputs)
    t_r = max(o.batch["responses"].shape[1] for o in outputs)
    out = _collect_generations(ctx, [pad_rollout(o, t_p, t_r, o.meta_info["pad_token_id"]) for o in outputs])
    out.meta_info.pop("pad_token_id")
    return out


DP_COMPUTE_EPISODES = DispatchMode(
    resolve_dispatch_mode(Dispatch.DP_COMPUTE_PROTO).dispatch_fn, _collect_episodes, "dp_compute_episodes"
)


class RolloutWorker(Worker):
    def __init__(self, config: Any) -> None:
        self.model_config, self.config = parse_config(config)
        self.backend: RolloutBackend | None = None
        self._tok = None  # the tokenizer environments encode with, loaded on first use

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        if self.config.backend == "hf":
            from rlcore.workers.rollout.hf_rollout import HFRollout

            self.backend = HFRollout(self.model_config, self.config, rank=self.rank)
        else:
            from rlcore.workers.rollout.vllm_rollout import VLLMRollout

            self.backend = VLLMRollout(self.model_config, self.config, rank=self.rank)

    @register(dispatch_mode=DP_COMPUTE_ROLLOUT)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Left-padded prompts (input_ids, attention_mask, position_ids) -> prompts ++ responses.

        Output keys: prompts, responses, response_mask, input_ids, attention_mask, position_ids,
        rollout_log_probs, the input's non-tensor fields (repeated like the rows), and meta_info
        with the input's entries plus "temperature" (the one the log-probs refer to, 1.0 when
        greedy), "rollout/gen_time_s", "rollout/tokens_per_s" and "rollout/num_generated_tokens":
        this rank's here, the whole group's once collected (see ``_collect_generations``).
        """
        backend = self._require_backend()
        if prompts.batch is None or any(k not in prompts.batch.keys() for k in PROMPT_KEYS):
            have = [] if prompts.batch is None else sorted(prompts.batch.keys())
            raise KeyError(f"generate_sequences needs batch keys {list(PROMPT_KEYS)}, got {have}")
        settings = SamplingSettings.resolve(self.config, prompts.meta_info)
        check_left_padded(prompts.batch["attention_mask"])
        rows = prompts.select(batch_keys=list(PROMPT_KEYS))
        if settings.n > 1:
            rows = rows.repeat(settings.n, interleave=True)
        start = time.perf_counter()
        gen = backend.generate(rows.batch["input_ids"], rows.batch["attention_mask"], rows.batch["position_ids"], settings)
        out = build_output(rows, gen, backend.pad_token_id, time.perf_counter() - start)
        # The temperature rollout_log_probs refer to (greedy ones are plain softmax); the actor's
        # compute_log_prob reads it from meta_info, so old_log_probs describe the same distribution.
        out.meta_info["temperature"] = 1.0 if settings.greedy else settings.temperature
        return out

    @register(dispatch_mode=DP_COMPUTE_EPISODES)
    def generate_multi_turn(self, tasks: DataProto) -> DataProto:
        """One episode per row against an environment, turn by turn, in token ids (``MultiTurnRollout``
        with this rank's engine); the rows are split over the ranks like prompts.

        Rows: non-tensor ``task`` (the ``env.reset`` keyword arguments, a dict) and optionally ``seed``;
        other non-tensor columns (e.g. ``uid``) are carried over. ``meta_info``: ``env`` (a registered
        name), ``env_kwargs`` (dict), ``max_turns``, ``max_total_tokens`` and any sampling override of
        ``generate_sequences``. One episode per row whatever ``rollout.n`` says: for a group of episodes
        of one task, repeat the row.
        Output: the single-turn layout, ``response_mask`` 1 only on the policy's tokens, the episode's
        reward on its last model token (``token_level_scores``), ``num_turns``, ``truncated``.
        """
        from rlcore.agentic import MultiTurnRollout, make_env

        meta = tasks.meta_info
        missing = [k for k in ("env", "max_turns", "max_total_tokens") if k not in meta]
        if missing:
            raise KeyError(f"generate_multi_turn needs meta_info {missing}")
        if "task" not in tasks.non_tensor_batch:
            raise KeyError("generate_multi_turn needs a non-tensor 'task' column (env.reset kwargs)")
        tokenizer = self._tokenizer()
        env_factory = functools.partial(make_env, meta["env"], tokenizer, **dict(meta.get("env_kwargs") or {}))
        rollout = MultiTurnRollout(self._require_backend(), tokenizer, env_factory, int(meta["max_turns"]),
                                   int(meta["max_total_tokens"]), SamplingSettings.resolve(self.config, {"n": 1, **meta}))
        columns = tasks.non_tensor_batch
        seeds = [int(s) for s in columns["seed"]] if "seed" in columns else None
        out = rollout.run([dict(t) for t in columns["task"]], seeds=seeds)
        for key, values in columns.items():
            out.non_tensor_batch.setdefault(key, values)
        out.meta_info["pad_token_id"] = rollout.pad_token_id  # for the collect, which aligns the ranks' widths
        return out

    def _tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

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
        state_dict = actor.get_full_state_dict()  # collective over the actor's ranks; full on rank 0 only
        if self.world_size > 1:
            state_dict = broadcast_state_dict(state_dict, src=0)
        return self._load(state_dict, start)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Separate pools: load a full state dict (HF parameter names) sent by the driver."""
        return self._load(state_dict, time.perf_counter())

    def _load(self, state_dict: Mapping[str, torch.Tensor], start: float) -> dict[str, float]:
        if not isinstance(state_dict, Mapping) or not state_dict:
            raise TypeError(f"expected a non-empty state dict (name -> tensor), got {type(state_dict).__name__}")
        self._require_backend().load_weights(state_dict)
        return {"rollout/weight_sync_s": time.perf_counter() - start}

    def _require_backend(self) -> RolloutBackend:
        if self.backend is None:
            raise RuntimeError("the rollout engine is not built yet: call init_model() first")
        return self.backend


def broadcast_state_dict(state_dict: Mapping[str, torch.Tensor], src: int = 0) -> dict[str, torch.Tensor]:
    """Every rank of the default process group gets rank ``src``'s state dict (others pass anything).

    The hybrid engine needs the full weights on every rank, while an FSDP full state dict with CPU
    offload lands on rank 0 only. Names, shapes and dtypes go first as one object, then each tensor
    with a plain broadcast (on the GPU under NCCL).
    """
    import torch.distributed as dist

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
