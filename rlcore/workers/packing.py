"""Packed micro-batches: the valid tokens of a micro-batch's rows laid end to end in one sequence.

Why: a padded micro-batch (B, T) computes every layer at B x T positions, of which only the
attention-mask ones are real; prompts are left-padded to the longest prompt and responses
right-padded to the longest response, so with skewed lengths half the work can be padding.
Packed, the model runs on (1, N) with N the number of valid tokens, and nothing else changes:

- positions: each token keeps its own row's ``position_ids`` (they restart at 0 per row), so RoPE
  sees exactly what it saw padded;
- attention: kept inside each row by the row boundaries ``cu_seqlens`` (flash-attention's varlen
  convention), handed to the attention kernel through the model's forward keywords
  (``cu_seq_lens_q`` ...; transformers passes them down to every attention call). No (N x N) mask is
  ever built: the kernel registered here as ``PACKED_ATTENTION`` runs causal attention per row.

The kernel (``packed_attention``): on CUDA in bf16/fp16, torch's varlen flash attention (one call for
the whole pack) where this torch has it (``uses_varlen``; should it raise, the process falls back to
rows, ``VARLEN_REFUSED`` says why); elsewhere one causal ``scaled_dot_product_attention`` call over the
pack's rows laid side by side (``_rows``: each row's queries, keys and values from position 0,
filled behind its end; GQA-aware), which on CPU is the flash kernel, without any mask; with
``model.attn_implementation=eager``, the same layout through eager math (``PACKED_EAGER``). Training
on CPU, the rows' SDPA runs through ``rlcore.workers.rows_attention``: the same kernel calls and bits, but
its backward keeps the pack's own q, k, v, not the rows' fp32 copies (0.85 GiB less at SmolLM2's GRPO step).
A pack with shared prompts on CPU runs as two flash calls instead (``rlcore.workers.split_rows``: each
row's response queries over its whole sequence, the prompts' queries once), with the same economy.
``model.attn_implementation=flash_attention_2`` (the flash-attn package) is used as it is: it reads
the same keywords.

Shared prompts (``model.pack_shared_prompts``, on by default): the n rows of a GRPO or PPO group
start with the same prompt, and a pack holds it once, followed by each row's response; every layer
but attention runs on prompt + n responses instead of n x (prompt + response) tokens (at SmolLM2 on
arithmetic_words, 47 prompt and 32 response tokens per row: 2.1x fewer). Attention stays exact: each
row's queries see the prompt's keys and values (gathered from the one copy, ``RowLayout``) and their
own response's, as before; the gradients of the shared prompt sum every row's, as they would apart.
On CUDA in bf16/fp16 such a pack runs as one varlen call with separate query and key boundaries
(rlcore.workers.shared_varlen: each row's queries are its stored tokens, its keys the prompt gathered
from the one copy plus its own); elsewhere, or should that call raise, as rows of SDPA.
``shared_varlen.KERNEL_CALLS`` counts which kernel each attention call ran. docs/workers.md
("Packed sequences") has the measurements behind these choices; docs/gpu.md what is proven on CUDA.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from rlcore.models.config import ModelConfig
from rlcore.workers import rows_attention, shared_varlen, split_rows
from rlcore.workers.response_head import scored_positions

PACKED_ATTENTION = "rlcore_packed"  # the attn_implementation name the trained roles load with when packing
PACKED_EAGER = "rlcore_packed_eager"  # the same with eager math inside (model.attn_implementation=eager)
ROWS_KEYWORD = "rlcore_rows"  # the forward keyword that carries a pack's RowLayout down to the attention calls
VARLEN_REFUSED: list[str] = []  # why torch's varlen attention failed in this process, if it did (then rows of SDPA)

try:  # torch >= 2.9 on CUDA: one varlen flash-attention call for the whole pack
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


@dataclass(frozen=True)
class RowLayout:
    """The rows attention runs on, over a pack of N tokens: ``source`` (rows * max_len,) the pack index
    of each row's token at each position (N, a zero token appended, behind the row's end); ``take``
    (N,) where in (rows * max_len) each pack token's own output is read. A row whose prompt is shared
    reads the prompt's tokens from the row that holds them (its queries there repeat that row's and
    are dropped); only the holder's outputs are read, and the backward of ``source``'s gather sums
    every row's gradient into the shared keys and values."""

    source: torch.Tensor
    take: torch.Tensor
    rows: int
    max_len: int

    @cached_property
    def varlen(self) -> shared_varlen.VarlenIndex:
        """The varlen call's query and key boundaries (``shared_varlen.varlen_index``), built once per pack."""
        return shared_varlen.varlen_index(self.source, self.take, self.rows, self.max_len)

    @cached_property
    def split(self) -> split_rows.SplitIndex | None:
        """The two CPU flash calls' index (``split_rows.split_index``), built once per pack; None where no
        row borrows a prompt, or where a row's stored tokens are not the tail of its sequence (``stored_tails``)."""
        if not shared_varlen.stored_tails(self.source, self.take, self.rows, self.max_len):
            return None
        return split_rows.split_index(self.source, self.take, self.rows, self.max_len)


