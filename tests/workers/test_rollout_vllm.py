"""RolloutWorker with backend=vllm: the worker builds a vLLM engine and repeats each prompt n times,
adjacent (the engine against HF: tests/engines/test_vllm_engine.py; weight sync: test_weight_sync.py)."""

import pytest
import torch
from rollout_fixtures import PROMPTS, local_rollout, make_prompts
from transformers import AutoTokenizer

from rlcore.models.tiny import build_tiny_model

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MAX_NEW = 16


def test_n_samples_adjacent_and_distinct(tmp_path):
    from rlcore.engines.vllm_engine import VLLMEngine

    model_dir = build_tiny_model(tmp_path / "tiny_vllm", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    wg = local_rollout(model_dir, backend="vllm", dtype="float32", max_new_tokens=MAX_NEW,
                       kv_cache_memory_bytes=1 << 28, max_model_len=128)
    assert isinstance(wg.worker(0).engine, VLLMEngine)
    out = wg.generate_sequences(make_prompts(tok, meta_info={"n": 4}))
    assert len(out) == 4 * len(PROMPTS)
    assert list(out.non_tensor_batch["uid"]) == [f"p{i}" for i in range(len(PROMPTS)) for _ in range(4)]
    assert torch.equal(out.batch["prompts"], make_prompts(tok).batch["input_ids"].repeat_interleave(4, dim=0))
    responses = out.batch["responses"].view(len(PROMPTS), 4, MAX_NEW)
    for group in responses:  # 4 samples of 16 tokens from a near-uniform model: all different
        assert len({tuple(r.tolist()) for r in group}) == 4
    assert out.meta_info["rollout/tokens_per_s"] > 0
    assert out.meta_info["rollout/num_generated_tokens"] == int(out.batch["response_mask"].sum())
    assert out.meta_info["temperature"] == 1.0
