"""A shared-prompt pack's CPU attention as two flash calls (rlcore.workers.split_rows): outputs and
gradients against float64 math on each whole row, over layouts with unequal prompts and responses,
groups of one, empty responses and holders that store more than a borrower; what its backward keeps;
and an update through it against the rows layout's."""

import pytest
import torch

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers import split_rows
from rlcore.workers.actor import ActorWorker
from rlcore.workers.packing import pack
from rlcore.workers.rows_attention import FlashRows
from row_layouts import shared_layout
from saved_bytes import saved_bytes

WIDTH = 8  # prompt columns of the packed batches below


def grouped(prompt_lens, response_lens, seed=0):
    """One row per (prompt group, response length): ``prompt_lens[g]`` tokens of group g's prompt, left-padded
    to WIDTH, then the row's response, right-padded; packed with shared prompts."""
    g = torch.Generator().manual_seed(seed)
    width = WIDTH + max(max(r) for r in response_lens)
    ids, mask = [], []
    for p, responses in zip(prompt_lens, response_lens):
        prompt = torch.randint(3, 60, (p,), generator=g)
        for r in responses:
            row, m = torch.zeros(width, dtype=torch.long), torch.zeros(width, dtype=torch.long)
            row[WIDTH - p:WIDTH], m[WIDTH - p:WIDTH] = prompt, 1
            row[WIDTH:WIDTH + r], m[WIDTH:WIDTH + r] = torch.randint(3, 60, (r,), generator=g), 1
            ids.append(row)
            mask.append(m)
    ids, mask = torch.stack(ids), torch.stack(mask)
    packed = pack(ids, mask, (mask.cumsum(1) - 1).clamp(min=0), prompt_width=WIDTH)
    return packed.layout, packed.num_tokens


LAYOUTS = {
    "hand-written": shared_layout,  # the holder stores a shorter response than its borrower: its head is 1 query
    "equal groups": lambda: grouped([7, 7], [[4, 4, 4], [4, 4, 4]]),
    "unequal": lambda: grouped([7, 3, 5], [[5, 1, 3], [2, 5], [4]]),  # a group of one row: no borrower there
    "empty responses": lambda: grouped([6, 4], [[3, 0, 2], [0, 0, 5]]),
}


def qkv(n, kv_heads, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, kv_heads, n, 16, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_equal_each_whole_rows_attention(name, kv_heads, dtype):
    layout, n = LAYOUTS[name]()
    index = layout.split
    assert index is not None
    q, k, v = qkv(n, kv_heads, dtype)
    want = split_rows.reference(q, k, v, layout.source, layout.take, layout.rows, layout.max_len, 0.3)
    got = split_rows.SplitRows.apply(q, k, v, index, 0.3)
    assert got.dtype == dtype and got.shape == (1, n, 4, 16)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    for g, w, t in zip(torch.autograd.grad(got, (q, k, v), weights), torch.autograd.grad(want, (q, k, v), weights),
                       (q, k, v)):
        assert g.dtype == t.dtype and g.shape == t.shape
        torch.testing.assert_close(g, w, rtol=0, atol=5 * tol)
        assert w.abs().sum() > 0


def test_the_split_of_a_pack_of_groups():
    """Two groups of 7-token prompts and three 4-token responses: the holders' prompts are the head (2 rows
    of 7 queries, causal from position 0), every response the tail (6 rows of 4 queries over 11 keys,
    the prompt's keys read from the holder's tokens); no row borrows: no split."""
    layout, n = LAYOUTS["equal groups"]()
    ix = layout.split
    assert (ix.head_rows, ix.head_len, ix.tail_rows, ix.tail, ix.tail_keys) == (2, 7, 6, 4, 11)
    assert ix.head.view(2, 7).tolist() == [list(range(7)), list(range(19, 26))]
    assert ix.tail_k.view(6, 11)[1].tolist() == list(range(7)) + [11, 12, 13, 14]  # row 1: group 0's prompt, its own
    allowed = ix.mask[1, 0] == 0
    assert allowed.sum(1).tolist() == [8, 9, 10, 11]  # bottom-right causal: the prompt and its response so far
    slots = ix.head_rows * ix.head_len + ix.tail_rows * ix.tail
    assert len(set(ix.take.tolist())) == n and int(ix.take.max()) < slots  # each token's output in a slot of its own
    contiguous, _ = grouped([3, 4], [[2], [3]])
    assert contiguous.split is None


def test_split_rows_keep_the_pack_not_its_rows():
    """bf16, GQA: the backward keeps the pack's own q, k, v, the fp32 output at its tokens and the two
    calls' log-sum-exp, no more than the lean rows keep."""
    layout, n = LAYOUTS["equal groups"]()
    q, k, v = qkv(n, 2, torch.bfloat16)
    ix = layout.split
    kept = saved_bytes(lambda: split_rows.SplitRows.apply(q, k, v, ix, 0.3))
    lse = 4 * 4 * (ix.head_rows * ix.head_len + ix.tail_rows * ix.tail)
    assert kept == (4 + 2 + 2) * n * 16 * 2 + 4 * n * 16 * 4 + lse
    rows = saved_bytes(lambda: FlashRows.apply(q, k, v, layout.source, layout.take, layout.rows, layout.max_len, 0.3))
    assert kept < rows


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_update_with_split_rows_equals_one_with_the_rows_layout(checkpointing, tiny_model_dir, make_batch,
                                                                  monkeypatch):
    """The tiny model in fp32, rows 0, 1 and 3 sharing a prompt, with and without gradient checkpointing (the
    split rows run again in its recompute): one AdamW update through the split rows leaves the weights where
    the rows layout leaves them, to fp32 rounding (through the first AdamW step)."""
    data = make_batch(prompt_lens=(5, 5, 3, 5), response_lens=(6, 2, 5, 4), prompt_width=5, response_width=6)
    data.batch["input_ids"][[1, 3], :5] = data.batch["input_ids"][0, :5]
    config = {"model": {"path": tiny_model_dir, "gradient_checkpointing": checkpointing}, "actor": {"lr": 1e-3, "ppo_micro_batch_size_per_gpu": 4,
                                                         "skip_zero_advantage_rows": False}}
    results, calls, split_index = {}, [], split_rows.split_index
    for side in ("split", "rows"):
        monkeypatch.setattr(split_rows, "split_index", (lambda *a: calls.append(1) or split_index(*a))
                            if side == "split" else (lambda *a: None))
        wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), 1)
        wg.init_model()
        results[side] = (wg.update_policy(data)[0], wg.get_full_state_dict())
    assert calls  # the split side built its index
    (m_split, w_split), (m_rows, w_rows) = results["split"], results["rows"]
    assert m_split["actor/loss"] == pytest.approx(m_rows["actor/loss"], rel=1e-5, abs=1e-7)
    assert m_split["actor/grad_norm"] == pytest.approx(m_rows["actor/grad_norm"], rel=1e-5) and m_rows["actor/grad_norm"] > 0
    for name in w_rows:
        torch.testing.assert_close(w_split[name], w_rows[name], rtol=0, atol=1e-5)  # AdamW steps of lr 1e-3