@dataclass(frozen=True)
class Packed:
    """One micro-batch's rows, packed. ``index``: each packed token's flat position in the padded
    (B, T) layout; ``cu_seqlens``: row boundaries in the pack (rows without tokens left out), valid
    only where no prompt is ``shared`` (then each row's tokens are contiguous); ``layout``: the rows
    as attention reads them (``RowLayout``), shared prompts included."""

    input_ids: torch.Tensor  # (1, N)
    position_ids: torch.Tensor  # (1, N)
    index: torch.Tensor  # (N,) int64 flat indices into B * T
    cu_seqlens: torch.Tensor  # (R + 1,) int32
    max_len: int
    shape: tuple[int, int]  # the padded (B, T)
    slot: torch.Tensor  # (B, T) int64: each padded position's index in the pack, -1 on padding
    layout: RowLayout
    shared: bool = False  # some rows read their prompt from another row's tokens

    @property
    def num_tokens(self) -> int:
        return int(self.index.numel())

    def model_kwargs(self) -> dict:
        """The forward's keywords: the packed tokens, their own positions, no attention mask, the rows'
        layout (``rlcore_rows``, read by this module's kernels) and, where every row is contiguous,
        the row boundaries that other kernels read (transformers' flash-attention keyword names).
        With shared prompts those are left out: a kernel reading them would see rows cut wrong."""
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "attention_mask": None,
                  ROWS_KEYWORD: self.layout}
        if not self.shared:
            kwargs.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                          max_length_q=self.max_len, max_length_k=self.max_len)
        return kwargs

    def gather(self, padded: torch.Tensor) -> torch.Tensor:
        """A (B, T, ...) tensor aligned with the tokens, packed to (1, N, ...) (a shared prompt token:
        the holder row's entry)."""
        if tuple(padded.shape[:2]) != self.shape:
            raise ValueError(f"Packed.gather: expected a ({self.shape[0]}, {self.shape[1]}, ...) tensor, "
                             f"got {tuple(padded.shape)}")
        return padded.flatten(0, 1)[self.index].unsqueeze(0)

    def last_positions(self) -> torch.Tensor:
        """(B,) each row's last token's index in the pack (its rightmost valid position)."""
        last = torch.where(self.slot >= 0, self.slot, self.slot.new_full((), -1)).amax(1)
        if bool((last < 0).any()):
            raise ValueError("Packed.last_positions: a row has no valid token")
        return last

    def response_targets(self, response_width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keep, where)`` for scoring the last ``response_width`` columns: ``where`` (B, T_r) marks the
        response tokens that are valid and follow a valid token, ``keep`` (K,) the pack index of the
        token before each (the position whose output predicts or values it), in ``where``'s row-major
        order, so ``out[where] = values_at(keep)`` puts the results back in the padded layout."""
        before = self.slot[:, -response_width - 1:-1]
        where = (self.slot[:, -response_width:] >= 0) & (before >= 0)
        return before[where], where

    def scatter_responses(self, values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """(K, ...) values of ``response_targets``' tokens into a zero (B, T_r, ...) tensor."""
        out = values.new_zeros((*where.shape, *values.shape[1:]))
        out[where] = values
        return out


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
         prompt_width: int = 0) -> Packed:
    """Pack the valid (``attention_mask`` 1) tokens of each (B, T) row, row after row.

    ``prompt_width`` > 0: the first ``prompt_width`` columns are the rows' prompts, and rows whose
    prompt (ids and mask) equals an earlier row's keep only their response tokens in the pack; their
    attention reads the prompt from that row (``RowLayout``). A GRPO group's n rows then cost one
    prompt and n responses in every layer, with the same outputs as apart: the prompt's tokens attend
    only to the prompt (causal), so their states do not depend on the response that follows.

    A row's valid tokens must run without a gap (left-padded prompt, right-padded response: the
    rollout layout); a masked hole inside a row would join its two sides, which the padded forward
    keeps apart by the mask only in the keys, so it is refused."""
    if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape or position_ids.shape != input_ids.shape:
        raise ValueError(f"pack: input_ids, attention_mask and position_ids must be the same (B, T) shape, got "
                         f"{tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, {tuple(position_ids.shape)}")
    valid = attention_mask.bool()
    gapless = (valid.to(torch.int8).diff(dim=1) == 1).sum(1) <= (valid[:, 0] == 0).to(torch.int64)
    if not bool(gapless.all()):
        row = int((~gapless).nonzero()[0])
        raise ValueError(f"pack: row {row}'s attention_mask has a hole between valid tokens; packing needs each "
                         "row's tokens contiguous (set model.use_remove_padding=false for such batches)")
    holder, borrows = _borrowers(input_ids, valid, prompt_width)
    stored = valid.clone()
    stored[:, :prompt_width] &= ~borrows[:, None]
    index = stored.flatten().nonzero().squeeze(1)
    slot = torch.full(valid.shape, -1, dtype=torch.int64, device=valid.device)
    slot.view(-1)[index] = torch.arange(index.numel(), device=valid.device)
    if bool(borrows.any()):  # a borrowed prompt position: the holder's token (padding where the holder's is)
        slot[:, :prompt_width] = torch.where(borrows[:, None], slot[holder, :prompt_width], slot[:, :prompt_width])
    lengths = stored.sum(1)
    nonempty = lengths[lengths > 0]
    cu_seqlens = F.pad(nonempty.cumsum(0, dtype=torch.int32), (1, 0))
    layout = _row_layout(slot, valid, stored, index.numel())
    return Packed(input_ids=input_ids.flatten()[index].unsqueeze(0), position_ids=position_ids.flatten()[index].unsqueeze(0),
                  index=index, cu_seqlens=cu_seqlens, max_len=int(nonempty.max()) if len(nonempty) else 0,
                  shape=(int(valid.shape[0]), int(valid.shape[1])), slot=slot, layout=layout,
                  shared=bool(borrows.any()))


