"""Each token's log-prob and entropy from the last hidden states, without the (B, T, V) logits.

Why: at a real vocabulary the logits are the largest tensor of a training step. SmolLM2's 49k
tokens x 16 rows x 128 response tokens are 400 MB in fp32, and the plain path holds several such
tensors at once (the head's output, its fp32 copy, the temperature division, softmax and the
products of the entropy), and autograd keeps some of them for the backward. Here the head's
matmul, the fp32 cast, the temperature, the sampler's top-k / top-p filter, the log-softmax and
the entropy run on ``chunk_tokens`` positions at a time, and the backward is written out
(``_ChunkScores``): it keeps only each position's log-sum-exp and expected logit, recomputes one
chunk's logits at a time and turns them into the gradient in place. Each full-vocabulary pass is
a pass over memory (a chunk of 341 x 49k fp32 logits is 64 MiB), so the forward makes the fewest
(max, exp and one dot product; no softmax tensor) and the backward reuses the forward's
log-sum-exp and E and skips the entropy's term when the loss does not use the entropy. Unless some are
kept (below), at most one chunk's logits (and two tensors of its size) exist at any moment, whatever
the batch; the price is the head's matmul once more in the backward, over the response positions only.

That price can be bought back with memory: ``keep_tokens`` positions' logits (whole chunks, the first
ones) are kept from the forward and the backward works on them in place instead of recomputing them
(the same tensors, so the same gradients bit for bit). At SmolLM2 on 2 CPU cores the recompute is
0.23 of the update's 4.2 TFLOP; a 16-row micro-batch of 32 response tokens keeps 96 MiB (the actor's
``actor.keep_logits_mb`` caps it; docs/benchmarks.md, "Where the update loses time").

The numbers are those of the plain path (``logprobs_from_logits`` / ``entropy_from_logits`` of
``filter_logits(logits.float() / temperature)``), chunked over positions: rows of a matmul do not
depend on the other rows, so chunking changes the result only by the matmul's blocking (~1e-7).
The gradient is autograd's of that path (tests compare both against float64 autograd):
with z the filtered logits, p = softmax(z) and E = sum_v p_v z_v,

    d log p_y / dz_v = 1[v = y] - p_v          d entropy / dz_v = -p_v (z_v - E)

(filtered tokens have p_v = 0 and get nothing), then through z = (h W^T + b) / temperature, in the
dtype of h and W, as autograd would cast it back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore.algos.sampling import filter_logits, sampling_filter_active
from rlcore.models import cpu_matmul

Tensor = torch.Tensor
FP32_BYTES = 4


def chunk_tokens_for(vocab_size: int, chunk_mb: float) -> int:
    """Positions per chunk so that one chunk's fp32 logits take about ``chunk_mb`` MiB."""
    return max(1, int(chunk_mb * (1 << 20)) // (vocab_size * FP32_BYTES))


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float, top_k: int,
            top_p: float, onednn: bool = False) -> Tensor:
    """One chunk's fp32 logits as the sampler saw them: / temperature, then top-k / top-p (-inf)."""
    z = cpu_matmul.linear(hidden, weight, bias, onednn).float()
    if temperature != 1.0:
        z.div_(temperature)
    return filter_logits(z, top_k, top_p, labels)


