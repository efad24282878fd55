"""How much KV cache a vLLM engine reserves: ``rollout.kv_cache_tokens``, turned into the bytes vLLM takes.

vLLM reserves its KV cache whole at start-up (on CPU a zeroed tensor: every byte resident from the
first moment, whether the batch uses it or not), sized by ``kv_cache_memory_bytes`` or a fraction of
the device's memory (``gpu_memory_utilization``, on CPU a fraction of RAM: 0.1 of 24 GB is 2.4 GB).
Bytes say nothing of what the cache holds: a token takes twice as many in fp32 as in bf16, so a
byte budget right for one machine's dtype is twice too small or too large on another. A budget in
tokens is the batch's own measure (rows decoded at once x the blocks each row takes), converted here
for the model and the engine's dtype.
"""

from __future__ import annotations

import torch

from rlcore.engines.base import RolloutConfig
from rlcore.engines.shared_prompt import SHARED_BLOCK_SIZE


def kv_cache_bytes(hf_config, dtype: torch.dtype) -> int:
    """Bytes of KV cache per token of a standard-attention decoder: a key and a value of every KV head
    in every layer (SmolLM2-135M: 30 layers x 2 x 3 heads x 64 x 2 bytes in bf16 = 23,040)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if getattr(text, "kv_lora_rank", None):
        raise ValueError("rollout.kv_cache_tokens: latent (MLA) attention caches another shape; "
                         "set rollout.kv_cache_memory_bytes instead")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return text.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def vllm_overrides(rollout_cfg: RolloutConfig, hf_config, dtype: torch.dtype, device: str = "cpu") -> dict:
    """The engine arguments the ``rollout`` section sets (``RolloutConfig.vllm_overrides``), with
    ``kv_cache_tokens`` as the bytes they take in ``dtype``, and on CPU a ``block_size`` left null as
    ``SHARED_BLOCK_SIZE``: vLLM's CPU default of 128-token blocks, which its prefix cache shares whole
    only, leaves a group's rows (or a session's turns) to prefill a ~50-token prompt each
    (rlcore.engines.shared_prompt)."""
    out = rollout_cfg.vllm_overrides()
    if rollout_cfg.block_size is None and torch.device(device).type == "cpu":
        out["block_size"] = SHARED_BLOCK_SIZE
    if rollout_cfg.kv_cache_tokens is not None:
        out["kv_cache_memory_bytes"] = rollout_cfg.kv_cache_tokens * kv_cache_bytes(hf_config, dtype)
    return out