def prompt_holders(input_ids: torch.Tensor, valid: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """(B,) for each row, the first row with the same prompt (the same ids and mask in the first
    ``prompt_width`` columns); each row itself where ``prompt_width`` is 0."""
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    if prompt_width <= 0 or input_ids.shape[0] < 2:
        return rows
    prompts = torch.cat([torch.where(valid[:, :prompt_width], input_ids[:, :prompt_width], -1),
                         valid[:, :prompt_width].to(input_ids.dtype)], dim=1)
    _, group = torch.unique(prompts, dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), input_ids.shape[0], dtype=torch.int64, device=rows.device)
    first.scatter_reduce_(0, group, rows, reduce="amin")
    return first[group]


def _borrowers(input_ids: torch.Tensor, valid: torch.Tensor, prompt_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``prompt_holders``, and the (B,) mask of the rows that read their prompt from another row)."""
    holder = prompt_holders(input_ids, valid, prompt_width)
    return holder, holder != torch.arange(len(holder), device=holder.device)


def _prompt_width(batch) -> int:
    """The prompt columns of a rollout-layout batch: those before the responses."""
    return batch["input_ids"].shape[1] - batch["responses"].shape[1]


def prompt_groups(batch) -> list[np.ndarray]:
    """The rows of a rollout-layout batch that share a prompt (``prompt_holders`` over the columns before
    the responses), each group in row order, groups in the order of their first rows."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    holder = prompt_holders(ids, mask.bool(), _prompt_width(batch)).cpu().numpy()
    order = np.argsort(holder, kind="stable")
    _, starts = np.unique(holder[order], return_index=True)
    return np.split(order, starts[1:])


def borrowed_prompt_tokens(batch) -> int:
    """How many of a rollout-layout micro-batch's valid tokens a shared-prompt pack does not hold: the
    prompt tokens of every row that reads its prompt from an earlier row."""
    mask, width = batch["attention_mask"], _prompt_width(batch)
    _, borrows = _borrowers(batch["input_ids"], mask.bool(), width)
    return int(mask[borrows, :width].sum())


