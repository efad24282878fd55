"""What the generation engines share: the ``rollout`` config, per-call sampling settings, the
``Generation`` an engine returns, and the engine interface.

An engine (``HFEngine``, ``VLLMEngine``) only turns prompt token ids into response token ids and
the sampler's log-probs of those tokens (a ``Generation``). Everything a trainer relies on (shapes,
padding, masks, positions, metrics) is built once in ``rlcore.engines.layout``, so both engines
hand the trainer byte-for-byte the same layout.

Stopping rule, identical for both engines: a response ends at (and includes) the first token in
``{eos} | stop_token_ids`` (eos left out with ``ignore_eos``), or at the token that completes one
of the ``stop`` strings (matched on the generated text only), or after ``max_new_tokens`` tokens.
The tokens of a stop string stay in the response (the policy generated them); only the text of
vLLM's ``CompletionOutput`` would hide it, and we never use text.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlcore.models.config import torch_dtype

BACKENDS = ("hf", "vllm")
CPU_WEIGHT_LAYOUTS = ("auto", "packed", "plain")  # rollout.cpu_weight_layout (rlcore.engines.vllm_worker)


@dataclass(frozen=True)
class RolloutConfig:
    """The ``rollout`` section: which engine samples, and how (per-call overrides: ``SamplingSettings``)."""

    backend: str = "hf"  # "hf" (transformers generate) or "vllm" (a vLLM engine in the rollout's process)
    temperature: float = 1.0  # sampling temperature; 0 means greedy
    top_p: float = 1.0  # nucleus filter, in (0, 1]; 1 disables it
    top_k: int = 0  # keep the k most likely tokens; 0 (or -1) disables it
    max_new_tokens: int = 64  # response length T_r: responses are right-padded to exactly this
    n: int = 1  # samples per prompt; the n rows of one prompt are adjacent
    do_sample: bool = True  # false: greedy decoding
    stop: list[str] = field(default_factory=list)  # stop strings (matched on the generated text; their tokens are kept)
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end a response (eos does too)
    ignore_eos: bool = False  # true: eos does not end a response (fixed-length rollouts, benchmarks)
    dtype: str | None = None  # engine weights; null: model.dtype for hf; for vllm bfloat16 where native, else float32 (dtype_choice)
    gpu_memory_utilization: float = 0.1  # vllm: fraction of device memory (on CPU: of RAM) for the KV cache
    kv_cache_memory_bytes: int | None = None  # vllm: KV cache size in bytes; overrides gpu_memory_utilization
    # vllm: KV cache size in tokens (bytes from the model's shape and the engine's dtype: kv_cache_bytes);
    # overrides both above. Size it to the batch the engine serves: a row takes whole blocks (rollout.block_size)
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None  # vllm: longest prompt + response; null: the model's max positions
    enforce_eager: bool = True  # vllm: no CUDA graphs / compilation (fast start; what works on CPU)
    seed: int = 0  # seed of the engine's own stream (rank r: seed + r), for calls that bring no seed of their own
    # vllm, CPU build: how matmul layers keep their weights across weight updates. "packed": vLLM's
    # kernels, packed again on every update (~3x a plain copy); "plain": torch's matmul on the plain
    # weight (an update is a copy); "auto": per layer shape, plain where that measured at most 5%
    # slower at the batch the engine decodes (rlcore.engines.vllm_worker.InPlacePlan)
    cpu_weight_layout: str = "auto"
    record_routing: bool = False  # MoE: return routed_experts (B, T, layers, k), the experts chosen at sampling (router replay)
    # the most requests decoded at once: vLLM's max_num_seqs, the async HF engine's running batch;
    # null: each engine's default (vLLM's own, 128 on CPU; the async HF engine 256)
    max_num_seqs: int | None = None
    prefix_cache_bytes: int = 256 << 20  # async HF engine: per-session KV kept for a session's next turn; 0: off
    # HF engine: the rows of one prompt (its n samples) share the prompt's prefill, each distinct prompt computed
    # once and its KV copied to the rows (rlcore.engines.shared_prompt); false: every row prefills its own copy
    share_prompt: bool = True
    # vllm: KV block size in tokens, the granule of its prefix cache (which shares whole blocks only); null: 32 on
    # CPU (its attention kernel's smallest: a group's rows share their prompt's first 32 tokens, where vLLM's
    # CPU default of 128 never fills with a ~47-token chat prompt; benchmarks/shared_prompt.py), vLLM's default elsewhere
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"rollout.backend must be one of {BACKENDS}, got {self.backend!r}")
        _str_tuple(self.stop, "rollout.stop")
        if self.dtype is not None:
            torch_dtype(self.dtype, "rollout.dtype")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_weight_layout not in CPU_WEIGHT_LAYOUTS:
            raise ValueError(f"rollout.cpu_weight_layout must be one of {CPU_WEIGHT_LAYOUTS}, "
                             f"got {self.cpu_weight_layout!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"rollout.kv_cache_tokens must be >= 1 (or null: kv_cache_memory_bytes / "
                             f"gpu_memory_utilization decide), got {self.kv_cache_tokens}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"rollout.max_num_seqs must be >= 1 (or null: the engine's default), got {self.max_num_seqs}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"rollout.block_size must be >= 1 (or null: 32 on CPU, vLLM's default elsewhere), "
                             f"got {self.block_size}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"rollout.prefix_cache_bytes must be >= 0 (0: off), got {self.prefix_cache_bytes}")
        SamplingSettings.from_config(self)  # validates the sampling keys

    def vllm_overrides(self) -> dict:
        """The vLLM engine arguments this section sets only when given (null: vLLM's own default, but for
        ``block_size`` on CPU: ``rlcore.engines.kv_cache_size.vllm_overrides``)."""
        keys = ("kv_cache_memory_bytes", "max_num_seqs", "block_size")
        return {key: getattr(self, key) for key in keys if getattr(self, key) is not None}


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling parameters of one ``generate_sequences`` call (config defaults + meta_info overrides)."""

    temperature: float
    top_p: float
    top_k: int  # 0: no top-k filter
    max_new_tokens: int
    n: int
    do_sample: bool
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # also return the k most likely tokens at each step, with their log-probs
    # this call's sampling seed (meta_info "seed"; the driver derives one per prompt batch): the engine
    # samples from it instead of its running stream (rlcore.engines.seeding); None: the stream
    seed: int | None = None

    OVERRIDABLE = ("temperature", "top_p", "top_k", "max_new_tokens", "n", "do_sample", "stop", "stop_token_ids",
                   "ignore_eos")
    MAX_TOP_LOGPROBS = 20

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 / -1 to disable it, got {self.top_k}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.n <= 0:
            raise ValueError(f"n must be positive, got {self.n}")
        if not 0 <= self.top_logprobs <= self.MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {self.MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        object.__setattr__(self, "top_k", max(self.top_k, 0))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def log_prob_meta(self) -> dict[str, float | int]:
        """What the engines' log-probs refer to, for ``meta_info``: the temperature (1.0 when
        greedy: greedy log-probs are the raw softmax's) and, when they filter, ``top_k`` / ``top_p``.
        The actor reads these keys and scores the responses under the same distribution
        (``rlcore.algos.sampling``), so old log-probs and the sampler's are comparable."""
        if self.greedy:
            return {"temperature": 1.0}
        meta: dict[str, float | int] = {"temperature": self.temperature}
        if self.top_k > 0:
            meta["top_k"] = self.top_k
        if self.top_p < 1.0:
            meta["top_p"] = self.top_p
        return meta

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> "SamplingSettings":
        return cls.resolve(cfg, {})

    @classmethod
    def resolve(cls, cfg: RolloutConfig, meta_info: Mapping[str, Any]) -> "SamplingSettings":
        """Config defaults, then validation defaults, then explicit meta_info overrides.

        ``meta_info["validate"] = True`` means greedy decoding, one sample per prompt, unless the
        same meta_info sets ``do_sample`` / ``n`` itself (e.g. pass@k validation by sampling).
        ``meta_info["seed"]`` is the call's sampling seed; ``rollout.seed`` is not its default (that
        one seeds the engine's stream, used when no seed is given). Other meta_info keys are not ours
        and are ignored.
        """
        values = {k: getattr(cfg, k) for k in cls.OVERRIDABLE}
        if meta_info.get("validate", False):
            values.update(do_sample=False, n=1)
        for key in cls.OVERRIDABLE:
            if key in meta_info:
                values[key] = _typed_override(key, meta_info[key])
        values["stop"] = _str_tuple(values["stop"], "stop")
        values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
        seed = meta_info.get("seed")
        return cls(**values, seed=None if seed is None else int(seed))


_OVERRIDE_TYPES = {"temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int, "n": int,
                   "do_sample": bool, "ignore_eos": bool}


def _typed_override(key: str, value: Any) -> Any:
    """A meta_info sampling override as its field's type, or a TypeError naming it. Why: meta_info is
    a plain dict a driver fills in by hand, and ``do_sample="no"`` would otherwise be a truthy
    string that samples, ``n="2"`` a string that fails deep inside an engine."""
    kind = _OVERRIDE_TYPES.get(key)
    if kind is None:  # stop / stop_token_ids: normalised by their own helpers
        return value
    if kind is bool:
        if isinstance(value, numbers.Integral) and value in (0, 1):  # True / False, or 0 / 1
            return bool(value)
    elif kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"meta_info[{key!r}] must be a {kind.__name__}, got {type(value).__name__} {value!r}")


