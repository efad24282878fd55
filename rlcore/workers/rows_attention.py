"""Rows of CPU flash SDPA over a pack, keeping for the backward only what the pack itself holds.

Why: ``rlcore.workers.packing._rows`` lays each row of a pack out from position 0 (a shared prompt
again in every row that reads it, zeros behind a row's end) and, for bf16 on CPU, casts the rows to
fp32 for the faster fp32 kernel. Run through autograd, SDPA then keeps its inputs and output as it
saw them: q, k, v and the output in fp32, at (rows x longest row) positions, in every layer. On the
SmolLM2 preset's GRPO step (80 rows of a 47-token prompt and 8-32 response tokens: 2,008 tokens packed,
6,320 row positions) that was 39 MB a layer, 1.1 GiB over 30 layers: the largest thing the update held
(docs/real_models.md, "Memory"). ``FlashRows`` makes the same kernel call and keeps instead the pack's
own q, k and v (the tensors handed in, bf16: no copy), the output in fp32 at the pack's tokens only and
the rows' log-sum-exp: 4.3 KB a token and layer against 19.5. Its backward lays the rows out again
(three gathers and casts, cheap next to the kernel) and calls the kernel's backward with the tensors
autograd would have handed it, so the gradients are bitwise those of the plain composition
(tests/workers/test_rows_attention.py). The one input that differs is the output at the positions
whose gradient is zero (the fill behind a row's end, a borrowed prompt's repeated queries): the
kernel reads the output only through sum(dO * O) per query, zero there whatever O is.

Used where the plain path would run torch's CPU flash kernel with no dropout while gradients are
wanted (``applies``); elsewhere (eager math, dropout, CUDA, inference) ``packing._rows`` runs as before.
"""

from __future__ import annotations

import torch

_FLASH = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> bool:
    """Whether ``FlashRows`` stands in for the plain rows: CPU, no dropout, a gradient wanted, and
    SDPA itself would pick the flash kernel for these rows (fp32 rows of this head size, GQA included)."""
    if q.device.type != "cpu" or dropout or not torch.is_grad_enabled():
        return False
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    return flash_chosen(q, k)


def flash_chosen(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether SDPA picks its flash kernel for fp32 rows of these heads (head size, GQA) on q's device."""
    probe = [t.new_empty((1, t.shape[1], 2, t.shape[3]), dtype=torch.float32) for t in (q, k, k)]
    return torch._fused_sdp_choice(*probe, None, 0.0, True, scale=None, enable_gqa=q.shape[1] != k.shape[1]) == _FLASH


def with_zero_token(flat: torch.Tensor) -> torch.Tensor:
    """(N, H, D) -> (N + 1, H, D): a pack's tokens, then the zero token that fills a row behind its end."""
    return torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])


def rows_of(flat: torch.Tensor, index: torch.Tensor, rows: int, length: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N + 1, H, D) -> (rows, H, length, D) in ``dtype``: the tokens at ``index``, ``length`` a row."""
    return flat.index_select(0, index).view(rows, length, *flat.shape[1:]).transpose(1, 2).to(dtype)


def flat_rows(out: torch.Tensor) -> torch.Tensor:
    """(rows, H, L, D) -> (rows * L, H, D): rows of a kernel's output, position after position."""
    return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])


def _spread(t: torch.Tensor, source: torch.Tensor, rows: int, max_len: int) -> torch.Tensor:
    """(1, H, N, D) -> (rows, H, max_len, D) in fp32: each row's tokens from position 0 (``source``;
    index N is the zero token behind a row's end), as ``packing._rows`` lays them out."""
    return rows_of(with_zero_token(t[0].transpose(0, 1)), source, rows, max_len)


def _spread_backward(grad: torch.Tensor, dtype: torch.dtype, source: torch.Tensor, n: int) -> torch.Tensor:
    """The gradient of ``_spread`` as autograd computes it, step by step: the cast back, the view,
    the gather's index_add (duplicate indices: a shared prompt's keys sum every row's), the zero
    token dropped, and the (1, H, N, D) result written into zeros like ``select``'s backward."""
    g = grad.to(dtype).transpose(1, 2)
    g = g.reshape(-1, *g.shape[2:])  # (rows * max_len, H, D)
    flat = torch.zeros((n + 1, *g.shape[1:]), dtype=dtype, device=g.device).index_add_(0, source, g)
    out = torch.zeros((1, g.shape[1], n, g.shape[2]), dtype=dtype, device=g.device)
    out[0].copy_(flat.narrow(0, 0, n).transpose(0, 1))
    return out


class FlashRows(torch.autograd.Function):
    """Causal attention over a pack's rows (``RowLayout``'s ``source`` / ``take``), q (1, H, N, D), k / v
    (1, H_kv, N, D), any float dtype, computed by the CPU flash kernel in fp32; returns (1, N, H, D)
    in q's dtype, the same values as ``packing._rows`` with ``_sdpa`` / ``_sdpa_fp32`` inside."""

    @staticmethod
    def forward(ctx, q, k, v, source, take, rows: int, max_len: int, scale: float | None):
        n = q.shape[2]
        out, lse = torch._scaled_dot_product_flash_attention_for_cpu(
            *(_spread(t, source, rows, max_len) for t in (q, k, v)), 0.0, True, attn_mask=None, scale=scale)
        packed = flat_rows(out).index_select(0, take)
        ctx.save_for_backward(q, k, v, packed, lse, source, take)
        ctx.shape = (rows, max_len, n, scale)
        return packed.to(q.dtype).unsqueeze(0)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, packed, lse, source, take = ctx.saved_tensors
        rows, max_len, n, scale = ctx.shape
        heads, dim = packed.shape[1], packed.shape[2]
        # the output's gradient back through index_select(take), the reshape and the cast to q's dtype
        g = torch.zeros((rows * max_len, heads, dim), dtype=grad.dtype, device=grad.device)
        g.index_add_(0, take, grad[0])
        g_out = g.view(rows, max_len, heads, dim).transpose(1, 2).to(torch.float32)
        # the output in rows again: exact where the gradient is not zero (the tokens the pack stores)
        out = rows_of(with_zero_token(packed), source, rows, max_len)
        spread = [_spread(t, source, rows, max_len) for t in (q, k, v)]
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g_out, *spread, out, lse, 0.0, True, attn_mask=None, scale=scale)
        grads = (_spread_backward(g_t, t.dtype, source, n) if wanted else None
                 for g_t, t, wanted in zip((gq, gk, gv), (q, k, v), ctx.needs_input_grad[:3]))
        return (*grads, None, None, None, None, None)
