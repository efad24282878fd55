"""Packed micro-batches on the real model (SmolLM2-135M, 49k vocabulary, 9 heads over 3 KV heads):
log-probs, entropies, one whole SGD update and the critic's values packed, each group's shared
prompt held once, equal the padded path's (rlcore.workers.packing)."""

import pytest
import torch
from transformers import AutoTokenizer

from rlcore.data.dataset import collate_prompts
from rlcore.data.word_problems import make_word_problems
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.packing import pack

pytestmark = pytest.mark.slow


def skewed_batch(model_dir: str) -> DataProto:
    """Three chat prompts of different lengths (left-padded), two samples each as a rollout lays them
    out (prompts 0, 1, 2, 0, 1, 2), random responses of 3 to 12 tokens."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_word_problems("arithmetic_words", 3, seed=7)
    prompts = [torch.tensor(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)["input_ids"]) for r in rows] * 2
    tensors, _ = collate_prompts([{"input_ids": p} for p in prompts], tok.pad_token_id)
    g = torch.Generator().manual_seed(3)
    response_mask = (torch.arange(12) < torch.tensor([[3], [12], [7], [9], [5], [12]])).long()
    responses = torch.randint(10, 49152, (6, 12), generator=g) * response_mask
    mask = torch.cat([tensors["attention_mask"], response_mask], 1)
    return DataProto.from_dict({
        "input_ids": torch.cat([tensors["input_ids"], responses], 1), "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
        "response_mask": response_mask.float(), "advantages": torch.randn(6, 12, generator=g) * response_mask,
    })


def test_smollm2_packed_log_probs_entropies_and_update_equal_the_padded_path(smollm2_dir):
    data = skewed_batch(smollm2_dir)
    b = data.batch
    assert int((b["attention_mask"] == 0).sum()) >= 14  # there is padding to remove (responses: 9 + 5 + 3 + 7)
    mask = b["response_mask"].bool()
    groups = {}
    for packed in (True, False):
        config = {"model": {"path": smollm2_dir, "use_remove_padding": packed},
                  "actor": {"optimizer": "sgd", "lr": 1e-3, "weight_decay": 0.0, "grad_clip": None,
                            "ppo_micro_batch_size_per_gpu": 6, "shuffle": False, "logits_chunk_mb": 8}}
        groups[packed] = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config))
        groups[packed].init_model()
    width = b["input_ids"].shape[1] - 12
    held = pack(b["input_ids"], b["attention_mask"], b["position_ids"], prompt_width=width).num_tokens
    prompts = int(b["attention_mask"][:3, :width].sum())
    assert groups[True].worker().shares_prompts and held == int(b["attention_mask"].sum()) - prompts  # each prompt once
    out = {p: g.compute_log_prob(data).batch for p, g in groups.items()}
    for key in ("old_log_probs", "entropys"):
        torch.testing.assert_close(out[True][key][mask], out[False][key][mask], atol=2e-4, rtol=0)
    metrics = {p: g.update_policy(data)[0] for p, g in groups.items()}
    assert metrics[True]["actor/loss"] == pytest.approx(metrics[False]["actor/loss"], rel=1e-4, abs=1e-6)
    assert metrics[True]["actor/grad_norm"] == pytest.approx(metrics[False]["actor/grad_norm"], rel=1e-3)
    after = {p: g.get_full_state_dict() for p, g in groups.items()}
    assert metrics[False]["actor/grad_norm"] > 1.0  # an update of lr x grad: far above the tolerance below
    gap = max(float((after[True][k] - after[False][k]).abs().max()) for k in after[False])
    assert gap < 1e-5  # the two updated models agree to float noise


def test_smollm2_packed_critic_values_equal_the_padded_path(smollm2_dir):
    data = skewed_batch(smollm2_dir)
    mask = data.batch["response_mask"].bool()
    values = {}
    for packed in (True, False):
        config = {"model": {"path": smollm2_dir, "use_remove_padding": packed}, "critic": {"ppo_micro_batch_size_per_gpu": 6}}
        critic = LocalWorkerGroup(ClassWithInitArgs(CriticWorker, config))
        critic.init_model()  # the value head: seeded alike on both (critic.seed)
        values[packed] = critic.compute_values(data).batch["values"]
    assert float(values[False][mask].abs().max()) > 0.01
    torch.testing.assert_close(values[True][mask], values[False][mask], atol=2e-4, rtol=0)
