"""rollout.kv_cache_tokens -> bytes, by hand (the engine's own check: tests/engines/test_vllm_engine.py)."""

from types import SimpleNamespace

import pytest
import torch

from rlcore.engines import RolloutConfig
from rlcore.engines.kv_cache_size import kv_cache_bytes, vllm_overrides

SMOLLM2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)


def test_bytes_per_token_of_smollm2_by_hand():
    assert kv_cache_bytes(SMOLLM2, torch.bfloat16) == 30 * 2 * 3 * 64 * 2 == 23_040
    assert kv_cache_bytes(SMOLLM2, torch.float32) == 46_080
    explicit = SimpleNamespace(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, head_dim=48)  # no GQA
    assert kv_cache_bytes(explicit, torch.float32) == 2 * 2 * 4 * 48 * 4
    nested = SimpleNamespace(text_config=SMOLLM2)  # a multimodal config's language model
    assert kv_cache_bytes(nested, torch.bfloat16) == 23_040
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        kv_cache_bytes(SimpleNamespace(kv_lora_rank=512, **vars(SMOLLM2)), torch.bfloat16)


def test_tokens_override_bytes_and_are_checked():
    cfg = RolloutConfig(backend="vllm", kv_cache_memory_bytes=1 << 30, kv_cache_tokens=16384, max_num_seqs=128)
    assert vllm_overrides(cfg, SMOLLM2, torch.bfloat16, device="cuda") == {"kv_cache_memory_bytes": 16384 * 23_040,
                                                                          "max_num_seqs": 128}
    assert vllm_overrides(RolloutConfig(kv_cache_memory_bytes=1 << 30), SMOLLM2, torch.bfloat16, device="cuda") == {
        "kv_cache_memory_bytes": 1 << 30}
    with pytest.raises(ValueError, match="rollout.kv_cache_tokens must be >= 1"):
        RolloutConfig(kv_cache_tokens=0)


def test_a_null_block_size_is_32_on_cpu_only():
    """vLLM's CPU default (128-token blocks) never fills with a ~50-token prompt, so its prefix cache could
    share nothing between a group's rows: rlcore asks for 32 on CPU; an explicit size, or another device, wins."""
    assert vllm_overrides(RolloutConfig(), SMOLLM2, torch.float32) == {"block_size": 32}
    assert vllm_overrides(RolloutConfig(), SMOLLM2, torch.float32, device="cuda") == {}
    assert vllm_overrides(RolloutConfig(block_size=128), SMOLLM2, torch.float32) == {"block_size": 128}
