"""Packs that hold a shared prompt once (``model.pack_shared_prompts``, rlcore.workers.packing): the
layout by hand, the attention kernel against SDPA on each whole row, micro-batches that keep a
group together, and the actor's and critic's outputs and updates against the padded path."""

import pytest
import torch
import torch.nn.functional as F

from rlcore.models.config import ModelConfig
from rlcore.protocol import DataProto
from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers.actor import ActorWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.fsdp_utils import micro_batch_indices
from rlcore.workers.packing import (ROWS_KEYWORD, RowLayout, group_items, pack, packed_attention, prompt_groups,
                                    shares_prompts)

# Six rows of three prompt groups, interleaved: rows 0, 2, 4 share one prompt (5 tokens), rows 1, 3 another
# (3 tokens), row 5 is alone; row 4's response is empty.
PROMPT_LENS, RESPONSE_LENS, HOLDERS = (5, 3, 5, 3, 5, 2), (6, 5, 1, 2, 0, 3), (0, 1, 0, 1, 0, 5)


def grouped_batch(make_batch) -> DataProto:
    data = make_batch(prompt_lens=PROMPT_LENS, response_lens=RESPONSE_LENS, prompt_width=5, response_width=6)
    b = data.batch
    for row, holder in enumerate(HOLDERS):
        b["prompts"][row] = b["prompts"][holder]
        b["input_ids"][row, :5] = b["input_ids"][holder, :5]
    return data


def test_a_pack_holds_each_shared_prompt_once_and_rows_read_it_from_its_holder(make_batch):
    b = make_batch(prompt_lens=(2, 2, 1), response_lens=(1, 2, 1), prompt_width=2, response_width=2).batch
    b["input_ids"][1, :2] = b["input_ids"][0, :2]  # rows 0 and 1: [p0 p1 | r ...]; row 2: [pad q | r pad]
    ids = b["input_ids"]
    p = pack(ids, b["attention_mask"], b["position_ids"], prompt_width=2)
    assert p.shared
    # pack: row 0's prompt and response, row 1's response only, row 2 whole
    assert p.input_ids.tolist() == [[*ids[0, :3].tolist(), *ids[1, 2:].tolist(), *ids[2, 1:3].tolist()]]
    assert p.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1]]
    assert p.slot.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [-1, 5, 6, -1]]
    # attention's rows: row 1 reads the prompt at pack 0, 1; 7 marks the fill behind a row's end
    assert p.layout.rows == 3 and p.layout.max_len == 4
    assert p.layout.source.view(3, 4).tolist() == [[0, 1, 2, 7], [0, 1, 3, 4], [5, 6, 7, 7]]
    assert p.layout.take.tolist() == [0, 1, 2, 6, 7, 8, 9]  # each token's output read from the row that stores it
    # the response tokens are predicted by the token before: row 1's first by the shared prompt's last
    keep, where = p.response_targets(2)
    assert keep.tolist() == [1, 1, 3, 5] and where.tolist() == [[True, False], [True, True], [True, False]]
    kwargs = p.model_kwargs()
    assert kwargs[ROWS_KEYWORD] is p.layout and "cu_seq_lens_q" not in kwargs  # rows are not contiguous
    # without prompt_width, or when no prompt repeats: contiguous rows, as before
    for plain in (pack(ids, b["attention_mask"], b["position_ids"]),
                  pack(ids[[0, 2]], b["attention_mask"][[0, 2]], b["position_ids"][[0, 2]], prompt_width=2)):
        assert not plain.shared and "cu_seq_lens_q" in plain.model_kwargs()


