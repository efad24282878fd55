"""LoRA actors (actor.lora.rank > 0): only the adapters train, and every consumer of the weights
(rollout engines, exports, the reference) sees the right plain model.

References are peft's own: ``merge_and_unload()`` of a peft model holding the actor's adapters
gives the merged weights engines must receive; the peft model itself (unmerged) gives the greedy
output the synced rollout must reproduce; the untouched HF model is the reference policy.
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from rollout_fixtures import hand_greedy, make_prompts, unpadded
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.engines.weights import layer_of, pack_buckets
from rlcore.single_controller import (
    ClassWithInitArgs,
    LocalWorkerGroup,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from rlcore.typed_config import ConfigError, read_section
from rlcore.workers import fsdp_utils
from rlcore.workers.actor import ActorWorker
from rlcore.workers.config import ActorConfig, LoraConfig
from rlcore.workers.lora import merge_lora_tensors
from rlcore.workers.rollout import RolloutWorker

RANK, ALPHA = 4, 8.0
N_LINEAR = 7 * 2  # q, k, v, o, gate, up, down in each of the tiny model's 2 layers ("all-linear" skips lm_head)
PROMPTS = ["12+3=", "7*8=", "100-99=", "5+5="]
MAX_NEW = 8


def lora_config(path, rollout=None, **actor):
    """AdamW at a large lr (adapters are few; B starts at zero), no clipping, adapters of rank 4."""
    base = {"optimizer": "adamw", "lr": 5e-2, "weight_decay": 0.0, "grad_clip": None,
            "ppo_micro_batch_size_per_gpu": 2, "shuffle": False,
            "lora": {"rank": RANK, "alpha": ALPHA, "target_modules": "all-linear"}}
    config = {"model": {"path": path}, "actor": {**base, **actor}}
    if rollout is not None:
        config["rollout"] = rollout
    return config


def local_lora_actor(path, **actor):
    wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, lora_config(path, **actor)), world_size=1)
    wg.init_model()
    return wg


def adapter_state(worker) -> dict[str, torch.Tensor]:
    """The actor's own (peft-named) full state dict: base weights and adapters."""
    return fsdp_utils.full_state_dict(worker.module)


