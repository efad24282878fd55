"""Packed micro-batches (rlcore.workers.packing, ``model.use_remove_padding``): the pack's layout by
hand, the per-row attention kernel against padded SDPA, and every trained role's outputs and updates
packed against the padded path on the tiny model and the tiny MoE (SmolLM2: tests/real_model)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from rlcore.data.preference import PairDataset, collate_pairs, write_pairs_jsonl
from rlcore.models.tiny import build_tiny_model
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.packing import PACKED_ATTENTION, PACKED_EAGER, pack, packed_attention, packed_eager_attention
from rlcore.workers.reward_model import RewardModelWorker


def test_pack_lays_valid_tokens_end_to_end_with_their_own_positions(make_batch):
    b = make_batch(prompt_lens=(2, 3), response_lens=(1, 2), prompt_width=3, response_width=2).batch
    # row 0: [pad, p, p | r, pad], row 1: [p, p, p | r, r]
    p = pack(b["input_ids"], b["attention_mask"], b["position_ids"])
    ids = b["input_ids"]
    assert p.input_ids.tolist() == [[*ids[0, 1:4].tolist(), *ids[1].tolist()]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert p.cu_seqlens.tolist() == [0, 3, 8] and p.max_len == 5
    assert p.index.tolist() == [1, 2, 3, 5, 6, 7, 8, 9]
    assert p.last_positions().tolist() == [2, 7]
    keep, where = p.response_targets(2)
    # row 0's response token sits at pack index 2, predicted by index 1; row 1's at 6, 7 by 5, 6
    assert where.tolist() == [[True, False], [True, True]] and keep.tolist() == [1, 5, 6]
    assert p.scatter_responses(torch.tensor([1.0, 2.0, 3.0]), where).tolist() == [[1.0, 0.0], [2.0, 3.0]]
    routed = torch.arange(10).reshape(2, 5, 1, 1)
    assert p.gather(routed).flatten().tolist() == [1, 2, 3, 5, 6, 7, 8, 9]


def test_pack_refuses_a_row_with_a_hole():
    mask = torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1]])
    with pytest.raises(ValueError, match="row 1's attention_mask has a hole"):
        pack(torch.ones_like(mask), mask, mask.cumsum(1))


class _Attn(torch.nn.Module):
    sliding_window = None

    def __init__(self, training: bool = False):
        super().__init__()
        self.train(training)


@pytest.mark.parametrize("kernel", [packed_attention, packed_eager_attention])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_equals_per_row_padded_sdpa(kv_heads, kernel):
    """Rows of 3, 1 and 5 tokens in one pack: each row's outputs equal causal SDPA on the row alone,
    so no row sees another's keys (a kernel attending across rows would differ in rows 2 and 3)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 5]
    q = torch.randn(1, 4, sum(lengths), 8, generator=g)
    k, v = (torch.randn(1, kv_heads, sum(lengths), 8, generator=g) for _ in range(2))
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    out, _ = kernel(_Attn(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=5)
    assert out.shape == (1, 9, 4, 8)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        rep = 4 // kv_heads
        ref = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e].repeat_interleave(rep, 1),
                                             v[:, :, s:e].repeat_interleave(rep, 1), is_causal=True, scale=0.3)
        torch.testing.assert_close(out[:, s:e], ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(4 // kv_heads, 1), v.repeat_interleave(4 // kv_heads, 1),
                                           is_causal=True, scale=0.3).transpose(1, 2)
    assert not torch.allclose(out[:, 4:], whole[:, 4:], atol=1e-3)  # the planted fault: one causal sequence


def test_packed_attention_refuses_a_padding_mask():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="without a mask"):
        packed_attention(_Attn(), q, q, q, torch.ones(1, 1, 3, 3, dtype=torch.bool))


# ----------------------------------------------------------------------------- workers, packed vs padded
SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "grad_clip": None, "shuffle": False}
SKEWED = dict(prompt_lens=(5, 1, 4, 2, 3, 5), response_lens=(6, 5, 1, 2, 6, 3), prompt_width=5, response_width=6)


def group(cls, path, packed: bool, section: str, model=None, **train):
    config = {"model": {"path": path, "use_remove_padding": packed, **(model or {})}, section: {**SGD, **train}}
    wg = LocalWorkerGroup(ClassWithInitArgs(cls, config), 1)
    wg.init_model()
    return wg


def assert_close_on(mask, a, b, atol):
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], rtol=0, atol=atol)


