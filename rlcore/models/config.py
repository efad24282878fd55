"""The ``model`` section (shared by the actor, reference, critic and rollout) and ``tiny_model``."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlcore.errors import MissingFileError, close_file
from rlcore.models.cpu_matmul import CHOICES as CPU_MATMULS

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def torch_dtype(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype a config names (``float32``/``fp32``, ``bfloat16``/``bf16``, ``float16``/``fp16``)."""
    if name not in DTYPES:
        raise ValueError(f"{what} must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint every role starts from. The device is ``trainer.device``, the one device setting of a run."""

    path: str | None = None  # a local HF directory, a .gguf file or "smollm2" (converted once); null in the recipes: their built-in warm start
    dtype: str = "float32"  # parameter dtype of the trained roles (and of the HF rollout, unless rollout.dtype)
    gradient_checkpointing: bool = False  # recompute activations in backward (training roles)
    mixed_precision: str | None = None  # "bfloat16": FSDP2 computes in bf16, parameters and reduction stay float32; "auto": bf16 where measured faster
    use_remove_padding: bool = True  # trained roles run packed micro-batches: valid tokens end to end, no padding (rlcore.workers.packing)
    pack_shared_prompts: bool = True  # packed: a group's rows that share a prompt hold it once (rlcore.workers.packing)
    fused_layers: bool = True  # trained roles: RMSNorm and SiLU(gate) * up as fused autograd functions, same bits, less kept (rlcore.models.fused_layers)
    cpu_matmul: str = "onednn"  # trained roles' fp32 linears on CPU: "onednn" (kernels ~20% faster than MKL's on AVX-512 Zen 4; the SmolLM2 update ~4%) or "torch" (rlcore.models.cpu_matmul)
    attn_implementation: str | None = None  # the trained roles' attention kernel (transformers'): "eager", "sdpa", "flash_attention_2"; null: transformers' choice (sdpa)

    def __post_init__(self) -> None:
        torch_dtype(self.dtype, "model.dtype")
        if self.mixed_precision not in (None, "bfloat16", "auto"):
            raise ValueError(f"model.mixed_precision must be null, 'bfloat16' or 'auto', got {self.mixed_precision!r} "
                             "(float16 would need loss scaling)")
        if self.attn_implementation not in (None, *ATTN_IMPLEMENTATIONS):
            raise ValueError(f"model.attn_implementation must be null or one of {ATTN_IMPLEMENTATIONS}, "
                             f"got {self.attn_implementation!r}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"model.cpu_matmul must be one of {list(CPU_MATMULS)}, got {self.cpu_matmul!r}")
        if self.mixed_precision and torch_dtype(self.dtype) != torch.float32:
            raise ValueError(f"model.mixed_precision={self.mixed_precision} computes in bf16 over float32 parameters; "
                             f"model.dtype is {self.dtype!r}: set model.dtype=float32")

    def load_kwargs(self) -> dict:
        """``from_pretrained`` keywords of the trained roles (actor, reference, critic). Eager attention:
        measured 11% faster than SDPA's CPU flash kernel for a bf16 update at ~90 tokens (its backward in
        bf16 runs 3x its fp32 time), but its memory grows with the square of the length."""
        kwargs = {"dtype": torch_dtype(self.dtype)}
        if self.attn_implementation:
            kwargs["attn_implementation"] = self.attn_implementation
        return kwargs

    def require_path(self) -> str:
        if not self.path:
            raise ValueError("model.path is required: a local HF model directory")
        return self.path

    def require_local_dir(self) -> str:
        """The path, checked to be a HF model directory on this machine: ``from_pretrained`` would take
        a missing one for a Hub repo id and fail late, after network retries, with a message about the Hub."""
        path = self.require_path()
        if not os.path.isfile(os.path.join(path, "config.json")):
            hint = "" if os.path.isdir(path) else close_file(path)  # a typo in the folder's name: the closest one
            raise MissingFileError(f"not a local HF model directory: {path} (no config.json){hint}")
        return path


@dataclass(frozen=True)
class TinyModelConfig:
    """A model built from scratch when ``model.path`` is null (``rlcore.models.tiny.build_tiny_model``)."""

    preset: str = "tiny"  # a TINY_PRESETS name: "tiny" (~0.3M parameters) or "small" (~25M)
    arch: str = "llama"  # "llama", "qwen3" or "qwen3_moe" (every layer MoE: num_experts, top num_experts_per_tok)
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention needs 32, 64, 80, 96, 112, 128, 160, 192, 224 or 256
    intermediate_size: int | None = None  # null: the preset's
    seed: int = 0  # initial weights
    num_experts: int = 4  # qwen3_moe only: experts per layer
    num_experts_per_tok: int = 2  # qwen3_moe only: top-k routing
