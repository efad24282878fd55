"""Each token's log-prob and entropy from the last hidden states, without the (B, T, V) logits.

Why: at a real vocabulary the logits are the largest tensor of a training step. SmolLM2's 49k
tokens x 16 rows x 128 response tokens are 400 MB in fp32, and the plain path holds several such
tensors at once (the head's output, its fp32 copy, the temperature division, softmax and the
products of the entropy), and autograd keeps some of them for the backward. Here the head's
matmul, the fp32 cast, the temperature, the sampler's top-k / top-p filter, the log-softmax and
the entropy run on ``chunk_tokens`` positions at a time; with grad each chunk is checkpointed, so
the backward recomputes that chunk's logits instead of keeping them. At most one chunk's logits
(and its softmax temporaries) exist at any moment, whatever the batch; the price is the head's
matmul once more in the backward, over the response positions only.

The numbers are those of the plain path (``logprobs_from_logits`` / ``entropy_from_logits`` of
``filter_logits(logits.float() / temperature)``), chunked over positions: rows of a matmul do not
depend on the other rows, so chunking changes the result only by the matmul's blocking (~1e-7).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlcore.algos.sampling import filter_logits
from rlcore.algos.stats import entropy_from_logits, logprobs_from_logits

Tensor = torch.Tensor
FP32_BYTES = 4


def chunk_tokens_for(vocab_size: int, chunk_mb: float) -> int:
    """Positions per chunk so that one chunk's fp32 logits take about ``chunk_mb`` MiB."""
    return max(1, int(chunk_mb * (1 << 20)) // (vocab_size * FP32_BYTES))


def _chunk_scores(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float,
                  top_k: int, top_p: float) -> Tensor:
    logits = F.linear(hidden, weight, bias).float() / temperature
    logits = filter_logits(logits, top_k, top_p, labels)
    return torch.stack([logprobs_from_logits(logits, labels), entropy_from_logits(logits)], dim=-1)


def token_log_probs_and_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                                chunk_tokens: int = 1024) -> tuple[Tensor, Tensor]:
    """(log p(label), entropy), each shaped like ``labels``, of the distribution
    ``filter(softmax(hidden @ weight.T + bias) / temperature)``; ``hidden`` is (..., H), ``labels`` (...).

    Differentiable in ``hidden``, ``weight`` and ``bias`` (both outputs) when grad is enabled."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree but for the last dim")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    parts = []
    for start in range(0, flat_h.shape[0], chunk_tokens):
        args = (flat_h[start:start + chunk_tokens], weight, bias, flat_y[start:start + chunk_tokens],
                temperature, top_k, top_p)
        parts.append(checkpoint(_chunk_scores, *args, use_reentrant=False) if grad else _chunk_scores(*args))
    scores = torch.cat(parts) if parts else flat_h.new_zeros((0, 2), dtype=torch.float32)
    return scores[:, 0].reshape(labels.shape), scores[:, 1].reshape(labels.shape)
