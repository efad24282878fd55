"""A shared-prompt pack's attention on CPU as two flash calls, each row's prompt queries computed once.

Why: the rows layout (``rlcore.workers.packing._rows``, ``rows_attention.FlashRows``) lays every row
out from position 0, so each row that borrows its group's prompt computes the prompt's queries again
and drops them: at SmolLM2's GRPO step (47-token prompts, 32-token responses, 8 rows a group) a
16-row micro-batch runs 16 x 82 query positions for 606 tokens, and attention took ~1.7 s of a 26 s
fp32 update. The query side needs only each token once; the key side needs each row's whole sequence.
So the stored queries of every row are cut in two, with each part's keys gathered from the pack
(the one copy of a prompt read by every row of its group, as the varlen kernel reads it on CUDA:
``rlcore.workers.shared_varlen``):

- the tail: each row's last ``tail`` stored queries at most, ``tail`` the longest a borrowing row
  stores (its response), over the row's whole sequence: (rows, H, tail, D) queries against
  (rows, H_kv, longest row, D) keys, causal aligned bottom-right by an additive mask (query j of a
  row with k keys and t tail queries sees keys 0 .. k - t + j);
- the head: what is left, the queries of the prompts their holders store (and of any row that
  stores more than ``tail`` tokens), over the same positions' keys: plain causal rows from position 0.

Both are torch's CPU flash kernel in fp32 (bf16 packs cast, as the rows layout does), forward and
backward, with the backward keeping only the pack's own q, k, v, the output at its N tokens and the
two calls' log-sum-exp (``FlashRows``'s economy). Measured at SmolLM2's micro-batch shapes: 3.7 ms
against 7.8 ms a layer forward and backward. The numbers are the rows layout's up to the kernels'
summation order (tests/workers/test_split_rows.py compares both with float64 math).

``split_index`` builds the index once per pack (``RowLayout.split``) and returns None where no row
borrows a prompt (nothing to gain: the rows layout runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlcore.workers.rows_attention import flat_rows, rows_of, with_zero_token

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class SplitIndex:
    """Pack indices (N: the zero token behind the pack) of the two calls' slots. Head: ``head`` (rows_h
    * head_len,) queries and keys alike, each row from position 0. Tail: ``tail_q`` (rows_t * tail,)
    queries, ``tail_k`` (rows_t * tail_keys,) keys, ``mask`` (rows_t, 1, tail, tail_keys) fp32 0 / -inf.
    ``take`` (N,): where each pack token's output sits in the head's slots followed by the tail's."""

    head: torch.Tensor
    head_rows: int
    head_len: int
    tail_q: torch.Tensor
    tail_k: torch.Tensor
    mask: torch.Tensor
    tail_rows: int
    tail: int
    tail_keys: int
    take: torch.Tensor


def split_index(source: torch.Tensor, take: torch.Tensor, rows: int, max_len: int) -> SplitIndex | None:
    """The ``SplitIndex`` of a pack from its ``RowLayout`` fields (``source``: each row's pack index at
    each position from 0, N behind its end; ``take``: each pack token's slot in that layout), or None
    where no row borrows its prompt. A row's stored tokens are the tail of its sequence (``pack``
    lays them out so; ``shared_varlen.varlen_index`` checks it, and the caller builds that first)."""
    n = int(take.numel())
    device = take.device
    grid = source.view(rows, max_len)
    keys = (grid < n).sum(1)  # each row's sequence length, a borrowed prompt included
    row = torch.div(take, max_len, rounding_mode="floor")
    stored = torch.bincount(row, minlength=rows)
    borrows = (stored > 0) & (stored < keys)
    if n == 0 or not bool(borrows.any()):
        return None
    tail = int(stored[borrows].max())
    in_tail = torch.minimum(stored, torch.tensor(tail, device=device))
    in_head = stored - in_tail  # > 0 only where a row stores more than ``tail``: from its position 0
    split_at = keys - in_tail  # each row's first tail position
    col = torch.arange(max_len, device=device)

    head_rows = torch.nonzero(in_head > 0).flatten()
    head_len = int(in_head.max())
    head = torch.where(col[:head_len] < in_head[head_rows, None], grid[head_rows, :head_len], n).flatten()

    tail_rows = torch.nonzero(in_tail > 0).flatten()
    tail_keys = int(keys[tail_rows].max())
    j = torch.arange(tail, device=device)
    q_pos = split_at[tail_rows, None] + j  # (rows_t, tail) positions of the tail queries
    tail_q = torch.where(j < in_tail[tail_rows, None], grid[tail_rows].gather(1, q_pos.clamp(max=max_len - 1)), n)
    tail_k = grid[tail_rows, :tail_keys].flatten()
    c = col[:tail_keys]
    seen = (c[None, None, :] <= q_pos[:, :, None]) & (c[None, None, :] < keys[tail_rows, None, None])
    mask = torch.zeros(seen.shape, dtype=torch.float32, device=device).masked_fill_(~seen, float("-inf"))

    # each pack token's output slot: in the head's (row_h * head_len + position) or after them in the tail's
    pos = take - row * max_len
    head_slot = torch.full((rows,), -1, dtype=torch.long, device=device)
    head_slot[head_rows] = torch.arange(head_rows.numel(), device=device)
    tail_slot = torch.full((rows,), -1, dtype=torch.long, device=device)
    tail_slot[tail_rows] = torch.arange(tail_rows.numel(), device=device)
    in_tail_part = pos >= split_at[row]
    slots = torch.where(in_tail_part, head_rows.numel() * head_len + tail_slot[row] * tail + pos - split_at[row],
                        head_slot[row] * head_len + pos)
    return SplitIndex(head=head, head_rows=int(head_rows.numel()), head_len=head_len, tail_q=tail_q.flatten(),
                      tail_k=tail_k, mask=mask.unsqueeze(1), tail_rows=int(tail_rows.numel()), tail=tail,
                      tail_keys=tail_keys, take=slots)


