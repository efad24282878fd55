"""DAPO's sample-level pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale"), as tensor math that ``recipes/dapo.py`` composes:

- ``group_has_signal``: which prompt groups can teach anything. A group whose responses all
  score the same (all right, all wrong) has zero advantage everywhere under a group baseline, so
  it adds no gradient and only dilutes a token-mean loss; dynamic sampling drops such groups and
  draws more prompts instead.
- ``truncated_rows``: responses cut at the length limit. Their reward says little about the
  response (it was stopped, not finished), so overlong filtering keeps them out of the loss.
- ``overlong_penalty``: the soft overlong punishment, a length penalty that ramps from 0 to -1
  over the last ``buffer_len`` tokens before the limit, so the policy learns to stop early before
  it learns that cut responses are wrong.

Clip-higher (``actor.clip_ratio_high``) and the token-level loss (``actor.loss_agg_mode``) are
settings of the existing policy loss, not code here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def group_has_signal(values: Tensor, index: np.ndarray | Sequence) -> Tensor:
    """Per row: whether the row's group (the rows sharing its ``index``, e.g. a prompt's ``uid``)
    holds at least two different ``values``. (B,) bool.

    "Different" is exact inequality, not a std threshold: rule rewards are a few exact numbers, and
    a group that differs at all has a nonzero advantage somewhere. A group of one row never has
    signal (its std is 0 too).
    """
    if values.ndim != 1 or len(values) != len(index):
        raise ValueError(f"values must be (B,) with one index per row, got shape {tuple(values.shape)} "
                         f"and {len(index)} indices")
    _, inverse = np.unique(np.asarray(index), return_inverse=True)
    groups = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=values.device)
    v = values.double()
    n = int(groups.max()) + 1 if len(v) else 0
    high = torch.full((n,), -torch.inf, dtype=v.dtype, device=v.device).scatter_reduce(0, groups, v, "amax")
    low = torch.full((n,), torch.inf, dtype=v.dtype, device=v.device).scatter_reduce(0, groups, v, "amin")
    return (high > low)[groups]


def truncated_rows(responses: Tensor, response_mask: Tensor, max_len: int, stop_ids: Sequence[int]) -> Tensor:
    """Per row: whether the response was cut at the length limit, i.e. it holds ``max_len`` tokens
    and the last one is not a stop token. (B,) bool.

    The rollout layout has no stop reason, but the stopping rule (``rlcore.engines.base``) makes one
    unnecessary: a response ends at a stop token (kept as its last token) or after ``max_len``
    tokens. A response that ends with a stop string completed exactly at the limit counts as cut
    (stop strings are text, not ids); with the default stop set (eos) there is no such case.
    """
    if responses.shape != response_mask.shape:
        raise ValueError(f"responses {tuple(responses.shape)} and response_mask {tuple(response_mask.shape)} differ")
    lengths = response_mask.sum(-1).long()
    last = responses.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    stopped = torch.isin(last, torch.as_tensor(list(stop_ids), dtype=last.dtype, device=last.device))
    return (lengths >= max_len) & ~stopped


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment of a response of ``lengths`` tokens, (B,) float32:

        0                                   if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
        -1                                  if |y| > L_max

    times ``penalty_factor``, with L_max = ``max_len`` and L_cache = ``buffer_len``. The middle
    piece reaches -1 at L_max, so the penalty is continuous up to the limit: one token longer
    costs 1 / L_cache, a gradient the policy can follow, unlike the cliff of a cut response.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    expected = max_len - buffer_len
    y = lengths.double()
    penalty = torch.where(y <= expected, torch.zeros_like(y), (expected - y) / buffer_len)
    penalty = torch.where(y > max_len, torch.full_like(y, -1.0), penalty)
    return (penalty * penalty_factor).float()