class _Attn(torch.nn.Module):
    sliding_window = None
    training = False


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_over_a_shared_prompt_equals_sdpa_on_each_whole_row(kv_heads):
    """A prompt of 3 tokens shared by responses of 2 and 4 tokens, then a row of 2 alone: each token's
    output equals causal SDPA over its own whole row (prompt + its response), in value and gradient."""
    g = torch.Generator().manual_seed(0)
    n = 3 + 2 + 4 + 2  # the pack: prompt, response a, response b, the lone row
    q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, 8, generator=g, requires_grad=True) for _ in range(2))
    rows = [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6, 7, 8], [9, 10]]  # each row's pack indices, in order
    source = torch.full((3, 7), n)
    for r, ix in enumerate(rows):
        source[r, :len(ix)] = torch.tensor(ix)
    take = torch.tensor([0, 1, 2, 3, 4, 7 + 3, 7 + 4, 7 + 5, 7 + 6, 14, 15])
    layout = RowLayout(source=source.flatten(), take=take, rows=3, max_len=7)
    out, _ = packed_attention(_Attn(), q, k, v, None, **{ROWS_KEYWORD: layout})
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    reference = torch.zeros(1, n, 4, 8)
    owned = [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    for ix, mine in zip(rows, owned):
        sub = [t[:, :, ix] for t in (q, k, v)]
        row_out = F.scaled_dot_product_attention(*sub, is_causal=True, enable_gqa=kv_heads != 4).transpose(1, 2)
        reference[0, mine] = row_out[0, len(ix) - len(mine):]
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    for got, want in zip(grads, expected):  # the shared prompt's keys and values sum both rows' gradients
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_micro_batches_keep_a_prompt_group_together(make_batch):
    data = grouped_batch(make_batch)
    assert [g.tolist() for g in prompt_groups(data.batch)] == [[0, 2, 4], [1, 3], [5]]
    fixed = micro_batch_indices(data, 3, False, 0, share_prompts=True)
    assert [ix.tolist() for ix in fixed] == [[0, 2, 4], [1, 3, 5]]
    assert [ix.tolist() for ix in micro_batch_indices(data, 3, False, 0)] == [[0, 1, 2], [3, 4, 5]]
    # a token budget counts a group's prompt once: group 0 costs 5 + 6 + 1 + 0 = 12, group 1 3 + 5 + 2 = 10,
    # the lone row 5; a budget of 12 holds group 0 whole, where its rows alone would need 11 + 6 + 5 = 22
    dynamic = micro_batch_indices(data, 0, True, 12, share_prompts=True)
    assert sorted(sorted(ix.tolist()) for ix in dynamic) == [[0, 2, 4], [1, 3], [5]]
    # a group over the budget is cut, each part starting again from the prompt: 5 + 6 | 5 + 1 + 0
    assert [(ix.tolist(), cost) for ix, cost in zip(*group_items(data.batch, prompt_groups(data.batch), 11))] == [
        ([0], 11), ([2, 4], 6), ([1, 3], 10), ([5], 5)]
    cut = micro_batch_indices(data, 0, True, 11, share_prompts=True)
    assert [ix.tolist() for ix in cut] == [[0], [1, 3], [2, 4, 5]]  # first-fit decreasing over those items


SGD = {"optimizer": "sgd", "lr": 0.5, "weight_decay": 0.0, "grad_clip": None, "shuffle": False}


def group(cls, path, section, packed=True, share=True, **train):
    config = {"model": {"path": path, "use_remove_padding": packed, "pack_shared_prompts": share},
              section: {**SGD, **train}}
    wg = LocalWorkerGroup(ClassWithInitArgs(cls, config), 1)
    wg.init_model()
    return wg


def weights_gap(a, b) -> float:
    sa, sb = a.get_full_state_dict(), b.get_full_state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("micro,tokens", [(3, 27), (2, 35), (6, 27)])
def test_actor_with_shared_prompts_scores_and_updates_like_the_padded_path(micro, tokens, tiny_model_dir, make_batch):
    """Micro-batches of 3 hold the groups whole, of 2 cut group 0 ([0, 2], [4, 1], [3, 5]), of 6 hold
    all: log-probs, entropies and one SGD update equal the padded path's, and the packs hold each
    group's prompt once per micro-batch (40 valid tokens; prompts of 5 and 3 saved twice and once,
    or once only when cut)."""
    data = grouped_batch(make_batch)
    mask = data.batch["response_mask"].bool()
    rows = {"ppo_micro_batch_size_per_gpu": micro, "skip_zero_advantage_rows": False}  # row 4 (no response) too
    shared = group(ActorWorker, tiny_model_dir, "actor", **rows)
    padded = group(ActorWorker, tiny_model_dir, "actor", packed=False, **rows)
    assert shared.worker().shares_prompts
    b = data.batch
    assert sum(pack(b["input_ids"][ix], b["attention_mask"][ix], b["position_ids"][ix], prompt_width=5).num_tokens
               for ix in shared.worker().micro_batches(data)) == tokens
    a, p = shared.compute_log_prob(data).batch, padded.compute_log_prob(data).batch
    for key in ("old_log_probs", "entropys"):
        torch.testing.assert_close(a[key][mask], p[key][mask], atol=2e-5, rtol=0)
    ma, mp = shared.update_policy(data)[0], padded.update_policy(data)[0]
    assert ma["actor/shared_prompt_frac"] == pytest.approx(1 - tokens / 40) and "actor/shared_prompt_frac" not in mp
    assert ma["actor/loss"] == pytest.approx(mp["actor/loss"], rel=1e-5, abs=1e-7)
    assert ma["actor/grad_norm"] == pytest.approx(mp["actor/grad_norm"], rel=1e-5) and mp["actor/grad_norm"] > 1
    assert weights_gap(shared, padded) < 1e-5


def test_critic_with_shared_prompts_values_and_updates_like_the_padded_path(tiny_model_dir, make_batch):
    data = grouped_batch(make_batch)
    mask = data.batch["response_mask"].bool()
    shared = group(CriticWorker, tiny_model_dir, "critic", ppo_micro_batch_size_per_gpu=3)
    padded = group(CriticWorker, tiny_model_dir, "critic", packed=False, ppo_micro_batch_size_per_gpu=3)
    va, vp = shared.compute_values(data).batch["values"], padded.compute_values(data).batch["values"]
    torch.testing.assert_close(va[mask], vp[mask], atol=2e-5, rtol=0)
    data.batch["values"] = vp
    data.batch["returns"] = vp + torch.randn(vp.shape, generator=torch.Generator().manual_seed(1)) * mask
    ma, mp = shared.update_critic(data)[0], padded.update_critic(data)[0]
    assert ma["critic/loss"] == pytest.approx(mp["critic/loss"], rel=1e-5)
    assert weights_gap(shared, padded) < 1e-5


def test_shared_prompts_only_where_exact():
    assert shares_prompts(ModelConfig(path="m"))
    assert not shares_prompts(ModelConfig(path="m", pack_shared_prompts=False))
    assert not shares_prompts(ModelConfig(path="m", use_remove_padding=False))
    assert not shares_prompts(ModelConfig(path="m", attn_implementation="flash_attention_2"))  # reads contiguous rows
    assert not shares_prompts(ModelConfig(path="m"), moe=object())  # router losses count every row's tokens
