"""What the rollout backends share: configuration, per-call sampling settings, output assembly.

A backend (``HFRollout``, ``VLLMRollout``) only turns prompt token ids into response token ids and
the sampler's log-probs of those tokens (a ``Generation``). Everything a trainer relies on (shapes,
padding, masks, positions, n-sample repetition, metrics) is built here once, so both backends hand
the trainer byte-for-byte the same layout.

Stopping rule, identical for both backends: a response ends at (and includes) the first token in
``{eos} | stop_token_ids`` (eos left out with ``ignore_eos``), or at the token that completes one
of the ``stop`` strings (matched on the generated text only), or after ``max_new_tokens`` tokens.
The tokens of a stop string stay in the response (the policy generated them); only the text of
vLLM's ``CompletionOutput`` would hide it, and we never use text.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.protocol import DataProto

BACKENDS = ("hf", "vllm")


def _check_keys(section: str, given: Mapping, cls: type, derived: frozenset[str] = frozenset()) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - derived
    unknown = sorted(set(given) - known)
    if unknown:
        raise KeyError(f"unknown key(s) {unknown} in config section {section!r}; known keys: {sorted(known)}")


@dataclass(frozen=True)
class ModelConfig:
    """``model`` section (shared with the actor): the checkpoint the rollout starts from.

    ``device`` is not a key of its own: it comes from ``trainer.device`` (auto | cpu | cuda), the one
    device setting of a run. ``gradient_checkpointing`` and ``mixed_precision`` belong to training and are ignored here.
    """

    path: str
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    mixed_precision: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        torch_dtype(self.dtype, "model.dtype")


@dataclass(frozen=True)
class RolloutConfig:
    """``rollout`` section; see ``rlcore.workers.rollout.worker`` for the meaning of every key."""

    backend: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    n: int = 1
    do_sample: bool = True
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    dtype: str | None = None
    gpu_memory_utilization: float = 0.1
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"rollout.backend must be one of {BACKENDS}, got {self.backend!r}")
        # Lists from YAML become tuples so the config stays hashable and immutable.
        object.__setattr__(self, "stop", _str_tuple(self.stop, "rollout.stop"))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.dtype is not None:
            torch_dtype(self.dtype, "rollout.dtype")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        SamplingSettings.from_config(self)  # validates the sampling keys


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

    OVERRIDABLE = ("temperature", "top_p", "top_k", "max_new_tokens", "n", "do_sample", "stop", "stop_token_ids",
                   "ignore_eos")

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
        object.__setattr__(self, "top_k", max(self.top_k, 0))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> "SamplingSettings":
        return cls(**{k: getattr(cfg, k) for k in cls.OVERRIDABLE})

    @classmethod
    def resolve(cls, cfg: RolloutConfig, meta_info: Mapping[str, Any]) -> "SamplingSettings":
        """Config defaults, then validation defaults, then explicit meta_info overrides.

        ``meta_info["validate"] = True`` means greedy decoding, one sample per prompt, unless the
        same meta_info sets ``do_sample`` / ``n`` itself (e.g. pass@k validation by sampling).
        Other meta_info keys are not ours and are ignored.
        """
        values = {k: getattr(cfg, k) for k in cls.OVERRIDABLE}
        if meta_info.get("validate", False):
            values.update(do_sample=False, n=1)
        for key in cls.OVERRIDABLE:
            if key in meta_info:
                values[key] = meta_info[key]
        values["stop"] = _str_tuple(values["stop"], "stop")
        values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
        return cls(**values)


@dataclass
class Generation:
    """A backend's raw result for B prompt rows.

    responses: (B, max_new_tokens) token ids, anything after ``lengths[i]`` is ignored.
    lengths: (B,) number of generated tokens per row (stop token included).
    log_probs: (B, max_new_tokens) the sampler's log-prob of each generated token.
    """

    responses: torch.Tensor
    lengths: torch.Tensor
    log_probs: torch.Tensor


class RolloutBackend(ABC):
    """One inference engine holding one copy of the policy weights."""

    pad_token_id: int
    eos_token_id: int

    @abstractmethod
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 settings: SamplingSettings) -> Generation:
        """Generate for left-padded prompts (B, T_p); every row is one sample (n is handled outside)."""

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Replace the policy weights (HF parameter names, any dtype) in place."""


