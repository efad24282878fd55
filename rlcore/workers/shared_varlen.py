"""Shared-prompt packs as one varlen attention call, with separate query and key boundaries.

Why: a pack that holds each GRPO group's prompt once (``model.pack_shared_prompts``,
rlcore.workers.packing) has rows that are not contiguous: a row that borrows its prompt stores only
its response, and its queries must still see the prompt's keys. The rows path (``packing._rows``)
lays every row out again, prompt included, and runs batched causal SDPA over (rows x longest row):
exact, but on CUDA it computes each borrowed prompt's queries again (then drops them) and pads every
row to the longest. A varlen kernel that takes the query boundaries and the key boundaries apart
(flash-attention's ``cu_seqlens_q`` / ``cu_seqlens_k``; torch's ``torch.nn.attention.varlen.varlen_attn``)
needs neither:

- queries: the pack's N tokens as they are, cut into segments at the rows' stored tokens (a holder
  row: its prompt and response; a borrowing row: its response only), ``cu_q``;
- keys and values: per segment, the row's whole sequence, [its group's prompt + its own tokens],
  gathered from the pack (``kv_source``: the one copy of the prompt is read by every row of the group,
  and the gather's backward sums their gradients into it), ``cu_k``;
- causality aligned bottom-right (flash-attention >= 2.1, and torch's ``window_size=(-1, 0)``): query
  i of a segment of Lq queries over Lk keys sees keys 0 .. i + Lk - Lq, i.e. the whole prompt and
  its own response up to itself, because a segment's queries are the last Lq of its row's keys.

``varlen_index`` builds that index from a pack's ``RowLayout`` (once per pack, not per layer);
``shared_varlen_attention`` runs it through a kernel with ``varlen_attn``'s signature: torch's on
CUDA, ``reference_varlen_attn`` (the same semantics in plain per-segment math) in the tests on CPU.
``choose_kernel`` says which kernel a pack's attention would take here and, when it is not varlen,
why; ``KERNEL_CALLS`` counts the attention calls per kernel actually run in this process, so a
benchmark can report what ran instead of what was meant to.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # torch >= 2.9: flash-attention's varlen kernel (CUDA only)
    from torch.nn.attention.varlen import varlen_attn as VARLEN_ATTN
except ImportError:  # pragma: no cover - older torch
    VARLEN_ATTN = None

SHARED_VARLEN = "varlen_shared"  # torch varlen_attn over a shared-prompt pack (cu_q != cu_k)
VARLEN = "varlen"  # torch varlen_attn over contiguous rows (cu_q == cu_k)
ROWS_SDPA = "rows_sdpa"  # batched causal SDPA over the pack's rows laid side by side (packing._rows)
SPLIT_ROWS = "rows_split"  # CPU: a shared-prompt pack as two flash calls, each prompt's queries once (split_rows)
ROWS_EAGER = "rows_eager"  # the same with eager math (model.attn_implementation=eager)
UNPACKED = "unpacked"  # no pack: one causal call over the sequence
KERNEL_CALLS: Counter = Counter()  # attention calls per kernel run in this process (one per layer per forward)


@dataclass(frozen=True)
class VarlenIndex:
    """The varlen call's index over a pack of N tokens. ``kv_source`` (Nk,): the pack index of each
    key/value, segment after segment (a segment: one row's whole sequence, borrowed prompt first);
    ``cu_q`` / ``cu_k`` (S + 1,) int32: the query segments' boundaries in the pack and the key segments'
    in ``kv_source``; ``max_q`` / ``max_k``: the longest of each."""

    kv_source: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def stored_tails(source: torch.Tensor, take: torch.Tensor, rows: int, max_len: int) -> bool:
    """Whether a pack (its ``RowLayout`` fields, as ``varlen_index`` takes them) stores each row's tokens
    contiguously, rows in order, and as the tail of the row's sequence: how both the varlen call and the
    CPU split rows (``rlcore.workers.split_rows``) read a row's queries against its keys."""
    n = int(take.numel())
    if not n:
        return True
    lk = (source.view(rows, max_len) < n).sum(1)
    row = torch.div(take, max_len, rounding_mode="floor")
    lq = torch.bincount(row, minlength=rows)
    start = F.pad(lq.cumsum(0), (1, 0))[:-1]  # each row's first query in the pack
    expected = (lk - lq)[row] + torch.arange(n, device=take.device) - start[row]
    return not bool((row.diff() < 0).any()) and torch.equal(take - row * max_len, expected)


def varlen_index(source: torch.Tensor, take: torch.Tensor, rows: int, max_len: int) -> VarlenIndex:
    """The ``VarlenIndex`` of a pack from its ``RowLayout`` fields: ``source`` (rows * max_len,) each
    row's token at each position from 0 (N behind the row's end), ``take`` (N,) where each pack token
    sits in that layout. Rows that store no token (a borrowed prompt with an empty response) have no
    query and are left out. Refuses a layout the varlen call would read wrong: stored tokens out of
    row order, or a row's stored tokens that are not the tail of its sequence."""
    if not stored_tails(source, take, rows, max_len):
        raise ValueError("varlen_index: a row's stored tokens are not contiguous in the pack or not the tail "
                         "of its sequence; this pack cannot run as one varlen call")
    n = int(take.numel())
    grid = source.view(rows, max_len)
    has_key = grid < n  # a prefix of each row (tokens from position 0, then the fill)
    lk = has_key.sum(1)
    lq = torch.bincount(torch.div(take, max_len, rounding_mode="floor"), minlength=rows)
    keep = lq > 0
    cu_q = F.pad(lq[keep].cumsum(0), (1, 0))
    cu_k = F.pad(lk[keep].cumsum(0), (1, 0))
    return VarlenIndex(kv_source=grid[keep][has_key[keep]], cu_q=cu_q.to(torch.int32), cu_k=cu_k.to(torch.int32),
                       max_q=int(lq.max()) if n else 0, max_k=int(lk[keep].max()) if n else 0)


def shared_varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, index: VarlenIndex,
                            scale: float | None, kernel=None) -> torch.Tensor:
    """Causal attention of a shared-prompt pack in one varlen call: ``query`` (1, H, N, D), ``key`` /
    ``value`` (1, H_kv, N, D) as transformers hands them to an attention function; returns (1, N, H, D).
    ``kernel``: a function with ``torch.nn.attention.varlen.varlen_attn``'s signature (default: torch's)."""
    kernel = VARLEN_ATTN if kernel is None else kernel
    if kernel is None:
        raise RuntimeError("this torch has no torch.nn.attention.varlen.varlen_attn")
    params = _params(kernel)
    q = query[0].transpose(0, 1).contiguous()  # (N, H, D)
    source = index.kv_source.to(key.device)
    k, v = (t[0].transpose(0, 1).index_select(0, source) for t in (key, value))  # (Nk, H_kv, D)
    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # older releases: expand the KV heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    extra.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32) for c in (index.cu_q, index.cu_k))
    out = kernel(q, k.contiguous(), v.contiguous(), cu_q, cu_k, index.max_q, index.max_k, scale=scale, **extra)
    return out.unsqueeze(0)


