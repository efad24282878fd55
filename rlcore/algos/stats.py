"""Masked statistics, log-probabilities and entropy: the tensor primitives every loss is made of.

Conventions shared by all of ``rlcore.algos``:

- token-level tensors are ``(batch, response_len)``;
- ``response_mask`` has the same shape, 0/1 float or bool; 1 marks a generated token that
  counts. Values at masked positions never enter a forward result, even NaN/inf ones (masking
  selects with ``torch.where`` rather than multiplying); keep them finite where gradients flow,
  since the backward pass still computes 0 * inf = NaN through them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def check_same_shape(name_a: str, a: Tensor, name_b: str, b: Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} has shape {tuple(a.shape)} but {name_b} has shape {tuple(b.shape)}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set. Masked entries are replaced by 0 (not multiplied),
    so a NaN or inf in padding cannot leak into the result."""
    check_same_shape("x", x, "mask", mask)
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries; an empty mask gives 0 rather than NaN, because a
    micro-batch made only of DP padding rows is legitimate and must not poison metrics."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries of ``x`` (over all of them, as one population).

    With ``unbiased`` the n/(n-1) correction is applied when n > 1; a single entry has variance 0.
    """
    n = int(mask.bool().sum())
    if n == 0:
        raise ValueError("masked_var: the mask selects no entries")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and n > 1:
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalise the masked entries of ``x`` to unit variance (and zero mean if ``shift_mean``).

    Statistics come from the masked entries only, so padding does not bias them; masked
    positions of the result are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


# ---------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# ---------------------------------------------------------------------------------------------



def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) for ``logits (..., V)`` and integer ``labels (...)``.

    A full ``log_softmax`` would materialise a second (..., V) tensor; for fp32/fp64 we instead
    gather the label logit and subtract ``logsumexp``. Half-precision logsumexp loses too much
    accuracy, so there we go one sequence (first dimension) at a time in fp32, which bounds the
    extra memory to one sequence.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab dim "
            f"{tuple(logits.shape[:-1])}"
        )
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    chunks = logits.reshape(logits.shape[0] if logits.dim() > 2 else 1, -1, logits.shape[-1])
    chunk_labels = labels.reshape(chunks.shape[:2])
    rows = [
        F.log_softmax(chunk.float(), dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        for chunk, lab in zip(chunks, chunk_labels)
    ]
    return torch.stack(rows).reshape(labels.shape).to(logits.dtype)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p * z).

    Logits at -inf (tokens a top-k / top-p filter removed, ``rlcore.algos.sampling``) have p = 0
    and count as 0, the entropy of the truncated distribution; the product p * z there would be
    0 * -inf = NaN, in the forward result and in the gradient, so those z are replaced by 0 first.
    """
    probs = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isneginf(logits), torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
    return torch.logsumexp(logits, dim=-1) - (probs * finite).sum(dim=-1)


# ---------------------------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------------------------
