"""The sampling distribution as the engines define it: temperature, then top-k, then top-p.

Why the trainer needs it: the engines report each sampled token's log-probability under the
distribution it was drawn from, after the filters ("processed" log-probs: the HF engine's
``output_scores``, vLLM's ``logprobs_mode="processed_logprobs"``). A trainer that scores the same
token under the full softmax computes a different quantity: with top-k 5, every kept token is
likelier under the truncated distribution, so pi_old / pi_rollout would be < 1 on every token
and an IS correction would shrink the loss by the filter's mass, with nothing off-policy at all.
``filter_logits`` applies the same filters to the trainer's logits, so both describe one
distribution.

The filters, as HF's warpers and vLLM's sampler apply them:
  - top-k: keep the tokens whose logit is at least the k-th largest (ties at the k-th are kept);
  - top-p, on what top-k kept: sort ascending, drop the tokens whose cumulative probability from
    the least likely up is <= 1 - top_p; the most likely token always stays. The cumulative sum
    runs in the same (ascending) order as theirs so a token on the boundary falls the same way.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def sampling_filter_active(top_k: int = 0, top_p: float = 1.0) -> bool:
    """Whether ``top_k`` / ``top_p`` filter anything (0 or -1 and 1.0 are the engines' "off")."""
    return top_k > 0 or top_p < 1.0


@torch.no_grad()
def kept_tokens(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Boolean mask (..., V) of the tokens top-k then top-p leave in the sampling distribution."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        keep = logits >= kth
    if top_p < 1.0:
        ascending, order = logits.masked_fill(~keep, float("-inf")).sort(dim=-1)
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_below <= 1.0 - top_p
        drop[..., -1] = False
        keep = keep & ~torch.zeros_like(drop).scatter(-1, order, drop)
    return keep


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, labels: Tensor | None = None) -> Tensor:
    """``logits`` (..., V) with the tokens top-k / top-p drop set to -inf (differentiable: the
    kept logits carry their gradient, the dropped ones get none).

    ``labels`` (...) are token ids kept whatever the filters say. Why: the sampled token is in
    the sampler's kept set, but the trainer's logits differ slightly (fp32 against bf16, or
    weights one step newer), and a token on the boundary may fall outside the trainer's set. Its
    log-prob would be -inf and every ratio built from it NaN; kept, it gets the log-prob of the
    truncated distribution with it added back, a finite number that the IS correction and the
    clip then treat as the large mismatch it is. When the sampled tokens are inside the set (the
    same weights and numerics) the result is exactly the truncated distribution.
    Apply the temperature first: the filters act on logits / temperature, as in the engines.
    """
    if not sampling_filter_active(top_k, top_p):
        return logits
    keep = kept_tokens(logits.detach(), top_k, top_p)
    if labels is not None:
        keep = keep.scatter(-1, labels.long().unsqueeze(-1), True)
    return logits.masked_fill(~keep, float("-inf"))