def _lse_expected_entropy(z: Tensor, filtered: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp, expected logit E = sum_v p_v z_v, entropy = lse - E) of a chunk's logits, from
    the shifted logits s = z - max and e = exp(s): two temporaries of the chunk's size, no softmax
    tensor. The entropy is log(sum e) - (e . s) / sum e, free of the cancellation of lse - E when
    both are large."""
    top = z.amax(-1, keepdim=True)
    shifted = z - top
    e = torch.exp(shifted)
    total = e.sum(-1)
    if filtered:  # e = 0 there: 0 * -inf would be NaN
        shifted.masked_fill_(torch.isneginf(shifted), 0.0)
    mean_shift = torch.linalg.vecdot(e, shifted) / total
    top = top.squeeze(-1)
    return top + total.log(), top + mean_shift, total.log() - mean_shift


class _ChunkScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, top_k, top_p, chunk_tokens, keep_tokens, onednn):
        filtered = sampling_filter_active(top_k, top_p)
        n = hidden.shape[0]
        log_prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, lse, expected = torch.empty_like(log_prob), torch.empty_like(log_prob), torch.empty_like(log_prob)
        kept: list[Tensor] = []  # the first chunks' logits, for the backward to use in place of recomputing them
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = _logits(hidden[s:e], weight, bias, labels[s:e], temperature, top_k, top_p, onednn)
            lse[s:e], expected[s:e], entropy[s:e] = _lse_expected_entropy(z, filtered)
            log_prob[s:e] = z.gather(-1, labels[s:e, None]).squeeze(-1) - lse[s:e]
            if e <= keep_tokens:
                kept.append(z)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, expected)
        ctx.kept = kept  # not saved tensors: the backward consumes them (a second backward recomputes)
        ctx.settings = (temperature, top_k, top_p, chunk_tokens, filtered, onednn)
        ctx.set_materialize_grads(False)  # an output the loss does not use (often the entropy) gets None
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        """Per chunk, the logits (kept from the forward, or computed once more) and, in place on them, p = exp(z - lse) times the per-row
        factors of both gradients (their sum is linear in z: -g_lp - g_ent (z - E)); the one-hot
        part of the log-prob's added at the labels; divided by the temperature through the factors."""
        hidden, weight, bias, labels, lse, expected = ctx.saved_tensors
        temperature, top_k, top_p, chunk_tokens, filtered, onednn = ctx.settings
        kept, ctx.kept = ctx.kept, []  # worked on in place below: a second backward must recompute them
        if grad_log_prob is None and grad_entropy is None:
            return (None,) * 10
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = grad_b = None
        n = hidden.shape[0]
        for i, s in enumerate(range(0, n, chunk_tokens)):
            e = min(s + chunk_tokens, n)
            if i < len(kept):
                z, kept[i] = kept[i], None  # freed as soon as this chunk's gradient is taken
            else:
                z = _logits(hidden[s:e], weight, bias, labels[s:e], temperature, top_k, top_p, onednn)
            g_lp = grad_log_prob[s:e, None] / temperature if grad_log_prob is not None else None
            if grad_entropy is not None:  # the entropy's factor -g_ent (z - E), before z turns into p
                g_ent = grad_entropy[s:e, None] / temperature
                factor = z - expected[s:e, None]
                if filtered:  # p = 0 there: 0 * -inf would be NaN
                    factor.masked_fill_(torch.isneginf(z), 0.0)
                factor.mul_(-g_ent)
                if g_lp is not None:
                    factor.sub_(g_lp)
            grad_z = z.sub_(lse[s:e, None]).exp_()  # p, in place of the logits
            if grad_entropy is not None:
                grad_z.mul_(factor)
            else:
                grad_z.mul_(-g_lp)
            if g_lp is not None:
                grad_z.scatter_add_(-1, labels[s:e, None], g_lp)  # + 1[v = y] of the log-prob's
            grad_pre = grad_z.to(hidden.dtype)
            if want_h:
                grad_h[s:e] = cpu_matmul.input_grad(grad_pre, weight, onednn)
            if want_w:
                part = grad_pre.t() @ hidden[s:e]
                grad_w = part.float() if grad_w is None else grad_w.add_(part)
            if want_b:
                part = grad_pre.float().sum(0)
                grad_b = part if grad_b is None else grad_b.add_(part)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None, None)


def token_log_probs_and_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                                temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                                chunk_tokens: int = 1024, keep_tokens: int = 0, onednn: bool = False) -> tuple[Tensor, Tensor]:
    """(log p(label), entropy), fp32 and shaped like ``labels``, of the distribution
    ``filter(softmax(hidden @ weight.T + bias) / temperature)``; ``hidden`` is (..., H), ``labels`` (...).

    Differentiable in ``hidden``, ``weight`` and ``bias`` (both outputs). ``keep_tokens``: up to this
    many positions' logits (whole chunks) are kept for the backward instead of recomputed there; only
    where a backward can follow (grad enabled and an input that needs it). ``onednn``: the head's matmuls
    (but the weight's gradient) on oneDNN where it applies (``rlcore.models.cpu_matmul``)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree but for the last dim")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    log_prob, entropy = _ChunkScores.apply(flat_h, weight, bias, flat_y, temperature, top_k, top_p, chunk_tokens,
                                           keep_tokens if grads else 0, onednn)
    return log_prob.reshape(labels.shape), entropy.reshape(labels.shape)