def _calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ix: SplitIndex):
    """The two calls' (q, k, v) in fp32: the head's rows (keys = queries' positions), the tail's."""
    qf, kf, vf = (with_zero_token(t[0].transpose(0, 1)) for t in (q, k, v))
    head = [rows_of(t, ix.head, ix.head_rows, ix.head_len) for t in (qf, kf, vf)] if ix.head_rows else None
    tail = (rows_of(qf, ix.tail_q, ix.tail_rows, ix.tail), rows_of(kf, ix.tail_k, ix.tail_rows, ix.tail_keys),
            rows_of(vf, ix.tail_k, ix.tail_rows, ix.tail_keys))
    return head, tail


class SplitRows(torch.autograd.Function):
    """Causal attention over a shared-prompt pack (``split_index``): q (1, H, N, D), k / v (1, H_kv, N, D),
    any float dtype, computed in fp32; returns (1, N, H, D) in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, ix: SplitIndex, scale: float | None):
        head, tail = _calls(q, k, v, ix)
        parts, lses = [], []
        if head is not None:
            out, lse = _flash(*head, 0.0, True, attn_mask=None, scale=scale)
            parts.append(flat_rows(out))
            lses.append(lse)
        out, lse = _flash(*tail, 0.0, False, attn_mask=ix.mask, scale=scale)
        parts.append(flat_rows(out))
        lses.append(lse)
        packed = torch.cat(parts).index_select(0, ix.take)  # (N, H, D) fp32
        ctx.save_for_backward(q, k, v, packed, *lses)
        ctx.ix, ctx.scale = ix, scale
        return packed.to(q.dtype).unsqueeze(0)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, packed, *lses = ctx.saved_tensors
        ix, scale = ctx.ix, ctx.scale
        head, tail = _calls(q, k, v, ix)
        heads, dim = packed.shape[1], packed.shape[2]
        head_slots = ix.head_rows * ix.head_len
        slots = head_slots + ix.tail_rows * ix.tail
        g = torch.zeros((slots, heads, dim), dtype=torch.float32, device=grad.device)
        g.index_copy_(0, ix.take, grad[0].float())  # each token's output sits in one slot
        out = with_zero_token(packed)  # exact at every slot a gradient reaches
        n = q.shape[2]
        grads = [torch.zeros((n + 1, t.shape[1], dim), dtype=torch.float32, device=t.device) for t in (q, k, v)]

        def add(kind_grads, q_index, kv_index):
            for acc, g_t, index in zip(grads, kind_grads, (q_index, kv_index, kv_index)):
                acc.index_add_(0, index, flat_rows(g_t))

        if head is not None:
            rows_out = rows_of(out, ix.head, ix.head_rows, ix.head_len)
            g_head = g[:head_slots].view(ix.head_rows, ix.head_len, heads, dim).transpose(1, 2)
            add(_flash_backward(g_head, *head, rows_out, lses[0], 0.0, True, attn_mask=None, scale=scale),
                ix.head, ix.head)
        rows_out = rows_of(out, ix.tail_q, ix.tail_rows, ix.tail)
        g_tail = g[head_slots:].view(ix.tail_rows, ix.tail, heads, dim).transpose(1, 2)
        add(_flash_backward(g_tail, *tail, rows_out, lses[-1], 0.0, False, attn_mask=ix.mask, scale=scale),
            ix.tail_q, ix.tail_k)
        result = (acc[:n].transpose(0, 1).unsqueeze(0).to(t.dtype) if wanted else None
                  for acc, t, wanted in zip(grads, (q, k, v), ctx.needs_input_grad[:3]))
        return (*result, None, None)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: torch.Tensor, take: torch.Tensor,
              rows: int, max_len: int, scale: float | None) -> torch.Tensor:
    """The rows layout's attention in plain float64 math (each row's causal softmax over its own
    sequence), (1, N, H, D) in q's dtype: what ``SplitRows`` and the rows layout both compute."""
    sq, sk, sv = (rows_of(with_zero_token(t[0].transpose(0, 1)), source, rows, max_len, torch.float64)
                  for t in (q, k, v))
    if sk.shape[1] != sq.shape[1]:
        sk, sv = (t.repeat_interleave(sq.shape[1] // t.shape[1], dim=1) for t in (sk, sv))
    out = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale)
    return flat_rows(out).index_select(0, take).unsqueeze(0).to(q.dtype)
