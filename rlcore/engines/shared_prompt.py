"""A group's n samples prefill their prompt once (``rollout.share_prompt``).

Why: GRPO samples n responses per prompt, and the rollout worker hands the engine each prompt's row
n times. Prefilling every copy computes the same keys and values n times: at SmolLM2-135M, 16 chat
prompts of ~47 tokens x n=8 are ~6000 prompt tokens against 4096 sampled ones, more FLOPs than the
decoding itself.

HF engine (``shared_prefill``): the distinct rows (input ids and mask equal) go through one forward
over all their columns but the last; the cache is then copied to every row (``index_select``: each
row gets the KV of its prompt) and ``generate`` runs on the full batch with it. ``generate`` sees a
cache one column shorter than the prompt, so its first forward is the last prompt column of every
row, ``(B, 1)``: the step that produces the first token's logits, then decoding, as before. The
sampler draws from the same ``(B, vocab)`` scores in the same order, so with a seed the samples are
the unshared path's; logits differ only by the float rounding of a different batch shape.

vLLM (CPU build) needs nothing of this: its prefix cache shares prompt blocks between requests,
including requests scheduled in the same step (a block is registered when allocated), but only whole
blocks, and the CPU backend's default block is 128 tokens, which a 47-token prompt never fills.
``rollout.block_size=32`` (the smallest its CPU attention kernel takes) lets a group's other rows
find their prompt's first 32 tokens cached: at the SmolLM2 preset 3680 of 6040 prompt tokens were
served from the cache (vLLM 0.32), and sampling ran 1.37x faster on 2 quiet cores
(``benchmarks/shared_prompt.py``, docs/benchmarks.md): the SmolLM2 preset sets it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

SHARED_BLOCK_SIZE = 32  # vLLM CPU: the smallest KV block (rollout.block_size) its attention kernel takes


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(index of one row per distinct prompt, (B,) which of them each row is), or None when no prompt
    repeats (nothing to share). Rows are the same prompt when their ids and mask are equal."""
    rows = torch.cat([input_ids, attention_mask], dim=1)
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    distinct = int(inverse.max()) + 1 if len(inverse) else 0
    if distinct == len(inverse):
        return None
    first = torch.full((distinct,), len(inverse), dtype=torch.long, device=inverse.device)
    first.scatter_reduce_(0, inverse, torch.arange(len(inverse), device=inverse.device), reduce="amin")
    return first, inverse


@torch.no_grad()
def shared_prefill(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor) -> DynamicCache | None:
    """The KV cache of every row's prompt but its last column, each distinct prompt computed once; None
    when nothing would be shared (no prompt repeats, one-column prompts) or the model's cache is not
    plain full attention (a sliding-window layer keeps its own bookkeeping: not copied row by row here)."""
    if input_ids.shape[1] < 2:
        return None
    groups = distinct_rows(input_ids, attention_mask)
    if groups is None:
        return None
    first, inverse = groups
    cache = DynamicCache(config=model.config)
    model(input_ids=input_ids[first, :-1], attention_mask=attention_mask[first, :-1],
          position_ids=position_ids[first, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    return DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse))
                                        for layer in cache.layers])