def group_items(batch, groups: list[np.ndarray], budget: int) -> tuple[list[np.ndarray], list[int]]:
    """Token-budget items of shared-prompt ``groups``: each group's rows in order, cut where prompt +
    responses would pass ``budget`` (a cut starts again from the prompt), with the tokens each item
    costs packed (one prompt, every response). A row alone over the budget stays an item of its own,
    for the packing's error to name."""
    mask = batch["attention_mask"]
    lengths = mask.sum(1).tolist()
    prompt = mask[:, :_prompt_width(batch)].sum(1).tolist()
    items, costs = [], []
    for group in groups:
        shared = prompt[group[0]]
        start, cost = 0, shared
        for i, row in enumerate(group):
            extra = lengths[row] - shared
            if i > start and cost + extra > budget:
                items.append(group[start:i])
                costs.append(cost)
                start, cost = i, shared
            cost += extra
        items.append(group[start:])
        costs.append(cost)
    return items, costs


def _row_layout(slot: torch.Tensor, valid: torch.Tensor, stored: torch.Tensor, n: int) -> RowLayout:
    """Each non-empty row's tokens (its own and any borrowed prompt) from position 0, and where each
    pack token's output lies: in the row that stores it."""
    keep = valid.any(1)
    slot, valid, stored = slot[keep], valid[keep], stored[keep]
    rows = int(slot.shape[0])
    max_len = int(valid.sum(1).max()) if rows else 0
    position = valid.cumsum(1) - 1
    row = torch.arange(rows, device=slot.device)[:, None].expand_as(slot)
    source = torch.full((rows, max_len), n, dtype=torch.int64, device=slot.device)
    source[row[valid], position[valid]] = slot[valid]
    take = torch.empty(n, dtype=torch.int64, device=slot.device)
    take[slot[stored]] = (row * max_len + position)[stored]
    return RowLayout(source=source.flatten(), take=take, rows=rows, max_len=max_len)


def _layout_from_cu(cu: torch.Tensor, max_len: int, n: int, device: torch.device) -> RowLayout:
    """The ``RowLayout`` of contiguous rows given only their boundaries (a caller that passes
    flash-attention keywords, not a ``Packed``'s)."""
    lengths = cu.diff().to(device, torch.int64)
    max_len = max_len or int(lengths.max())
    rows = lengths.numel()
    cu = cu.to(device, torch.int64)
    row = torch.repeat_interleave(torch.arange(rows, device=device), lengths, output_size=n)
    take = row * max_len + torch.arange(n, device=device) - cu[row]
    col = torch.arange(max_len, device=device)
    source = torch.where(col < lengths[:, None], cu[:-1, None] + col, n).flatten()
    return RowLayout(source=source, take=take, rows=rows, max_len=max_len)


def load_kwargs(model_cfg: ModelConfig) -> dict:
    """``from_pretrained`` keywords of a trained role: ``model_cfg``'s, with the packed attention kernel
    when ``model.use_remove_padding``: SDPA inside, or eager math where ``model.attn_implementation``
    is eager (``flash_attention_2``, when chosen, reads packs as it is)."""
    kwargs = model_cfg.load_kwargs()
    chosen = kwargs.get("attn_implementation")
    if model_cfg.use_remove_padding and chosen != "flash_attention_2":
        kwargs["attn_implementation"] = PACKED_EAGER if chosen == "eager" else PACKED_ATTENTION
    return kwargs


@dataclass(frozen=True)
class ForwardInputs:
    """What a forward that reads one output per response token needs, padded or packed: the model's
    keywords, ``keep`` (the positions whose outputs are read: ``logits_to_keep``), the response tokens
    they predict (``labels``, (B, T_r) padded, (1, K) packed) and ``where`` (packed: the (B, T_r)
    entries the K outputs go back to; None padded)."""

    kwargs: dict
    keep: torch.Tensor
    labels: torch.Tensor
    where: torch.Tensor | None
    packed: Packed | None

    def per_response(self, outputs: torch.Tensor) -> torch.Tensor:
        """(B, T_r, ...) from the model's outputs at ``keep``: as they are padded; packed, scattered back
        into zeros (the response padding, which no caller reads)."""
        return outputs if self.where is None else self.packed.scatter_responses(outputs[0], self.where)