# ------------------------------------------------------------------ config parsing
def parse_config(config: Any) -> tuple[ModelConfig, RolloutConfig]:
    """Read the ``model`` and ``rollout`` sections of a dict or OmegaConf config.

    Both sections must be present (a misspelt section name would otherwise silently mean
    "all defaults"); other sections are left alone, so a recipe can pass its whole config.
    """
    config = _to_plain(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"RolloutWorker config must be a mapping with 'model' and 'rollout', got {type(config).__name__}")
    missing = [s for s in ("model", "rollout") if s not in config]
    if missing:
        raise KeyError(f"RolloutWorker config is missing section(s) {missing}; it has {sorted(config)}")
    model = dict(config["model"] or {})
    rollout = dict(config["rollout"] or {})
    _check_keys("model", model, ModelConfig, derived=frozenset({"device"}))
    _check_keys("rollout", rollout, RolloutConfig)
    if "path" not in model:
        raise KeyError("config section 'model' needs 'path' (a Hugging Face checkpoint directory)")
    device = str((config.get("trainer") or {}).get("device", "auto"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ModelConfig(**model, device=device), RolloutConfig(**rollout)


def _to_plain(config: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # omegaconf is optional on the GPU check machine
        return config
    return OmegaConf.to_container(config, resolve=True) if isinstance(config, DictConfig) else config


def _str_tuple(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    out = tuple(value)
    if not all(isinstance(s, str) and s for s in out):
        raise TypeError(f"{what} must be a string or a list of non-empty strings, got {value!r}")
    return out


def torch_dtype(name: str, what: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"{what} must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def check_weight_names(expected: set[str], given: Mapping[str, torch.Tensor]) -> None:
    """A partial update would leave the rollout sampling from a mix of old and new weights: refuse it."""
    missing, unexpected = sorted(expected - set(given)), sorted(set(given) - expected)
    if missing or unexpected:
        raise KeyError(f"state dict does not match the rollout model: {len(missing)} missing {missing[:5]}, "
                       f"{len(unexpected)} unexpected {unexpected[:5]}")


# ------------------------------------------------------------------ prompts and output assembly
def check_left_padded(attention_mask: torch.Tensor) -> None:
    """Both backends read a prompt as the tokens under its mask, ending at the last column."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be (B, T_p), got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[1] == 0 or not bool(attention_mask[:, -1].all()):
        raise ValueError("prompts must be left-padded with at least one token each: attention_mask[:, -1] must be all 1")
    ones_after_first = attention_mask.cumsum(dim=1) > 0
    if not bool((attention_mask.bool() == ones_after_first).all()):
        raise ValueError("prompts must be left-padded: attention_mask has a 0 between two 1s")


def build_output(prompts: DataProto, gen: Generation, pad_token_id: int, gen_time_s: float) -> DataProto:
    """The trainer-facing DataProto (layout documented in ``rlcore.protocol``) from one ``Generation``."""
    prompt_ids = prompts.batch["input_ids"]
    prompt_mask = prompts.batch["attention_mask"]
    prompt_pos = prompts.batch["position_ids"]
    bsz, t_r = gen.responses.shape
    if bsz != len(prompts):
        raise RuntimeError(f"backend returned {bsz} responses for {len(prompts)} prompts")

    steps = torch.arange(t_r).unsqueeze(0)
    response_mask = (steps < gen.lengths.unsqueeze(1)).to(prompt_mask.dtype)
    responses = torch.where(response_mask.bool(), gen.responses.to(prompt_ids.dtype), pad_token_id)
    log_probs = torch.where(response_mask.bool(), gen.log_probs.float(), 0.0)
    # Positions continue from the prompt's last position, padding included (it is masked anyway).
    response_pos = prompt_pos[:, -1:] + 1 + steps.to(prompt_pos.dtype)

    out = DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "position_ids": torch.cat([prompt_pos, response_pos], dim=1),
            "rollout_log_probs": log_probs,
        },
        non_tensors=dict(prompts.non_tensor_batch),
        meta_info=dict(prompts.meta_info),
    )
    n_tokens = int(response_mask.sum())
    out.meta_info.update({
        "rollout/gen_time_s": gen_time_s,
        "rollout/tokens_per_s": n_tokens / gen_time_s if gen_time_s > 0 else float("nan"),
        "rollout/num_generated_tokens": n_tokens,
    })
    return out
