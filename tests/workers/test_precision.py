"""``model.mixed_precision: auto`` in a worker built by hand: bf16 only where the device has it
natively and the model is wide enough (a rule, not a timing); the actor really computes in the choice."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.engines import dtype_choice

from rlcore.models.config import ModelConfig
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup, RayResourcePool, RayWorkerGroup
from rlcore.workers import precision
from rlcore.workers.actor import ActorWorker
from rlcore.workers.packing import PACKED_EAGER

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    monkeypatch.setattr(precision, "_decided", {})


def test_no_native_bf16_means_float32():
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", hidden_size=1024, num_hidden_layers=1,
                                                                  num_attention_heads=8, intermediate_size=64))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dtype_choice, "native_bf16", lambda device: (False, "AVX2 only"))
        assert precision.choose_mixed_precision(model, CPU) == (None, "AVX2 only")


@pytest.mark.parametrize("hidden, choice", [(128, None), (510, None), (512, "bfloat16"), (2048, "bfloat16")])
def test_native_bf16_is_chosen_by_the_model_width(monkeypatch, hidden, choice):
    """By rule, never by timing: the same model on the same machine always gets the same choice."""
    monkeypatch.setattr(dtype_choice, "native_bf16", lambda device: (True, "AMX tiles"))
    config = AutoConfig.for_model("llama", hidden_size=hidden, num_hidden_layers=1, num_attention_heads=1,
                                  intermediate_size=8, vocab_size=8)
    got, why = precision.choose_mixed_precision(AutoModelForCausalLM.from_config(config), CPU)
    assert got == choice and "AMX tiles" in why and f"hidden size {hidden}" in why
    monkeypatch.setattr(dtype_choice, "native_bf16", lambda device: (True, "CUDA bf16"))
    assert dtype_choice.mixed_precision_choice(hidden, "cuda") == ("bfloat16", "CUDA bf16")  # any width on a GPU


def log_probs(path, mixed_precision, data):
    """The actor's masked log-probs of ``data``, and the precision the actor says it computes in."""
    config = {"model": {"path": path, "mixed_precision": mixed_precision}, "actor": {"ppo_micro_batch_size_per_gpu": 4}}
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), world_size=1)
    wg.init_model()
    return wg.compute_log_prob(data).batch["old_log_probs"] * data.batch["response_mask"], wg.worker().compute_dtype


@pytest.mark.parametrize("chosen", ["bfloat16", None])
def test_auto_trains_in_the_chosen_precision(monkeypatch, tiny_model_dir, make_batch, chosen):
    """The same numbers as setting the choice by hand: bf16 ones where bf16 was chosen, fp32 ones else."""
    calls = []
    monkeypatch.setattr(precision, "choose_mixed_precision", lambda model, device: calls.append(1) or (chosen, "test"))
    auto, compute_dtype = log_probs(tiny_model_dir, "auto", make_batch())
    assert compute_dtype == chosen
    log_probs(tiny_model_dir, "auto", make_batch())  # a second worker of the same model in this process: no new probe
    assert len(calls) == 1
    by_hand, other = log_probs(tiny_model_dir, chosen, make_batch())[0], log_probs(tiny_model_dir, "bfloat16" if chosen is None else None, make_batch())[0]
    torch.testing.assert_close(auto, by_hand, rtol=0, atol=0)
    assert (auto - other).abs().max() > 1e-4  # the two precisions really differ


def test_unknown_mixed_precision_names_the_choices():
    with pytest.raises(ValueError, match="null, 'bfloat16' or 'auto'"):
        ModelConfig(path="x", mixed_precision="float16")


def test_two_ranks_take_rank_zeros_choice(ray_cluster, tiny_model_dir, make_batch):
    """Rank 0 decides and broadcasts (FSDP ranks must agree on the parameter dtype): the sharded
    log-probs are those of one precision, computed in-process."""
    config = {"model": {"path": tiny_model_dir, "mixed_precision": "auto"}, "actor": {"ppo_micro_batch_size_per_gpu": 4}}
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="precision")
    group = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, config), default_timeout=120)
    try:
        group.init_model()
        sharded = group.compute_log_prob(make_batch()).batch["old_log_probs"] * make_batch().batch["response_mask"]
    finally:
        group.shutdown()
        pool.shutdown()
    gaps = [(sharded - log_probs(tiny_model_dir, choice, make_batch())[0]).abs().max().item() for choice in (None, "bfloat16")]
    assert min(gaps) < 1e-6 < max(gaps)


def test_eager_attention_gives_the_same_log_probs_and_a_bad_name_is_refused(tiny_model_dir, make_batch):
    """``model.attn_implementation``: the padded path's actor (``use_remove_padding=false``) really loads
    that kernel, and it scores the same tokens as the default (sdpa) one, here in fp32. Packed, eager
    loads the packed kernel with eager math inside (rlcore.workers.packing)."""
    data = make_batch()
    got = {}
    for impl in (None, "eager"):
        config = {"model": {"path": tiny_model_dir, "attn_implementation": impl, "use_remove_padding": False},
                  "actor": {"ppo_micro_batch_size_per_gpu": 4}}
        wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), world_size=1)
        wg.init_model()
        assert wg.worker().module.config._attn_implementation == (impl or "sdpa")
        got[impl] = wg.compute_log_prob(data).batch["old_log_probs"] * data.batch["response_mask"]
    torch.testing.assert_close(got["eager"], got[None], atol=1e-5, rtol=0)
    packed = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, {"model": {"path": tiny_model_dir, "attn_implementation": "eager"}}))
    packed.init_model()
    assert packed.worker().module.config._attn_implementation == PACKED_EAGER
    with pytest.raises(ValueError, match="model.attn_implementation must be null or one of"):
        ModelConfig(path=tiny_model_dir, attn_implementation="flash")