def shares_prompts(model_cfg: ModelConfig, moe: object | None = None) -> bool:
    """Whether a role's packs hold each distinct prompt once (``model.pack_shared_prompts``): packed,
    with this module's kernels (``flash_attention_2`` reads only contiguous rows), and not for an MoE
    (its router losses and replayed routing count every row's prompt tokens)."""
    return (model_cfg.use_remove_padding and model_cfg.pack_shared_prompts and moe is None
            and model_cfg.attn_implementation != "flash_attention_2")


def response_inputs(batch, packing: bool, share_prompts: bool = False) -> ForwardInputs:
    """The forward's inputs for a micro-batch in the rollout layout (input_ids, attention_mask,
    position_ids, responses), packed when ``packing``, each distinct prompt once when
    ``share_prompts`` (``shares_prompts``: the columns before the responses are the prompt)."""
    ids, responses = batch["input_ids"], batch["responses"]
    t_r = responses.shape[1]
    if not packing:
        keep = scored_positions(ids.shape[1], t_r, ids.device)
        kwargs = {"input_ids": ids, "attention_mask": batch["attention_mask"], "position_ids": batch["position_ids"]}
        return ForwardInputs(kwargs, keep, responses, None, None)
    packed = pack(ids, batch["attention_mask"], batch["position_ids"], _prompt_width(batch) if share_prompts else 0)
    keep, where = packed.response_targets(t_r)
    return ForwardInputs(packed.model_kwargs(), keep, responses[where].unsqueeze(0), where, packed)