def peft_model(model_dir, raw_state):
    """An independent peft model holding the actor's adapters (built with peft's API directly)."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0))
    model.load_state_dict(raw_state)
    return model.eval()


def train(wg, data, steps=2):
    for _ in range(steps):
        wg.update_policy(data)


# ------------------------------------------------------------------------------------ config
def test_lora_section_reads_nested_keys_and_names_bad_ones():
    cfg = read_section({"actor": {"lora": {"rank": "8", "target_modules": ["q_proj", "v_proj"]}}}, "actor", ActorConfig)
    assert cfg.lora == LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"], dropout=0.0)
    assert cfg.lora.enabled and not read_section({}, "actor", ActorConfig).lora.enabled  # rank 0 by default
    with pytest.raises(ConfigError, match=r"actor\.lora\.rank: .*'x'.*\(expected int\)"):
        read_section({"actor": {"lora": {"rank": "x"}}}, "actor", ActorConfig)
    with pytest.raises(ConfigError, match=r"actor\.lora\.rnk"):
        read_section({"actor": {"lora": {"rnk": 8}}}, "actor", ActorConfig)
    with pytest.raises(ConfigError, match="target_modules"):
        read_section({"actor": {"lora": {"rank": 8, "target_modules": []}}}, "actor", ActorConfig)
    with pytest.raises(ConfigError, match="rank must be >= 0"):
        read_section({"actor": {"lora": {"rank": -1}}}, "actor", ActorConfig)


def test_every_key_of_the_lora_section_is_documented(undocumented_fields):
    assert undocumented_fields(LoraConfig) == []


# ------------------------------------------------------------------------------------ the merge itself
def test_merge_equals_peft_merge_and_unload(tiny_model_dir):
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           PeftLoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)  # peft starts B at zero: make the adapters do something
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merged = dict(merge_lora_tensors(state.items(), ALPHA / RANK))
    reference = model.merge_and_unload().state_dict()
    assert list(merged) == list(reference)  # the base model's names, in its order, no lora_ tensor
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    changed = [k for k in reference if not torch.equal(reference[k], base[k])]
    assert len(changed) == 4 and all(("q_proj" in k or "down_proj" in k) for k in changed)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # Streamed into buckets (push_weights): every tensor once, each decoder layer whole in one bucket.
    buckets = list(pack_buckets(merge_lora_tensors(state.items(), ALPHA / RANK), bucket_bytes=1))
    assert [n for b in buckets for n in b.names()] == list(reference)
    assert all(len({layer_of(n) for n in b.names()}) == 1 for b in buckets)
    assert len(buckets) == len({layer_of(n) for n in reference})
    with pytest.raises(ValueError, match="cannot merge"):
        list(merge_lora_tensors([("base_model.model.embed.lora_embedding_A.default", torch.zeros(1))], 1.0))
    with pytest.raises(ValueError, match="incomplete"):
        list(merge_lora_tensors([("base_model.model.x.lora_A.default.weight", torch.zeros(2, 2))], 1.0))


# ------------------------------------------------------------------------------------ the actor
def test_only_the_adapters_train(tiny_model_dir, make_batch):
    wg = local_lora_actor(tiny_model_dir)
    worker = wg.worker(0)
    named = dict(worker.module.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert len(trainable) == 2 * N_LINEAR and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(named[n]) for n in trainable}
    before = adapter_state(worker)
    train(wg, make_batch(), steps=2)  # step 1 moves B only (dL/dA = 0 while B = 0); step 2 moves A too
    after = adapter_state(worker)
    assert before.keys() == after.keys()
    frozen = [k for k in before if "lora_" not in k]
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    moved = [k for k in before if "lora_" in k and not torch.equal(before[k], after[k])]
    assert len(moved) == 2 * N_LINEAR
    state = worker.optimizer.state_dict()["state"]
    assert len(state) == 2 * N_LINEAR  # Adam moments for the adapters only


def test_engines_get_the_base_weights_at_init_and_peft_merged_weights_after_updates(tiny_model_dir, make_batch,
                                                                                     tmp_path):
    wg = local_lora_actor(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    at_init = wg.get_full_state_dict()
    assert list(at_init) == list(base)
    assert all(torch.equal(at_init[k], v) for k, v in base.items())  # B = 0: exactly the base model
    train(wg, make_batch(), steps=2)
    sent = wg.get_full_state_dict()
    reference = peft_model(tiny_model_dir, adapter_state(wg.worker(0))).merge_and_unload().state_dict()
    assert list(sent) == list(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(sent[name], tensor, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(not torch.equal(sent[k], base[k]) for k in base) == N_LINEAR

    wg.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in sent.items())
    data = make_batch()
    torch.testing.assert_close(_valid(wg.compute_log_prob(data).batch["old_log_probs"], data),
                               _hand_log_probs(exported, data), atol=1e-5, rtol=1e-5)
    # The adapters off: the reference policy is the untouched base model, with no ref worker.
    torch.testing.assert_close(_valid(wg.compute_ref_log_prob(data).batch["ref_log_prob"], data),
                               _hand_log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_dir), data),
                               atol=1e-5, rtol=1e-5)
    assert not torch.allclose(wg.compute_ref_log_prob(data).batch["ref_log_prob"],
                              wg.compute_log_prob(data).batch["old_log_probs"], atol=1e-3)


@torch.no_grad()
def _hand_log_probs(model, data):
    b = data.batch
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    t_r = b["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -t_r - 1:-1].float(), -1)
    return _valid(log_probs.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1), data)


def _valid(per_token, data):
    """0 at response padding: the worker crops each micro-batch to its rows' width (``crop_padding``),
    so what it returns there depends on the micro-batch; no caller reads it."""
    return per_token * data.batch["response_mask"]


def test_two_ranks_update_like_one(ray_cluster, tiny_model_dir, make_batch):
    """FSDP2 over 2 gloo ranks shards base weights and adapters; the update equals the 1-rank one."""
    data = make_batch()
    one = local_lora_actor(tiny_model_dir)
    train(one, data, steps=2)
    pool = RayResourcePool([2], num_cpus_per_process=0.5, name_prefix="lora_test")
    two = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, lora_config(tiny_model_dir)), default_timeout=300)
    try:
        two.init_model()
        train(two, data, steps=2)
        got, want = two.get_full_state_dict(), one.get_full_state_dict()
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            # atol 2e-5: the ranks' micro-batches hold other rows, so are cropped to other widths
            # (crop_padding); that float noise (~1e-7 in log-probs) moves AdamW's lr-5e-2 steps by up
            # to ~6e-6 (fused AdamW here). A lost all-reduce or a wrong shard moves them by ~lr.
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(_valid(two.compute_ref_log_prob(data).batch["ref_log_prob"], data),
                                   _valid(one.compute_ref_log_prob(data).batch["ref_log_prob"], data),
                                   rtol=1e-5, atol=1e-5)
    finally:
        two.shutdown()
        pool.shutdown()


def _optimizer_state(worker):
    state = copy.deepcopy(worker.optimizer.state_dict()["state"])
    local = lambda v: v.to_local().clone() if hasattr(v, "to_local") else v  # noqa: E731  (FSDP2 keeps DTensors)
    return {i: {k: local(v) for k, v in s.items()} for i, s in state.items()}


def test_checkpoint_holds_adapters_and_optimizer_only_and_restores_them(tiny_model_dir, make_batch, tmp_path):
    wg = local_lora_actor(tiny_model_dir)
    worker = wg.worker(0)
    data = make_batch()
    train(wg, data, steps=2)
    wg.save_checkpoint(str(tmp_path / "ckpt"))
    saved, saved_optim = adapter_state(worker), _optimizer_state(worker)
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert len(model_keys) == 2 * N_LINEAR and all("lora_" in k for k in model_keys)  # no base weight
    train(wg, data, steps=1)
    assert not torch.equal(adapter_state(worker)[next(k for k in saved if "lora_B" in k)],
                           saved[next(k for k in saved if "lora_B" in k)])
    wg.load_checkpoint(str(tmp_path / "ckpt"))
    restored = adapter_state(worker)
    assert all(torch.equal(restored[k], v) for k, v in saved.items())
    optim = _optimizer_state(worker)
    assert optim.keys() == saved_optim.keys() and len(optim) == 2 * N_LINEAR
    for i, s in saved_optim.items():
        assert all(torch.equal(torch.as_tensor(optim[i][k]), torch.as_tensor(v)) for k, v in s.items())
    # A fresh LoRA actor (base from model.path) resumes to the same weights.
    fresh = local_lora_actor(tiny_model_dir)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(adapter_state(fresh.worker(0))[k], v) for k, v in saved.items())


# ------------------------------------------------------------------------------------ rollout after a sync
def _hybrid(model_dir, rollout):
    config = lora_config(model_dir, rollout={"max_new_tokens": MAX_NEW, **rollout})
    wg = LocalWorkerGroup(create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorWorker, config),
                                                       "rollout": ClassWithInitArgs(RolloutWorker, config)}))
    wg.actor_init_model()  # the actor first: it sets up torch.distributed
    wg.rollout_init_model()
    return wg


def _check_rollout_follows_the_actor(wg, model_dir):
    """Train on the rollout's own samples (+1 advantage on even rows, -1 on odd), sync, then the
    rollout's greedy output must be the actor's: greedy decoding of the peft model holding its adapters."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    validate = lambda: wg.rollout_generate_sequences(make_prompts(tok, PROMPTS, {"validate": True}))  # noqa: E731
    before = validate()
    batch = wg.rollout_generate_sequences(make_prompts(tok, PROMPTS, {"n": 2, "temperature": 1.0, "seed": 3}))
    sign = torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(1)
    batch.batch["advantages"] = sign * batch.batch["response_mask"]
    for _ in range(3):
        wg.actor_update_policy(batch)
    wg.rollout_sync_weights()
    after = validate()
    assert not torch.equal(after.batch["responses"], before.batch["responses"])  # the policy moved
    actor_model = peft_model(model_dir, adapter_state(wg.worker(0, "actor")))
    prompts = make_prompts(tok, PROMPTS)
    for row in range(len(PROMPTS)):
        prompt = unpadded(prompts.batch["input_ids"][row], prompts.batch["attention_mask"][row])
        expected = hand_greedy(actor_model, prompt, MAX_NEW, {tok.eos_token_id})
        length = int(after.batch["response_mask"][row].sum())
        assert after.batch["responses"][row, :length].tolist() == expected, f"row {row}"


def test_hf_rollout_after_sync_generates_what_the_lora_actor_does(tiny_model_dir):
    _check_rollout_follows_the_actor(_hybrid(tiny_model_dir, {"backend": "hf"}), tiny_model_dir)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_rollout_after_sync_generates_what_the_lora_actor_does(tiny_model_dir):
    pytest.importorskip("vllm")
    wg = _hybrid(tiny_model_dir, {"backend": "vllm", "dtype": "float32", "kv_cache_memory_bytes": 1 << 28,
                                  "max_model_len": 128})
    _check_rollout_follows_the_actor(wg, tiny_model_dir)
