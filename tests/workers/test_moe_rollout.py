"""Rollout on a tiny Qwen3-MoE model: the HF and vLLM engines record the experts they routed each
token to (``rollout.record_routing``), aligned with the layout's columns; after an in-place weight
sync from an MoE actor, vLLM's greedy output equals HF's (and a fresh engine's) and both recorded
the same routing."""

import asyncio
import gc

import pytest
import torch
from rollout_fixtures import local_rollout, make_prompts
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.engines.base import RolloutConfig, SamplingSettings
from rlcore.engines.hf_engine import HFEngine
from rlcore.engines.weights import pack_buckets
from rlcore.models.config import ModelConfig
from rlcore.models.moe import RoutingRecorder
from rlcore.models.tiny import build_tiny_model
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker

MAX_NEW = 8


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), arch="qwen3_moe", seed=0)


def teacher_forced_routing(model, out):
    """The experts a full forward over prompt ++ response picks at every column: (B, T, L, k)."""
    b = out.batch
    rec = RoutingRecorder(model)
    with torch.no_grad():
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    rec.remove()
    bsz, width = b["input_ids"].shape
    return torch.stack([c.reshape(bsz, width, -1) for c in rec.calls[0]], dim=2)


def check_routing(out, model):
    routed = out.batch["routed_experts"]
    b = out.batch
    t_p = b["prompts"].shape[1]
    assert routed.shape == (*b["input_ids"].shape, 2, 2) and routed.dtype == torch.int16
    assert bool((routed[b["attention_mask"] == 0] == -1).all())  # padding: nothing recorded
    lengths = b["response_mask"].sum(-1).long()
    # the last response token of the longest rows is never run (nothing is sampled after it); a row that
    # stopped sooner has its last token run by the next decoding step, while the others go on
    never_run = torch.nonzero(lengths == lengths.max()).flatten()
    last = t_p + lengths[never_run] - 1
    assert bool((routed[never_run, last] == -1).all())
    recorded = (routed >= 0).all(-1).all(-1)
    # every response token but those was recorded, and the whole prompt (no prefix-cache hit here)
    want = b["attention_mask"].bool().clone()
    want[never_run, last] = False
    assert torch.equal(recorded, want)
    full = teacher_forced_routing(model, out)
    assert torch.equal(routed[recorded].sort(-1).values, full[recorded].to(torch.int16).sort(-1).values)
    return routed


