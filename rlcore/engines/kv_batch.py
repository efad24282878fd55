"""A running batch of sequences over one KV cache: token-level continuous batching for HF models.

Why: ``generate`` runs a fixed batch to its end, so a request that arrives meanwhile waits for the
whole call, and a short request holds its row until the longest one is done. An asynchronous
engine wants new requests to join between two decode steps and finished ones to leave at once.
``KVBatch`` keeps the batch's KV cache (transformers' ``DynamicCache``, left-padded: a row's real
tokens are the last columns of its row, padding is masked out) and does three things with it:

- ``admit(seqs)``: left-padded forwards over the new sequences (those of similar length together)
  with fresh caches, merged into the running one (the shorter side padded on the left); returns
  each new sequence's next-token logits;
- ``step(tokens)``: feeds every row one token (its last sampled one) in one ``(B, 1)`` forward;
- ``keep(rows)``: keeps those rows and drops the columns no row needs any more.

A row may come back with its earlier KV (``row_kv``, kept by the engine per session: the next turn
of an episode extends the last one's ids) and only its new tokens are computed, as vLLM's prefix
cache does.

Each row's position ids count its own tokens (padding does not move them), so a
row attends to exactly what it would alone: greedy output equals HF ``generate`` on the prompt
alone, up to the float rounding of padded matmuls that any batched ``generate`` has.

Invariant: the cache holds every token of a row except its pending one (the last sampled token,
fed by the next ``step``). Only full-attention cache layers can be merged this way; a model with
sliding-window or linear-attention layers is refused when first admitted.

Attention: a padded batch needs a mask, and with a mask transformers' SDPA path repeats the KV
heads of a grouped-query model (a copy of the whole cache per layer and step, 8x the attention's
own time at 256 rows here). ``use_gqa_sdpa`` swaps in the same SDPA call with ``enable_gqa``
instead: the same kernel on the same numbers, without the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "rlcore_sdpa_gqa"


@dataclass
class RowKV:
    """One sequence's keys and values, per layer ((kv heads, length, head dim) each)."""

    length: int
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)