@dataclass
class Generation:
    """An engine's raw result for B prompt rows.

    responses: (B, max_new_tokens) token ids, anything after ``lengths[i]`` is ignored.
    lengths: (B,) number of generated tokens per row (stop token included).
    log_probs: (B, max_new_tokens) the sampler's log-prob of each generated token.
    top_ids, top_log_probs: (B, max_new_tokens, k) the k most likely tokens of each step and their
        log-probs, under the same (processed) distribution; only when ``settings.top_logprobs = k > 0``.
    """

    responses: torch.Tensor
    lengths: torch.Tensor
    log_probs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    # (B, T_p + max_new_tokens, MoE layers, k) expert ids per layout column, -1 where none were
    # recorded; only with ``rollout.record_routing`` on an MoE model (rlcore.engines.routing)
    routed_experts: torch.Tensor | None = None


class Engine(ABC):
    """One inference engine holding one copy of the policy weights (batched, synchronous)."""

    pad_token_id: int
    eos_token_id: int

    @abstractmethod
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 settings: SamplingSettings) -> Generation:
        """Generate for left-padded prompts (B, T_p); every row is one sample (n is handled outside)."""

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the policy weights (HF parameter names, any dtype) in place."""

    def close(self) -> None:
        """Release what the engine holds beyond its Python objects, now (its worker's group is shutting
        down); nothing to do for most engines."""

    def abandon(self) -> None:
        """Drop the requests of a generation given up midway (``rlcore.single_controller.abandon``), so that
        nothing of it is computed later; nothing to do for an engine that keeps no requests between calls."""

    def release_idle_memory(self) -> int:
        """Between generations (``trainer.release_memory``): give back memory that only a generation uses,
        to be taken again by the next one. Returns the bytes given back; 0 for an engine that holds
        none between calls (the HF engine's KV cache lives for one call)."""
        return 0

    def release_weights(self) -> int:
        """Before an update that a full weight sync follows (``trainer.release_memory``): let go of the
        weights the sync will write again; ``generate`` refuses until ``load_weights``. Returns the bytes
        let go; 0 for an engine that keeps them (the HF engine)."""
        return 0

    def weight_checksums(self) -> dict[str, tuple[str, int, int] | None] | None:
        """{HF name: (dtype name, elements, hash of the bytes)} of the weights this engine samples
        with (``rlcore.algos.consistency.tensor_fingerprint``), for the consistency check to compare with the trainer's;
        an entry None for a tensor the engine keeps in a form it cannot read back (a packed CPU matmul
        kernel: counted, not compared); None from an engine that cannot read its weights back under
        the trainer's names."""
        return None

    def probe_log_probs(self, ids: Sequence[int]) -> dict[str, Any] | None:
        """The consistency check's end-to-end probe (``rlcore.engines.probe``): ``{"log_probs":
        [log p(ids[i] | ids[:i]) for i >= 1], "dtype": ...}`` from the weights this engine samples
        with; None from an engine that cannot score a sequence."""
        return None


def _str_tuple(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    if not all(isinstance(s, str) and s for s in out):
        raise TypeError(f"{what} must be a string or a list of non-empty strings, got {value!r}")
    return out


def check_weight_names(expected: set[str], given: Mapping[str, torch.Tensor]) -> None:
    """A partial update would leave the rollout sampling from a mix of old and new weights: refuse it."""
    missing, unexpected = sorted(expected - set(given)), sorted(set(given) - expected)
    if missing or unexpected:
        raise KeyError(f"state dict does not match the rollout model: {len(missing)} missing {missing[:5]}, "
                       f"{len(unexpected)} unexpected {unexpected[:5]}")