def test_hf_engine_records_routing_of_prompt_and_response(moe_dir):
    tok = AutoTokenizer.from_pretrained(moe_dir)
    wg = local_rollout(moe_dir, max_new_tokens=MAX_NEW, record_routing=True)
    out = wg.generate_sequences(make_prompts(tok, meta_info={"n": 2, "seed": 3}))
    check_routing(out, AutoModelForCausalLM.from_pretrained(moe_dir).eval())
    plain = local_rollout(moe_dir, max_new_tokens=MAX_NEW).generate_sequences(make_prompts(tok))
    assert "routed_experts" not in plain.batch.keys()  # off by default


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_in_place_sync_equals_hf_and_a_fresh_engine(moe_dir, make_batch, tmp_path):
    """Both engines start from the untrained model and are synced in place from the trained actor:
    vLLM's greedy output equals HF's (same routing too) and a fresh vLLM engine's started from the
    actor's export (on CPU, the sync must prepack the experts again: vllm_worker.repack_cpu_experts);
    reloading the same weights changes nothing."""
    pytest.importorskip("vllm")
    tok = AutoTokenizer.from_pretrained(moe_dir)
    actor = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": moe_dir}, "actor": {
        "optimizer": "sgd", "lr": 0.05, "grad_clip": None, "moe_aux_loss_coef": 0.1}}), 1)
    actor.init_model()
    actor.update_policy(make_batch())
    state = actor.get_full_state_dict()
    trained_dir = str(tmp_path / "trained")
    actor.export_hf(trained_dir)
    common = dict(max_new_tokens=MAX_NEW, record_routing=True, dtype="float32")
    vllm_kw = dict(backend="vllm", kv_cache_memory_bytes=1 << 27, max_model_len=128, **common)
    greedy = {"validate": True}
    hf = local_rollout(moe_dir, **common)
    vllm = local_rollout(moe_dir, **vllm_kw)
    before = hf.generate_sequences(make_prompts(tok, meta_info=greedy))
    assert torch.equal(before.batch["responses"], vllm.generate_sequences(make_prompts(tok, meta_info=greedy)).batch["responses"])
    hf.update_weights(state)
    vllm.update_weights(state)
    out_hf = hf.generate_sequences(make_prompts(tok, meta_info=greedy))
    out_vllm = vllm.generate_sequences(make_prompts(tok, meta_info=greedy))
    assert not torch.equal(before.batch["responses"], out_hf.batch["responses"])  # the update changed the policy
    assert torch.equal(out_hf.batch["responses"], out_vllm.batch["responses"])
    assert torch.equal(out_hf.batch["response_mask"], out_vllm.batch["response_mask"])
    trained = AutoModelForCausalLM.from_pretrained(trained_dir).eval()
    routed_hf, routed_vllm = check_routing(out_hf, trained), check_routing(out_vllm, trained)
    assert torch.equal(routed_hf.sort(-1).values, routed_vllm.sort(-1).values)
    fresh = local_rollout(trained_dir, **vllm_kw).generate_sequences(make_prompts(tok, meta_info=greedy))
    assert torch.equal(fresh.batch["responses"], out_vllm.batch["responses"])
    torch.testing.assert_close(out_vllm.batch["rollout_log_probs"], fresh.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    vllm.update_weights(state)  # the same weights again: a reload must not repack already packed experts
    again = vllm.generate_sequences(make_prompts(tok, meta_info=greedy))
    assert torch.equal(again.batch["responses"], out_vllm.batch["responses"])
    torch.testing.assert_close(again.batch["rollout_log_probs"], out_vllm.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    assert torch.equal(again.batch["routed_experts"], out_vllm.batch["routed_experts"])


@pytest.mark.slow
@pytest.mark.vllm
def test_async_vllm_bucketed_update_of_moe_weights(moe_dir, tmp_path):
    """The bucket path (``BucketLoader`` in vLLM's worker): after a bucketed update to other MoE
    weights, greedy output is the new weights' (HF engine as reference); the same buckets again
    change nothing."""
    pytest.importorskip("vllm")
    from rlcore.engines.async_vllm import AsyncVLLMEngine

    tok = AutoTokenizer.from_pretrained(moe_dir)
    new_dir = build_tiny_model(tmp_path / "other", arch="qwen3_moe", seed=1)
    new_state = AutoModelForCausalLM.from_pretrained(new_dir).state_dict()
    greedy = SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, n=1, do_sample=False)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("1+1=", "12+3=", "7*8=", "a", "hello")]
    hf_new = HFEngine(ModelConfig(path=new_dir), RolloutConfig(dtype="float32"))

    def reference(prompt):
        out = hf_new.generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                              torch.arange(len(prompt))[None], greedy)
        n = int(out.lengths[0])
        return out.responses[0, :n].tolist(), out.log_probs[0, :n]

    async def run():
        engine = AsyncVLLMEngine(ModelConfig(path=moe_dir), RolloutConfig(
            backend="vllm", dtype="float32", max_new_tokens=MAX_NEW, kv_cache_memory_bytes=1 << 27, max_model_len=128))
        try:
            before = await asyncio.gather(*[engine.generate(p, greedy) for p in prompts])
            results = [before]
            for version in (1, 2):  # the new weights, then the same ones again
                await engine.update_weights(pack_buckets(new_state.items(), 1 << 16), version)
                results.append(await asyncio.gather(*[engine.generate(p, greedy) for p in prompts]))
            return results
        finally:
            await engine.close()
            engine.llm = None  # AsyncLLM's __del__ shuts down again: let it run now, not at interpreter exit
            gc.collect()

    before, synced, again = asyncio.run(run())
    refs = [reference(p) for p in prompts]
    assert sum(b.token_ids != r[0] for b, r in zip(before, refs)) > 0  # the new weights differ
    for out, rep, (tokens, log_probs) in zip(synced, again, refs):
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.tensor(out.log_probs), log_probs.float(), atol=1e-4, rtol=0)
        assert rep.token_ids == out.token_ids
        torch.testing.assert_close(torch.tensor(rep.log_probs), torch.tensor(out.log_probs), atol=1e-5, rtol=0)
