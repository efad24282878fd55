"""Does the trainer score what the sampler sampled? Pure tensor math for the consistency check.

Two measures, both cheap:

- ``mismatch_sums``: statistics of the per-token log-ratio ``d = trainer - sampler`` of the sampled
  tokens (the trainer's log-probs are the ones the update computes anyway; the sampler's came with
  the rollout). They are *sums* (token counts, sums of |d|, of d, out-of-band counts) and one max,
  so micro-batches and ranks combine exactly (``merge_mismatch_sums``; ranks: sum, max) before
  ``mismatch_metrics`` turns them into means. Broken down by policy-version lag (where tokens carry
  versions) and by turn (first policy segment of a row vs later ones), because the cause of a
  mismatch shows in *where* it is: stale tokens differ by the policy's own change, later turns alone
  by a context the trainer re-rendered.
- ``weight_checksums``: per tensor (element count, sum, sum of squares) in float64, of the values
  cast to the engine's dtype. Sums add over shards and over the parts of a fused tensor, so an
  engine's checksum and the trainer's agree exactly when the weights do; a stale, skipped or
  corrupted tensor shows, by name, in ``compare_checksums``. (A checksum of sums does not see a
  permutation of a tensor's values; it sees every stale or missing update.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from rlcore.algos.stats import check_same_shape

Tensor = torch.Tensor

MAX_LAG = 4  # version lags 0..3 each, and 4 or more together ("lag_4")
SUM_KEYS = ("tokens", "abs_sum", "signed_sum", "out_of_band", "first_tokens", "first_abs_sum", "later_tokens",
            "later_abs_sum")
Checksum = tuple[int, float, float]  # (elements, sum, sum of squares)


@torch.no_grad()
def turn_index(response_mask: Tensor) -> Tensor:
    """(B, T) the turn of each response position: 0 in a row's first run of policy tokens (mask 1),
    1 in the second run and so on (env tokens between runs are mask 0). Positions before the first
    policy token are -1."""
    valid = response_mask.bool()
    prev = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    starts = valid & ~prev
    return starts.long().cumsum(-1) - 1


@torch.no_grad()
def mismatch_sums(trainer_log_probs: Tensor, sampler_log_probs: Tensor, response_mask: Tensor,
                  band: tuple[float, float] = (0.9, 1.1), lags: Tensor | None = None) -> dict[str, Tensor]:
    """Additive statistics of ``d = trainer - sampler`` over the valid tokens (``response_mask``).

    ``band``: a token is out of band when its ratio ``exp(d)`` is outside ``[band[0], band[1]]``.
    ``lags`` (B, T): the policy-version lag of each token (trainer's version - the token's); with it,
    ``lag_<k>/{tokens,abs_sum,out_of_band}`` per lag k in 0..MAX_LAG (MAX_LAG: that many or more),
    and the version-independent totals still cover every token. Keys: see ``SUM_KEYS`` and
    ``abs_max``; every value a float64 scalar tensor.
    """
    check_same_shape("trainer_log_probs", trainer_log_probs, "sampler_log_probs", sampler_log_probs)
    check_same_shape("trainer_log_probs", trainer_log_probs, "response_mask", response_mask)
    lo, hi = band
    if not 0 < lo < 1 < hi:
        raise ValueError(f"the ratio band must satisfy 0 < low < 1 < high, got {band}")
    valid = response_mask.bool()
    d = (trainer_log_probs.double() - sampler_log_probs.double()).where(valid, 0.0)
    out = (d < math.log(lo)) | (d > math.log(hi))
    turn = turn_index(response_mask)
    first, later = valid & (turn == 0), valid & (turn > 0)

    def total(x: Tensor) -> Tensor:
        return x.double().sum()

    sums = {
        "tokens": total(valid), "abs_sum": total(d.abs()), "signed_sum": total(d), "out_of_band": total(out & valid),
        "first_tokens": total(first), "first_abs_sum": total(d.abs() * first),
        "later_tokens": total(later), "later_abs_sum": total(d.abs() * later),
        "abs_max": d.abs().max().double() if d.numel() else torch.zeros((), dtype=torch.float64),
    }
    if lags is not None:
        check_same_shape("lags", lags, "response_mask", response_mask)
        bucket = lags.clamp(0, MAX_LAG)
        for k in range(MAX_LAG + 1):
            at = valid & (bucket == k)
            sums[f"lag_{k}/tokens"] = total(at)
            sums[f"lag_{k}/abs_sum"] = total(d.abs() * at)
            sums[f"lag_{k}/out_of_band"] = total(out & at)
    return sums


def merge_mismatch_sums(parts: Iterable[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Several ``mismatch_sums`` (micro-batches) as one: every entry summed, ``abs_max`` maxed."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            if key not in merged:
                merged[key] = value.clone()
            elif key == "abs_max":
                merged[key] = torch.maximum(merged[key], value)
            else:
                merged[key] = merged[key] + value
    return merged


def mismatch_metrics(sums: Mapping[str, Tensor], prefix: str = "check/") -> dict[str, float]:
    """Means of ``mismatch_sums`` (merged over micro-batches and ranks) as metrics:
    ``logprob_abs_diff_mean``, ``logprob_abs_diff_max``, ``logprob_diff_mean`` (signed: trainer -
    sampler), ``ratio_out_of_band`` (share of tokens), ``tokens``; ``logprob_abs_diff_mean/turn_first``
    and ``/turn_later`` when rows have several turns; per lag ``.../lag_<k>`` (with ``tokens/lag_<k>``)
    for the lags that have tokens. Nothing when there are no valid tokens."""
    n = float(sums["tokens"])
    if n == 0:
        return {}
    out = {
        "logprob_abs_diff_mean": float(sums["abs_sum"]) / n,
        "logprob_abs_diff_max": float(sums["abs_max"]),
        "logprob_diff_mean": float(sums["signed_sum"]) / n,
        "ratio_out_of_band": float(sums["out_of_band"]) / n,
        "tokens": n,
    }
    if float(sums["later_tokens"]) > 0:
        out["logprob_abs_diff_mean/turn_first"] = float(sums["first_abs_sum"]) / max(float(sums["first_tokens"]), 1.0)
        out["logprob_abs_diff_mean/turn_later"] = float(sums["later_abs_sum"]) / float(sums["later_tokens"])
    for k in range(MAX_LAG + 1):
        count = float(sums.get(f"lag_{k}/tokens", 0.0))
        if count:
            out[f"tokens/lag_{k}"] = count
            out[f"logprob_abs_diff_mean/lag_{k}"] = float(sums[f"lag_{k}/abs_sum"]) / count
            out[f"ratio_out_of_band/lag_{k}"] = float(sums[f"lag_{k}/out_of_band"]) / count
    return {prefix + k: v for k, v in out.items()}


# ------------------------------------------------------------------ weights
@torch.no_grad()
def tensor_checksum(tensor: Tensor, dtype: torch.dtype | None = None) -> Checksum:
    """(elements, sum, sum of squares) of ``tensor``'s values cast to ``dtype`` (the engine's), in float64."""
    values = tensor.detach()
    if dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    values = values.double()
    return values.numel(), float(values.sum()), float(values.square().sum())


def weight_checksums(named: Iterable[tuple[str, Tensor]], dtypes: Mapping[str, str] | None = None
                     ) -> dict[str, Checksum]:
    """``tensor_checksum`` of each named tensor, cast to ``dtypes[name]`` (a torch dtype's name) when given."""
    return {name: tensor_checksum(t, None if dtypes is None or name not in dtypes else getattr(torch, dtypes[name]))
            for name, t in named}


def add_checksums(parts: Iterable[Checksum]) -> Checksum:
    """The checksum of the concatenation of tensors (a fused tensor's parts, or a tensor's shards)."""
    n, s, q = 0, 0.0, 0.0
    for pn, ps, pq in parts:
        n, s, q = n + pn, s + ps, q + pq
    return n, s, q


def checksums_match(a: Checksum, b: Checksum, rtol: float = 1e-7) -> bool:
    """Equal element counts and sums equal up to float64 summation order: the tolerance scales with
    the root of (elements x sum of squares), the bound on |sum| (Cauchy-Schwarz)."""
    if a[0] != b[0]:
        return False
    scale = math.sqrt(max(a[0] * max(a[2], b[2]), 0.0)) + 1e-30
    return abs(a[1] - b[1]) <= rtol * scale and abs(a[2] - b[2]) <= rtol * (max(a[2], b[2]) + 1e-30)


def compare_checksums(trainer: Mapping[str, Checksum], engine: Mapping[str, Checksum],
                      rtol: float = 1e-7) -> dict[str, list[str]]:
    """Names, sorted, of the tensors that ``differ``, that the engine lacks (``missing``) or that only
    the engine has (``unexpected``)."""
    return {
        "differ": sorted(n for n in trainer.keys() & engine.keys() if not checksums_match(trainer[n], engine[n], rtol)),
        "missing": sorted(trainer.keys() - engine.keys()),
        "unexpected": sorted(engine.keys() - trainer.keys()),
    }
