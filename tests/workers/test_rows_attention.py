"""Packed attention's rows of CPU flash SDPA with a lean backward (rlcore.workers.rows_attention):
bitwise the plain composition's outputs and gradients, less kept for the backward (counted through
autograd's saved-tensor hooks), used only where it applies, and a whole update unchanged."""

import pytest
import torch

from rlcore.single_controller import ClassWithInitArgs, LocalWorkerGroup
from rlcore.workers import rows_attention, split_rows
from rlcore.workers.actor import ActorWorker
from row_layouts import shared_layout
from rlcore.workers.packing import (ROWS_KEYWORD, RowLayout, _layout_from_cu, _rows, _sdpa, _sdpa_fp32,
                                    packed_attention, packed_eager_attention)
from saved_bytes import saved_bytes


def contiguous_layout() -> tuple[RowLayout, int]:
    """Rows of 3, 1 and 5 tokens, end to end (no shared prompt)."""
    return _layout_from_cu(torch.tensor([0, 3, 4, 9], dtype=torch.int32), 5, 9, torch.device("cpu")), 9


def qkv(n: int, kv_heads: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 32, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, kv_heads, n, 32, generator=g).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v


def lean(q, k, v, layout: RowLayout, scale=0.3):
    return rows_attention.FlashRows.apply(q, k, v, layout.source, layout.take, layout.rows, layout.max_len, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("make_layout", [shared_layout, contiguous_layout])
def test_lean_rows_equal_the_plain_rows_bitwise(dtype, kv_heads, make_layout):
    """Outputs and the gradients of q, k and v (a shared prompt's keys summing both rows') are the very
    bits of ``packing._rows`` through autograd, in bf16 (computed in fp32) and fp32, GQA or not."""
    layout, n = make_layout()
    q, k, v = qkv(n, kv_heads, dtype)
    inner = _sdpa_fp32 if dtype == torch.bfloat16 else _sdpa
    plain = _rows(q, k, v, layout, 0.3, 0.0, inner)
    mine = lean(q, k, v, layout)
    assert mine.dtype == dtype and mine.shape == (1, n, 4, 32)
    assert torch.equal(mine, plain)
    weights = torch.randn(plain.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = torch.autograd.grad(plain, (q, k, v), weights)
    got = torch.autograd.grad(mine, (q, k, v), weights)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous() == w.is_contiguous()
        assert torch.equal(g, w)
    assert want[1].abs().sum() > 0


def test_lean_rows_keep_the_pack_not_its_fp32_rows():
    """bf16, a shared prompt, GQA: the plain rows keep q, k, v and the output in fp32 at every row
    position (3 x 7); the lean ones the pack's own bf16 q, k, v, the fp32 output at its 11 tokens and
    the rows' log-sum-exp (and the two index tensors both keep)."""
    layout, n = shared_layout()
    q, k, v = qkv(n, 2, torch.bfloat16)
    positions, width = layout.rows * layout.max_len, 32
    indices = (layout.source.numel() + layout.take.numel()) * 8
    lse = 4 * positions * 4
    plain = saved_bytes(lambda: _rows(q, k, v, layout, 0.3, 0.0, _sdpa_fp32))
    kept = saved_bytes(lambda: lean(q, k, v, layout))
    assert kept == (4 + 2 + 2) * n * width * 2 + 4 * n * width * 4 + lse + indices
    assert plain == (4 + 2 + 2 + 4) * positions * width * 4 + lse + indices
    assert kept < plain / 2  # here 21 row positions for 11 tokens; SmolLM2's GRPO packs: 6,320 for 2,008


class _Attn(torch.nn.Module):
    sliding_window = None


def test_packed_attention_takes_the_lean_rows_only_where_they_apply():
    """Training on CPU with a layout of contiguous rows: the lean rows (same output); no gradient wanted,
    dropout, or the eager kernel: the plain path. A layout with a shared prompt takes the split rows
    (rlcore.workers.split_rows, tests/workers/test_split_rows.py), with a gradient or without."""
    layout, n = contiguous_layout()
    q, k, v = qkv(n, 2, torch.bfloat16)
    kw = {ROWS_KEYWORD: layout, "scaling": 0.3}
    out, _ = packed_attention(_Attn().train(), q, k, v, None, **kw)
    assert type(out.grad_fn).__name__ == "FlashRowsBackward" and torch.equal(out, lean(q, k, v, layout))
    with torch.no_grad():
        assert torch.equal(packed_attention(_Attn().eval(), q, k, v, None, **kw)[0], out)
    assert not rows_attention.applies(q.detach(), k.detach(), v.detach(), 0.0)
    assert not rows_attention.applies(q, k, v, 0.1)
    eager, _ = packed_eager_attention(_Attn().train(), q, k, v, None, **kw)
    assert type(eager.grad_fn).__name__ != "FlashRowsBackward"
    shared, n = shared_layout()
    q, k, v = qkv(n, 2, torch.bfloat16)
    out, _ = packed_attention(_Attn().train(), q, k, v, None, **{ROWS_KEYWORD: shared, "scaling": 0.3})
    assert type(out.grad_fn).__name__ == "SplitRowsBackward"
    torch.testing.assert_close(out, lean(q, k, v, shared), rtol=0, atol=1e-2)  # bf16 outputs of the same fp32 math


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_bf16_update_with_lean_rows_equals_the_plain_one(checkpointing, tiny_model_dir, make_batch, monkeypatch):
    """The tiny model in bf16 (fp32 weights), shared prompts packed (the split rows switched off: this is
    the rows layout's test), with and without gradient checkpointing (the lean rows run again in its
    recompute): one AdamW update leaves exactly the weights the plain rows leave, with the same loss and
    gradient norm."""
    monkeypatch.setattr(split_rows, "split_index", lambda *args: None)
    data = make_batch(prompt_lens=(5, 5, 3, 5), response_lens=(6, 2, 5, 4), prompt_width=5, response_width=6)
    data.batch["input_ids"][[1, 3], :5] = data.batch["input_ids"][0, :5]  # rows 0, 1, 3 share a prompt
    config = {"model": {"path": tiny_model_dir, "mixed_precision": "bfloat16", "gradient_checkpointing": checkpointing},
              "actor": {"lr": 1e-3, "ppo_micro_batch_size_per_gpu": 4, "skip_zero_advantage_rows": False}}
    results, used, applies = {}, [], rows_attention.applies
    for side in ("lean", "plain"):
        monkeypatch.setattr(rows_attention, "applies",
                            (lambda *args: used.append(applies(*args)) or used[-1]) if side == "lean" else (lambda *args: False))
        wg = LocalWorkerGroup(ClassWithInitArgs(ActorWorker, config), 1)
        wg.init_model()
        assert wg.worker().shares_prompts
        results[side] = (wg.update_policy(data)[0], wg.get_full_state_dict())
    assert used and all(used)  # every attention call of the lean update took the lean rows
    (m_lean, w_lean), (m_plain, w_plain) = results["lean"], results["plain"]
    assert m_lean["actor/loss"] == m_plain["actor/loss"] and m_lean["actor/grad_norm"] == m_plain["actor/grad_norm"]
    assert m_plain["actor/grad_norm"] > 0
    for name in w_plain:
        assert torch.equal(w_lean[name], w_plain[name]), name