# ----------------------------------------------------------------------------- the attention kernel
def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` (1, H, N, D), ``key``/``value``
    (1, H_kv, N, D) of a pack; returns (1, N, H, D). Causal attention within each row of
    ``kwargs["cu_seq_lens_q"]``; without it (an unpacked call, e.g. one padded row) the whole
    sequence is one row, and a padding mask is refused rather than ignored."""
    return _packed(module, query, key, value, attention_mask, scaling, dropout, kwargs, _sdpa)


def packed_eager_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """``packed_attention`` with transformers' eager math inside (``model.attn_implementation=eager``):
    scores, causal mask and an fp32 softmax per row, (rows, H, L, L) at most, never (N x N)."""
    return _packed(module, query, key, value, attention_mask, scaling, dropout, kwargs, _eager)


def _packed(module, query, key, value, attention_mask, scaling, dropout, kwargs, inner):
    cu = kwargs.get("cu_seq_lens_q")
    layout = kwargs.get(ROWS_KEYWORD)
    if attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} attention takes packed rows without a mask (rlcore.workers.packing.pack)")
    if getattr(module, "sliding_window", None):
        raise ValueError(f"{PACKED_ATTENTION} attention has no sliding window: load this model with another "
                         "attn_implementation (model.use_remove_padding=false)")
    if query.shape[0] != 1 and (cu is not None or layout is not None):
        raise ValueError(f"{PACKED_ATTENTION} attention expects one packed sequence, got batch {query.shape[0]}")
    dropout = dropout if module.training else 0.0
    if inner is _sdpa and not query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        inner = _sdpa_fp32
    calls = shared_varlen.KERNEL_CALLS
    if cu is None and layout is None:
        calls[shared_varlen.UNPACKED] += 1
        return inner(query, key, value, scaling, dropout).transpose(1, 2).contiguous(), None
    if cu is not None and uses_varlen(query) and dropout == 0.0:  # contiguous rows only (no shared prompt)
        try:
            out = _varlen(query, key, value, cu, int(kwargs.get("max_length_q") or 0), scaling)
            calls[shared_varlen.VARLEN] += 1
            return out.transpose(1, 2).contiguous(), None
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # this torch / GPU refuses it: rows from now on
            _refused(exc)
    kernel = None if cu is not None else shared_varlen.choose_kernel(  # a shared-prompt pack's (rows with cu)
        query.device.type, query.dtype, dropout, VARLEN_REFUSED, inner is _eager,
        cpu_flash=query.device.type != "cpu" or rows_attention.flash_chosen(query, key))[0]
    if kernel == shared_varlen.SHARED_VARLEN:
        try:  # a shared-prompt pack: one varlen call, query and key boundaries apart
            out = shared_varlen.shared_varlen_attention(query, key, value, layout.varlen, scaling)
            calls[shared_varlen.SHARED_VARLEN] += 1
            return out, None
        except (RuntimeError, TypeError, NotImplementedError, ValueError) as exc:
            _refused(exc)
    if layout is None:
        layout = _layout_from_cu(cu, int(kwargs.get("max_length_q") or 0), query.shape[2], query.device)
    if kernel == shared_varlen.SPLIT_ROWS and layout.split is not None:  # each prompt's queries once
        calls[shared_varlen.SPLIT_ROWS] += 1
        return split_rows.SplitRows.apply(query, key, value, layout.split, scaling), None
    calls[shared_varlen.ROWS_EAGER if inner is _eager else shared_varlen.ROWS_SDPA] += 1
    if inner is not _eager and rows_attention.applies(query, key, value, dropout):  # the same numbers, less kept
        return rows_attention.FlashRows.apply(query, key, value, layout.source.to(query.device),
                                              layout.take.to(query.device), layout.rows, layout.max_len, scaling), None
    return _rows(query, key, value, layout, scaling, dropout, inner), None


def _refused(exc: Exception) -> None:
    """This torch / GPU refused varlen attention: record why, and run rows of SDPA from now on."""
    VARLEN_REFUSED.append(f"{type(exc).__name__}: {exc}"[:500])
    warnings.warn(f"torch varlen attention refused ({VARLEN_REFUSED[-1]}); packed attention runs as rows of SDPA")


def uses_varlen(query: torch.Tensor) -> bool:
    """Whether a pack's attention runs as torch's varlen flash attention: CUDA, bf16 or fp16 (the flash
    kernel's dtypes; fp32 packs run as rows of SDPA), a torch that has it and has not refused it."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and _varlen_attn is not None
            and not VARLEN_REFUSED)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _sdpa_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout: float) -> torch.Tensor:
    """SDPA on CPU for bf16 inputs, computed in fp32: torch 2.13's CPU flash kernel measured 1.1-2.2x
    slower in bf16 than in fp32 (forward + backward, rows of 76-300 tokens), casts included."""
    return _sdpa(q.float(), k.float(), v.float(), scale, dropout).to(q.dtype)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dropout: float) -> torch.Tensor:
    """Causal attention as transformers' eager kernel computes it (softmax in fp32), on (B, H, L, D)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    length = q.shape[2]
    future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(F.dropout(probs, p=dropout, training=dropout > 0), v)


def _rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: RowLayout, scale: float | None,
          dropout: float, inner) -> torch.Tensor:
    """Causal attention of each row of a pack in one batched ``inner`` call (SDPA or eager): q, k, v
    are laid out as (rows, heads, longest row, head_dim), each row from position 0 and zero-filled
    behind its end (``layout.source``), and each token's output is gathered back from the row that
    stores it (``layout.take``), (1, N, H, D).

    Right-filled rows need no mask: a causal query sees only keys at or before it, all of them the
    row's own tokens (a shared prompt's included); the filled queries' outputs are dropped. So the
    kernel is the causal one (SDPA's flash kernel on CPU: no (L x L) scores, let alone (N x N)), one
    call forward and one backward, where a call per row measured several times slower for many short
    rows (docs/workers.md). Both gathers are index_selects, whose backward is an index_add (a scatter
    into zeros by advanced indexing measured ~3x slower here). Only attention sees the fill; every
    other layer runs on the N packed tokens."""
    rows, max_len = layout.rows, layout.max_len
    source, take = layout.source.to(q.device), layout.take.to(q.device)

    def spread(t: torch.Tensor) -> torch.Tensor:  # (1, H, N, D) -> (rows, H, max_len, D), in t's dtype
        return rows_attention.rows_of(rows_attention.with_zero_token(t[0].transpose(0, 1)), source, rows, max_len, t.dtype)

    out = inner(spread(q), spread(k), spread(v), scale, dropout)  # (rows, H, max_len, D)
    return rows_attention.flat_rows(out).index_select(0, take).unsqueeze(0)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
            scale: float | None) -> torch.Tensor:
    """torch's varlen flash attention over the whole pack; its causal argument is named differently
    across torch releases (``is_causal`` earlier, ``window_size=(-1, 0)`` later)."""
    if k.shape[1] != q.shape[1]:  # GQA: expand the KV heads (older releases lack enable_gqa)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # (N, H, D)
    cu = cu.to(device=q.device, dtype=torch.int32)
    max_len = max_len or int(cu.diff().max())
    causal = {"is_causal": True} if "is_causal" in _VARLEN_PARAMS else {"window_size": (-1, 0)}
    out = _varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)
    return out.transpose(0, 1).unsqueeze(0)  # (1, H, N, D)


_VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else set()
AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionInterface.register(PACKED_EAGER, packed_eager_attention)