def assert_same_metrics(packed: dict, padded: dict, prefix: str) -> None:
    """The update's metrics agree, but for the padding computed: none packed, some padded."""
    assert packed[f"{prefix}/pad_frac_computed"] == 0.0 < padded[f"{prefix}/pad_frac_computed"]
    assert packed[f"{prefix}/pad_frac_batch"] == padded[f"{prefix}/pad_frac_batch"] > 0.3  # SKEWED: 43 of 66 valid
    for key in padded:
        if "pad_frac" not in key:
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


def assert_same_weights(wg_a, wg_b, atol):
    sa, sb = wg_a.get_full_state_dict(), wg_b.get_full_state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe_packing"), arch="qwen3_moe", seed=0)


@pytest.mark.parametrize("arch", ["llama", "moe"])
def test_actor_packed_log_probs_entropies_and_update_equal_the_padded_path(arch, tiny_model_dir, moe_dir, make_batch):
    path = tiny_model_dir if arch == "llama" else moe_dir
    extra = {"moe_aux_loss_coef": 0.1, "moe_z_loss_coef": 0.01} if arch == "moe" else {}
    data = make_batch(**SKEWED)
    mask = data.batch["response_mask"]
    packed = group(ActorWorker, path, True, "actor", ppo_micro_batch_size_per_gpu=4, **extra)
    padded = group(ActorWorker, path, False, "actor", ppo_micro_batch_size_per_gpu=4, **extra)
    assert packed.worker().module.config._attn_implementation == PACKED_ATTENTION
    a, b = packed.compute_log_prob(data).batch, padded.compute_log_prob(data).batch
    assert_close_on(mask, a["old_log_probs"], b["old_log_probs"], 2e-5)
    assert_close_on(mask, a["entropys"], b["entropys"], 2e-5)
    assert float(a["old_log_probs"][mask == 0].abs().max()) == 0.0  # response padding: never computed packed
    metrics_a, metrics_b = packed.update_policy(data)[0], padded.update_policy(data)[0]
    assert_same_metrics(metrics_a, metrics_b, "actor")
    assert metrics_a["actor/grad_norm"] > 0
    assert_same_weights(packed, padded, 1e-5)


def test_actor_packed_eager_equals_padded_eager(tiny_model_dir, make_batch):
    data = make_batch(**SKEWED)
    mask = data.batch["response_mask"]
    eager = {"attn_implementation": "eager"}
    packed = group(ActorWorker, tiny_model_dir, True, "actor", model=eager, ppo_micro_batch_size_per_gpu=6)
    padded = group(ActorWorker, tiny_model_dir, False, "actor", model=eager, ppo_micro_batch_size_per_gpu=6)
    assert packed.worker().module.config._attn_implementation == PACKED_EAGER
    a, b = packed.compute_log_prob(data).batch, padded.compute_log_prob(data).batch
    assert_close_on(mask, a["old_log_probs"], b["old_log_probs"], 2e-5)
    assert_same_metrics(packed.update_policy(data)[0], padded.update_policy(data)[0], "actor")
    assert_same_weights(packed, padded, 1e-5)


def test_actor_packed_row_equals_the_row_alone(tiny_model_dir, make_batch):
    """Packed with five other rows, each row's log-probs equal those of the row scored by itself
    (one-row batches, cropped to its own width): attention stays inside the row."""
    data = make_batch(**SKEWED)
    wg = group(ActorWorker, tiny_model_dir, True, "actor", ppo_micro_batch_size_per_gpu=6)
    together = wg.compute_log_prob(data).batch["old_log_probs"]
    for i in range(len(data)):
        alone = wg.compute_log_prob(data[i:i + 1]).batch["old_log_probs"]
        mask = data.batch["response_mask"][i:i + 1]
        assert_close_on(mask, together[i:i + 1], alone, 1e-5)
    # and a pack of one row equals the padded path's row
    padded = group(ActorWorker, tiny_model_dir, False, "actor", ppo_micro_batch_size_per_gpu=6)
    row = data[1:2]
    assert_close_on(row.batch["response_mask"], wg.compute_log_prob(row).batch["old_log_probs"],
                    padded.compute_log_prob(row).batch["old_log_probs"], 1e-5)


def test_critic_packed_values_and_update_equal_the_padded_path(tiny_model_dir, make_batch):
    data = make_batch(**SKEWED)
    mask = data.batch["response_mask"]
    packed = group(CriticWorker, tiny_model_dir, True, "critic", ppo_micro_batch_size_per_gpu=4)
    padded = group(CriticWorker, tiny_model_dir, False, "critic", ppo_micro_batch_size_per_gpu=4)
    va, vb = packed.compute_values(data).batch["values"], padded.compute_values(data).batch["values"]
    assert_close_on(mask, va, vb, 2e-5)
    assert float(va.abs().max()) > 0
    data.batch["values"] = vb
    data.batch["returns"] = vb + torch.randn(vb.shape, generator=torch.Generator().manual_seed(1)) * mask
    ma, mb = packed.update_critic(data)[0], padded.update_critic(data)[0]
    assert_same_metrics(ma, mb, "critic")
    assert_same_weights(packed, padded, 1e-5)