def reference_varlen_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                          cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                          window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False) -> torch.Tensor:
    """``varlen_attn``'s contract in plain math, one segment at a time, for checking on any device:
    (T_q, H, D) queries, (T_k, H_kv, D) keys and values; causal (``window_size=(-1, 0)``) aligned
    bottom-right, as flash-attention aligns it when a segment has fewer queries than keys. Softmax in
    fp32. Slow (a loop over segments): a reference, never a training path."""
    if tuple(window_size) not in ((-1, -1), (-1, 0)):
        raise ValueError(f"reference_varlen_attn: only full or causal attention, got window_size={window_size}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"reference_varlen_attn: {query.shape[1]} query heads, {key.shape[1]} key heads, no enable_gqa")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for i in range(len(cu_seq_q) - 1):
        q = query[int(cu_seq_q[i]):int(cu_seq_q[i + 1])].transpose(0, 1)  # (H, Lq, D)
        k, v = (t[int(cu_seq_k[i]):int(cu_seq_k[i + 1])].transpose(0, 1) for t in (key, value))
        if k.shape[0] != q.shape[0]:
            k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
        lq, lk = q.shape[1], k.shape[1]
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if tuple(window_size) == (-1, 0):
            future = torch.arange(lk, device=q.device)[None, :] > torch.arange(lq, device=q.device)[:, None] + lk - lq
            scores = scores.masked_fill(future, float("-inf"))
        outs.append((scores.softmax(-1) @ v.float()).to(query.dtype).transpose(0, 1))
    return torch.cat(outs) if outs else query.new_zeros(query.shape)


def choose_kernel(device_type: str, dtype: torch.dtype, dropout: float, refused: list[str],
                  eager: bool = False, cpu_flash: bool = True) -> tuple[str, str]:
    """(kernel, why) for a shared-prompt pack's attention: ``SHARED_VARLEN`` on CUDA in bf16/fp16 where
    this torch has ``varlen_attn`` and it has not refused in this process; ``SPLIT_ROWS`` on CPU where
    SDPA's flash kernel takes the heads (``cpu_flash``: ``rows_attention.flash_chosen``, as for SmolLM2
    and Qwen2.5); else ``ROWS_SDPA`` (or ``ROWS_EAGER``) and the first reason it is not varlen."""
    rows = ROWS_EAGER if eager else ROWS_SDPA
    if eager:
        return rows, "model.attn_implementation=eager"
    if device_type == "cpu" and not dropout:
        if not cpu_flash:
            return rows, "device cpu: SDPA's flash kernel does not take these heads, so no split rows either"
        return SPLIT_ROWS, "device cpu: varlen_attn is CUDA-only; two flash calls, each prompt's queries once"
    if device_type != "cuda":
        return rows, f"device {device_type}: varlen_attn is CUDA-only"
    if dtype not in (torch.bfloat16, torch.float16):
        return rows, f"dtype {dtype}: the flash kernel takes bf16/fp16"
    if VARLEN_ATTN is None:
        return rows, f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    if refused:
        return rows, f"varlen_attn refused earlier in this process: {refused[0]}"
    if dropout:
        return rows, f"attention dropout {dropout}: varlen_attn takes none"
    return SHARED_VARLEN, "CUDA, bf16/fp16, torch.nn.attention.varlen.varlen_attn present"


def planned_kernel(dtype: torch.dtype = torch.bfloat16, refused: list[str] | None = None) -> tuple[str, str]:
    """``choose_kernel`` on this machine's default accelerator (CUDA when ``torch.cuda.is_available()``)."""
    return choose_kernel("cuda" if torch.cuda.is_available() else "cpu", dtype, 0.0, refused or [])


def _params(kernel) -> set[str]:
    try:
        return set(inspect.signature(kernel).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return set()