class KVBatch:
    def __init__(self, model: torch.nn.Module, pad_token_id: int) -> None:
        self.model, self.pad_token_id = model, pad_token_id
        self.device = next(model.parameters()).device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # (B, T): 1 on real tokens
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # real tokens per row in the cache

    def __len__(self) -> int:
        return int(self.mask.shape[0])

    @property
    def width(self) -> int:
        """Columns of the cache (the longest row plus its left padding)."""
        return int(self.mask.shape[1])

    def reset(self) -> None:
        self.cache = None
        self.mask = self.mask.new_zeros((0, 0))
        self.lengths = self.lengths.new_zeros(0)

    @torch.no_grad()
    def admit(self, seqs: Sequence[Sequence[int]], pasts: Sequence[RowKV | None] | None = None) -> torch.Tensor:
        """Prefill ``seqs`` (each non-empty) and append them as the last rows, in order; their (n, V)
        next-token logits. ``pasts[i]``, when given, is the KV of tokens that come before ``seqs[i]``
        (a cached prefix, ``row_kv``): only ``seqs[i]`` is computed. Sequences of similar length are
        prefilled together (``length_groups``), so a short one is not padded to the longest."""
        pasts = list(pasts) if pasts is not None else [None] * len(seqs)
        caches, masks, logits, order = [], [], [], []
        for cached in (False, True):
            index = [i for i in range(len(seqs)) if (pasts[i] is not None) == cached]
            for group in length_groups([len(seqs[i]) for i in index]):
                rows = [index[g] for g in group]
                layers, mask, out = self._prefill([seqs[i] for i in rows], [pasts[i] for i in rows] if cached else None)
                caches.append(layers)
                masks.append(mask)
                logits.append(out)
                order += rows
        inverse = torch.empty(len(order), dtype=torch.long, device=self.device)
        inverse[torch.as_tensor(order, device=self.device)] = torch.arange(len(order), device=self.device)
        width = max(m.shape[1] for m in masks)
        mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in masks]).index_select(0, inverse)
        layers = []
        for i in range(len(caches[0])):
            keys = torch.cat([F.pad(c[i][0], (0, 0, width - m.shape[1], 0)) for c, m in zip(caches, masks)])
            values = torch.cat([F.pad(c[i][1], (0, 0, width - m.shape[1], 0)) for c, m in zip(caches, masks)])
            if len(caches) > 1 or order != sorted(order):
                keys, values = keys.index_select(0, inverse), values.index_select(0, inverse)
            layers.append((keys, values))
        self._merge(layers, mask)
        return torch.cat(logits).index_select(0, inverse)

    def _prefill(self, seqs: Sequence[Sequence[int]], pasts: Sequence[RowKV] | None):
        """One left-padded forward over ``seqs`` after their ``pasts`` (left-padded to a common width;
        a row's padding may then sit between its past and its new tokens: masked, like any padding)."""
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, width - len(seq):] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        if pasts is None:
            cache, offset = DynamicCache(config=self.model.config), 0
        else:
            past_width = max(p.length for p in pasts)
            past_mask = torch.zeros((len(seqs), past_width), dtype=torch.long, device=self.device)
            for row, past in enumerate(pasts):
                past_mask[row, past_width - past.length:] = 1
            cache = DynamicCache(ddp_cache_data=[
                (torch.stack([F.pad(p.layers[i][0], (0, 0, past_width - p.length, 0)) for p in pasts]),
                 torch.stack([F.pad(p.layers[i][1], (0, 0, past_width - p.length, 0)) for p in pasts]))
                for i in range(len(pasts[0].layers))])
            offset = torch.tensor([p.length for p in pasts], device=self.device)[:, None]
            mask = torch.cat([past_mask, mask], dim=1)
        positions = (offset + mask[:, -width:].cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        _check_layers(cache, self.model)
        return [(layer.keys, layer.values) for layer in cache.layers], mask, out.logits[:, -1]

    def row_kv(self, row: int) -> RowKV:
        """A copy of one row's cached keys and values (its real tokens only), to admit it again later."""
        cols = self.mask[row].bool()
        return RowKV(int(cols.sum()), [(layer.keys[row][:, cols], layer.values[row][:, cols])
                                       for layer in self.cache.layers])

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed row i the token ``tokens[i]``; the (B, V) logits of each row's next token."""
        mask = torch.cat([self.mask, self.mask.new_ones((len(self), 1))], dim=1)
        out = self.model(input_ids=tokens.view(-1, 1).to(self.device), attention_mask=mask,
                         position_ids=self.lengths.view(-1, 1), past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1)
        self.mask, self.lengths = mask, self.lengths + 1
        return out.logits[:, -1]

    @torch.no_grad()
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in that order); trim the columns that are padding in every row left."""
        if len(rows) == len(self) and list(rows) == list(range(len(self))):
            return
        if not rows:
            self.reset()
            return
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(0).int().argmax())  # columns before this are padding in every row
        self.mask, self.lengths = mask[:, start:], self.lengths.index_select(0, index)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def _merge(self, layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Append rows whose per-layer (keys, values) and mask are left-padded to a common width."""
        lengths = mask.sum(-1)
        if self.cache is None or len(self) == 0:
            self.cache, self.mask, self.lengths = DynamicCache(ddp_cache_data=layers), mask, lengths
            return
        width = max(self.width, mask.shape[1])
        old_pad, new_pad = width - self.width, width - mask.shape[1]
        self.mask = torch.cat([F.pad(self.mask, (old_pad, 0)), F.pad(mask, (new_pad, 0))])
        self.lengths = torch.cat([self.lengths, lengths])
        for old, (keys, values) in zip(self.cache.layers, layers):
            old.keys = torch.cat([F.pad(old.keys, (0, 0, old_pad, 0)), F.pad(keys, (0, 0, new_pad, 0))])
            old.values = torch.cat([F.pad(old.values, (0, 0, old_pad, 0)), F.pad(values, (0, 0, new_pad, 0))])


def length_groups(lengths: Sequence[int], slack: float = 0.2, min_waste: int = 256) -> list[list[int]]:
    """Indices grouped by length (shortest first) so that a group's padding stays within ``slack`` of
    its real tokens, or ``min_waste`` tokens (a forward's fixed cost is worth a few hundred of them)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups:
            group = groups[-1]
            waste = lengths[i] * (len(group) + 1) - (real + lengths[i])
            if waste <= max(slack * (real + lengths[i]), min_waste):
                group.append(i)
                real += lengths[i]
                continue
        groups.append([i])
        real = lengths[i]
    return groups


def _sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped KV heads passed as they are (``enable_gqa``)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
                                         enable_gqa=getattr(module, "num_key_value_groups", 1) > 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_SDPA, _sdpa_gqa)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)


def use_gqa_sdpa(model: torch.nn.Module) -> None:
    """Switch a model on transformers' SDPA attention to ``_sdpa_gqa`` (others keep theirs)."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(GQA_SDPA)


def _check_layers(cache: DynamicCache, model: torch.nn.Module) -> None:
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if odd:
        raise NotImplementedError(f"continuous batching merges full-attention KV caches only; "
                                  f"{type(model).__name__} has {sorted(odd)} cache layers")
