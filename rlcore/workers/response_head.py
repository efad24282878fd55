"""The causal LM's output layer, able to score response tokens without materialising logits.

``install_response_head(model)`` puts a ``ResponseHead`` where the model's ``lm_head`` was,
holding the very same parameters (so the state dict, tied embeddings, FSDP2 sharding, checkpoints,
exports and weight syncs see no change: ``lm_head.weight`` is still ``lm_head.weight``). Called as
usual it is the plain linear layer. Inside ``head.scoring(labels, ...)``, the model's forward with
``logits_to_keep`` set to the positions that predict ``labels`` hands the head exactly those hidden
states, and the head returns, in place of logits, (B, T_r, 2): each label's log-prob and the
distribution's entropy, computed in chunks (``rlcore.algos.token_scores``). The head runs inside
the model's own forward, so FSDP2's hooks on the root gather and free its weight as for any forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlcore.algos.token_scores import chunk_tokens_for, token_log_probs_and_entropy
from rlcore.models import cpu_matmul


@dataclass(frozen=True)
class ScoreRequest:
    labels: torch.Tensor  # (B, T_r) token ids the kept positions predict
    temperature: float
    top_k: int
    top_p: float
    entropy_grad: bool  # False: the entropy is a metric only, no gradient through it (see ResponseHead.scoring)


class ResponseHead(nn.Module):
    def __init__(self, linear: nn.Linear, chunk_mb: float, keep_mb: float = 0.0) -> None:
        super().__init__()
        self.weight = linear.weight  # the same Parameter objects: ties and names stay as they were
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.chunk_tokens = chunk_tokens_for(linear.out_features, chunk_mb)
        self.keep_logits(keep_mb)
        self._request: ScoreRequest | None = None
        self.onednn = False  # its fp32 CPU matmuls on oneDNN: set by rlcore.models.cpu_matmul.install_cpu_matmul (its FLAG)

    def keep_logits(self, mb: float) -> None:
        """Keep up to ``mb`` MiB of a forward's fp32 logits for its backward (token_scores: no recompute
        there; 0: none), as positions: ``keep_tokens``."""
        self.keep_tokens = chunk_tokens_for(self.out_features, mb) if mb > 0 else 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._request is None:
            return cpu_matmul.linear_layer(hidden, self.weight, self.bias, self.onednn)
        r = self._request
        if hidden.shape[:-1] != r.labels.shape:
            raise ValueError(f"ResponseHead.scoring: the model handed the head {tuple(hidden.shape[:-1])} positions for "
                             f"labels {tuple(r.labels.shape)}: pass logits_to_keep=scored_positions(...) (packed: rlcore.workers.packing.response_inputs) to its forward")
        log_prob, entropy = token_log_probs_and_entropy(
            hidden, self.weight, r.labels, bias=self.bias, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
            chunk_tokens=self.chunk_tokens, keep_tokens=self.keep_tokens, onednn=self.onednn)
        if not r.entropy_grad:  # token_scores' backward then skips the entropy's four passes over each chunk
            entropy = entropy.detach()
        return torch.stack([log_prob, entropy], dim=-1)

    @contextmanager
    def scoring(self, labels: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, entropy_grad: bool = True) -> Iterator[None]:
        """Within it, a forward returns (B, T_r, 2) log-probs and entropies of ``labels`` instead of logits.

        ``entropy_grad=False`` where no loss term uses the entropy (an actor without an entropy bonus):
        the two are stacked into one output, so its backward would otherwise hand the entropy a
        gradient of zeros, and the chunked backward would work it through every chunk's logits
        (at SmolLM2's 49k vocabulary four full passes per chunk, ~0.2 s of a 25 s update) for nothing."""
        self._request = ScoreRequest(labels, temperature, top_k, top_p, entropy_grad)
        try:
            yield
        finally:
            self._request = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, chunk_tokens={self.chunk_tokens}, "
                f"keep_tokens={self.keep_tokens}")


def scored_positions(seq_len: int, response_len: int, device: torch.device) -> torch.Tensor:
    """The positions T-T_r-1 .. T-2, whose outputs predict the T_r response tokens (``logits_to_keep``)."""
    return torch.arange(seq_len - response_len - 1, seq_len - 1, device=device)


def install_response_head(model: nn.Module, chunk_mb: float, keep_mb: float = 0.0) -> ResponseHead:
    """Replace ``model``'s output layer (a bias-free or biased ``nn.Linear``) by a ``ResponseHead`` on its
    parameters, scoring ``chunk_mb`` MiB of fp32 logits at a time and keeping up to ``keep_mb`` MiB of
    them from a forward for its backward."""
    linear = model.get_output_embeddings()
    if isinstance(linear, ResponseHead):
        return linear
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{type(model).__name__}'s output layer is a {type(linear).__name__}, not nn.Linear")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits after the head: scoring in the head would skip that")
    head = ResponseHead(linear, chunk_mb, keep_mb)
    model.set_output_embeddings(head)
    return head