def test_dynamic_token_budget_micro_batches_pack_and_train_like_fixed_rows(tiny_model_dir, make_batch):
    """Micro-batches by token count (use_dynamic_bsz) packed: the same update as one padded micro-batch."""
    data = make_batch(**SKEWED)
    packed = group(ActorWorker, tiny_model_dir, True, "actor", use_dynamic_bsz=True, ppo_max_token_len_per_gpu=16)
    padded = group(ActorWorker, tiny_model_dir, False, "actor", ppo_micro_batch_size_per_gpu=6)
    assert len(packed.worker().micro_batches(data)) >= 3  # 51 tokens, budget 16
    ma, mb = packed.update_policy(data)[0], padded.update_policy(data)[0]
    assert ma["actor/loss"] == pytest.approx(mb["actor/loss"], rel=1e-4)
    assert_same_weights(packed, padded, 1e-5)


def test_reward_model_packed_pair_scores_and_update_equal_the_padded_path(tiny_model_dir, tmp_path):
    """Pair rows (B, 2, T) of different lengths: Bradley-Terry scores and one SGD step, packed vs padded."""
    pairs = [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}, {"prompt": "12+3=", "chosen": "15", "rejected": ""},
             {"prompt": "7+7=", "chosen": "14", "rejected": "41"}]
    ds = PairDataset(write_pairs_jsonl(tmp_path / "p.jsonl", pairs), AutoTokenizer.from_pretrained(tiny_model_dir))
    data = DataProto.from_dict(*collate_pairs([ds[i] for i in range(len(ds))], 0))
    groups = {}
    for packed in (True, False):
        config = {"model": {"path": tiny_model_dir, "use_remove_padding": packed},
                  "reward_model": {**SGD, "ppo_micro_batch_size_per_gpu": 3}}
        groups[packed] = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, config, trainable=True), 1)
        groups[packed].init_model()
    scores = {p: g.compute_pair_scores(data).batch for p, g in groups.items()}
    for key in ("chosen_scores", "rejected_scores"):
        torch.testing.assert_close(scores[True][key], scores[False][key], atol=2e-5, rtol=0)
    metrics = {p: g.update_rm(data)[0] for p, g in groups.items()}
    assert metrics[True]["rm/loss"] == pytest.approx(metrics[False]["rm/loss"], rel=1e-5)
    assert metrics[False]["rm/grad_norm"] > 0
    assert_same_weights(groups[True], groups[False], 1e-5)


def test_packed_attention_in_bf16_on_cpu_computes_in_fp32_and_returns_bf16():
    """bf16 q/k/v on CPU: SDPA runs in fp32 (faster there, rlcore.workers.packing._sdpa_fp32); the
    result is the fp32 one rounded to bf16, not bf16 SDPA's own."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 7, 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    exact, _ = packed_attention(_Attn(), q, k, v, None, cu_seq_lens_q=cu, max_length_q=4)
    low, _ = packed_attention(_Attn(), q.bfloat16(), k.bfloat16(), v.bfloat16(), None, cu_seq_lens_q=cu, max_length_q=4)
    assert low.dtype == torch.bfloat16
    reference, _ = packed_attention(_Attn(), q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), None,
                                    cu_seq_lens_q=cu, max_length_q=4)
    assert torch.equal(low, reference.bfloat16())
    torch.testing.assert_close(low.float(), exact, atol=0.05, rtol=0)


def test_a_micro_batch_without_response_tokens_packs_to_nothing_to_score(tiny_model_dir, make_batch):
    """Row 0's response is empty and, one row per micro-batch, its micro-batch scores no token: zero
    outputs, and the update (every row run) equals the padded one."""
    data = make_batch(prompt_lens=(3, 2), response_lens=(0, 2), prompt_width=3, response_width=2)
    runs = {p: group(ActorWorker, tiny_model_dir, p, "actor", ppo_micro_batch_size_per_gpu=1,
                     skip_zero_advantage_rows=False) for p in (True, False)}
    out = runs[True].compute_log_prob(data).batch["old_log_probs"]
    assert out[0].abs().max() == 0 and out[1].abs().min() > 0
    assert_same_metrics(runs[True].update_policy(data)[0], runs[False].update_policy(data)[0], "actor")
    assert_same_weights(runs[True], runs[False], 1e-5)
